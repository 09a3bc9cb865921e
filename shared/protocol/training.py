"""The trainer on the bus: jobs, per-step metrics, the stream timeline, and hot reload of new weights."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.shared.protocol.adapters import AdapterName
from tandem.shared.protocol.base import WireMessage


class TrainJob(BaseModel):
    """One training run: what to train, on what, for how long, and how."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = "tiny"  # "tiny", a preset name (see tandem.shared.train), or a Hugging Face directory
    # "stdlib" (the Python standard library's sources), "random", a text file or folder, or a JSONL file of
    # fine-tuning records (chat messages or prompt/completion: shared/train/finetune_data.py)
    dataset: str = "stdlib"
    # auto: a .jsonl file holds fine-tuning records of either kind, anything else is text; chat or completion:
    # JSONL whose every record is that kind; text: the file as plain text whatever its name
    data_format: Literal["auto", "text", "chat", "completion"] = "auto"
    pack: bool = True  # fine-tuning records: pack short examples into rows (attention kept within each)
    steps: int = Field(100, ge=1)
    batch_size: int = Field(8, ge=1)
    seq_len: int = Field(256, ge=2)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    grad_clip: float = Field(1.0, ge=0)  # global-norm clipping; 0 turns it off
    warmup_steps: int = Field(0, ge=0)
    seed: int = Field(0, ge=0)
    device: str = "auto"
    checkpoint_every: int = Field(0, ge=0)  # steps between checkpoints; 0: only at the end
    output_dir: str | None = None  # default: <data_dir>/train/<job_id>
    resume: bool = False  # continue from the latest checkpoint in output_dir
    gpu_memory_gib: float | None = Field(None, gt=0)  # cap through set_per_process_memory_fraction
    # first layers whose AdamW math runs on the GPU (0: all on the CPU; None: chosen from the cap on CUDA)
    device_update_layers: int | None = Field(None, ge=0)
    device_update_sets: int = Field(2, ge=1, le=16)  # GPU buffer sets for those updates (state loads ahead)
    # of the GPU-updated layers, how many keep fp32 masters and moments on the GPU for the whole run
    # (None: chosen from the cap with device_update_layers; given alone, that many layers are GPU-updated too)
    device_resident_layers: int | None = Field(None, ge=0)
    compile_layers: bool | None = None  # torch.compile the layer blocks; None: on CUDA only
    split_update: bool | None = None  # host AdamW as preview + commit (optimizer.py); None: on CUDA only
    # The host state's formats (shared/train/state_format.py): bf16 masters rounded stochastically or with a
    # Kahan compensation, 8-bit block-quantized Adam moments; each host-updated only (no GPU-updated layers)
    master_weights: Literal["fp32", "bf16-sr", "bf16-kahan"] = "fp32"
    adam_moments: Literal["fp32", "int8"] = "fp32"
    # CUDA kernels with a fixed reduction order (shared/train/determinism.py): reruns and resumes are bit-exact;
    # False: the atomics-based backward kernels (embedding, attention), slightly faster, last bits vary
    deterministic: bool = True
    # LoRA (shared/train/lora.py): train an adapter of this rank on the frozen model (None: full training);
    # alpha None: 2 x rank; targets: of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (None: all)
    lora_rank: int | None = Field(None, ge=1)
    lora_alpha: float | None = Field(None, gt=0)
    lora_targets: list[str] | None = None
    # Publish every checkpoint of the adapter to the serving fleet under this name (a new version each
    # time: shared/protocol/adapters.py), so running workers serve it without a restart.
    publish_adapter: AdapterName | None = None

    @model_validator(mode="after")
    def _lora_needs_rank(self) -> TrainJob:
        if self.lora_rank is None and (self.lora_alpha is not None or self.lora_targets is not None
                                       or self.publish_adapter is not None):
            raise ValueError("lora_alpha, lora_targets and publish_adapter need lora_rank")
        return self


class TrainStart(WireMessage):
    kind: Literal["train_start"] = "train_start"
    job_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")
    job: TrainJob = Field(default_factory=TrainJob)


class TrainStop(WireMessage):
    kind: Literal["train_stop"] = "train_stop"
    job_id: str


class TrainStatusRequest(WireMessage):
    kind: Literal["train_status"] = "train_status"
    job_id: str | None = None  # None: every job this trainer knows


class TrainJobStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    job_id: str
    state: Literal["queued", "running", "stopping", "stopped", "finished", "failed"]
    step: int
    steps: int
    loss: float | None = None
    message: str = ""


class TrainStatusReply(WireMessage):
    kind: Literal["train_status_reply"] = "train_status_reply"
    trainer: str  # instance id
    jobs: list[TrainJobStatus]


class TrainStepMetrics(WireMessage):
    """Published after every optimizer step of a job."""

    kind: Literal["train_step"] = "train_step"
    job_id: str
    step: int
    loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float  # the batch's tokens that are not padding, per second
    model_tflops: float  # (6N + 6 L d seq) * those tokens / step time, as in DESIGN.md
    step_time_s: float
    padding_fraction: float = 0.0  # of the batch's positions, those that hold padding (fine-tuning rows)
    gpu_memory_bytes: int = 0  # allocated now
    gpu_memory_peak_bytes: int = 0


class TimelineOp(BaseModel):
    """One operation of a training step on one lane, times in seconds from the step's start."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    lane: Literal["h2d", "compute", "d2h", "optimizer"]
    layer: int  # -1: not a decoder layer (embedding, head, loss)
    phase: Literal["fwd", "bwd", "opt", "recompute"]
    start_s: float
    end_s: float
    bytes: int = 0


class TrainTimeline(WireMessage):
    """The per-layer timeline of one step, at a bounded rate, for the console's stream-overlap view."""

    kind: Literal["train_timeline"] = "train_timeline"
    job_id: str
    step: int
    ops: list[TimelineOp]
    hidden_fraction: float  # of host<->device transfer time, the part under compute


class WeightsUpdated(WireMessage):
    """A trainer saved new weights for ``model``: workers serving it reload from ``path``."""

    kind: Literal["weights_updated"] = "weights_updated"
    model: str  # the served model name ("tiny" or the directory's name)
    path: str
    step: int
    version: str  # changes with every checkpoint; part of the KV namespace after a reload
