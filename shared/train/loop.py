"""One training job from start to finish: what `tandem train`, the trainer service and the
benchmark run. Builds the host state (fresh, from a Hugging Face directory, or resumed from the
job's own checkpoint), the host optimizer and the offloaded step, then steps, reporting each step,
a per-op trace at a bounded rate, and checkpoints. A LoRA job (``job.lora_rank``) builds the frozen
base (frozen_base.py), the adapter and its device-side AdamW (lora.py) and the LoRA step
(lora_step.py) instead, and checkpoints the adapter in PEFT's format (lora_checkpoint.py).

    runner = TrainLoop(TrainJob(model="tiny", steps=100), "job-1", data_dir=Path("~/.local/share/tandem"))
    summary = runner.run(on_step=print)
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.shared.lora.peft_format import AdapterConfig, AdapterError
from tandem.shared.model.config import ModelConfig, ModelLoadError
from tandem.shared.model.meta import read_hf_config
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.training import TimelineOp, TrainJob, TrainStepMetrics
from tandem.shared.text.bpe_trainer import train_bpe, write_tokenizer_dir
from tandem.shared.text.chat_template import (
    SPECIAL_TOKENS_MAP,
    TEMPLATE_DIR,
    TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    ChatTemplate,
    ChatTemplateError,
)
from tandem.shared.text.tokenizer import ByteTokenizer, HFTokenizer
from tandem.shared.train.checkpoint import (
    finish_interrupted_save,
    has_checkpoint,
    restore_optimizer,
    save_checkpoint,
)
from tandem.shared.train.data import TokenData, dataset_files
from tandem.shared.train.finetune_data import FinetuneData, records_kind, training_template
from tandem.shared.train.frozen_base import FrozenBase
from tandem.shared.train.host_state import HostState
from tandem.shared.train.lanes import hidden_fraction
from tandem.shared.train.layout import count_parameters
from tandem.shared.train.lora import AdapterAdamW, TrainedAdapter, adapter_numel, check_targets, lora_config
from tandem.shared.train.lora_checkpoint import has_adapter_checkpoint, restore_adapter, save_adapter_checkpoint
from tandem.shared.train.lora_step import LoraStep
from tandem.shared.train.offload_step import OffloadStep, StepHandle
from tandem.shared.train.optimizer import BETAS, EPS, HostAdamW, lr_schedule
from tandem.shared.train.plan import (
    H200,
    H200_SMS,
    GiB,
    MemoryPlan,
    Placement,
    PlanError,
    Rates,
    choose_lora_resident,
    choose_placement,
    host_ram_available,
    lora_step_bound,
    measure_rates,
    memory_plan,
    step_bound,
)
from tandem.shared.train.presets import resolve_model, trained_tokenizer_vocab
from tandem.shared.train.state_format import StateFormat

log = logging.getLogger("tandem.train")
# What a checkpoint takes from the directory it started from, beside its own weights and config.
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, TEMPLATE_FILE)


@dataclass
class RunSummary:
    state: str  # "finished" or "stopped"
    step: int
    loss: float | None
    mean_loss: float | None  # over the last 10 steps
    wall_s: float
    checkpoint: Path | None


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` names (auto: CUDA when there is one); a spec that names none, or CUDA
    where there is none, is ``invalid_request``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"device {spec!r} is none of auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"device {spec!r} asked for, but CUDA is not available")
    return device


@dataclass
class JobSetup:
    """What a job will be, decided before anything large is allocated (:func:`plan_job`)."""

    config: ModelConfig
    init_from: Path | None
    model_name: str
    device: torch.device
    dtype: torch.dtype
    resume: bool
    output_dir: Path
    data: TokenData | FinetuneData
    split: bool
    placement: Placement
    plan: MemoryPlan
    bound: dict[str, float]  # step_bound of the placement with the rates it was chosen with
    lora: AdapterConfig | None = None  # a LoRA job's adapter (its base frozen); None: full training
    tokenizer_dir: Path | None = None  # where the tokenizer (and chat template) come from; None: byte-level


def gpu_cap_bytes(device: torch.device, gpu_memory_gib: float | None) -> int | None:
    """The bytes the job may use on ``device``: the cap (at most the device's memory), or, uncapped,
    what is free now; ``None`` on CPU."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    if gpu_memory_gib:
        return min(total, int(gpu_memory_gib * GiB))
    free, _ = torch.cuda.mem_get_info(device)
    return free


def plan_job(job: TrainJob, output_dir: Path, rates: Rates | None = None, mlp_chunk: int = 16384) -> JobSetup:
    """Resolve the model, read the data and make the memory plan and the placement, allocating
    nothing large. Placement: ``job.device_update_layers`` or ``job.device_resident_layers`` given
    (not None) is taken as is, with ``r`` resident of the ``k`` GPU-updated
    layers (``k`` alone: none resident; ``r`` alone: ``k = r``); otherwise CUDA chooses from the cap
    (plan.choose_placement) with ``rates`` (None: measured now, about a second) and CPU updates every
    layer on the host."""
    device = resolve_device(job.device)
    try:
        config, init_from, model_name = resolve_model(job.model)
    except ModelLoadError as exc:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    lora = job_adapter(job, init_from, model_name, output_dir)
    if job.resume and finish_interrupted_save(output_dir):
        log.info("%s: completed the save its last run was stopped in", output_dir)
    if lora is not None:  # the base is the job's model whether resumed or not
        resume = job.resume and has_adapter_checkpoint(output_dir)
    else:
        resume = job.resume and has_checkpoint(output_dir)
    if resume and lora is None:
        config = read_hf_config(output_dir)
    if job.seq_len > config.max_position_embeddings:
        # trained at this length, the checkpoint must say so, or a server loading it caps requests
        # at the old length (RoPE's frequencies, llama3 scaling included, do not depend on it)
        log.info("max_position_embeddings %d -> %d: the job trains at that length",
                 config.max_position_embeddings, job.seq_len)
        config = config.replace(max_position_embeddings=job.seq_len)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer_dir = init_from
    vocab = trained_tokenizer_vocab(job.model)
    if vocab is not None:
        tokenizer_dir = job_tokenizer(job.dataset, vocab, output_dir, resume)
    data = load_data(job, config, tokenizer_dir, model_name)
    data_bytes = data.nbytes
    cap, host_free = gpu_cap_bytes(device, job.gpu_memory_gib), host_ram_available()
    sets = job.device_update_sets
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS

    fmt = state_format(job)

    def plan_for(placement: Placement, split: bool) -> MemoryPlan:
        return memory_plan(config, dtype, job.batch_size, job.seq_len, placement, device=device.type, split=split,
                           gpu_cap=cap, host_available=host_free, mlp_chunk=mlp_chunk, data_bytes=data_bytes,
                           packed=data.packed, deterministic=job.deterministic, sm_count=sms, state_format=fmt)

    if lora is not None:
        return _lora_setup(job, config, init_from, model_name, device, dtype, resume, output_dir, data, lora, cap,
                           host_free, mlp_chunk, sms, rates, tokenizer_dir)
    split = job.split_update if job.split_update is not None else device.type == "cuda"
    if split and job.split_update is None and not plan_for(Placement(), True).fits_host():
        log.info("no room in host RAM for a second gradient buffer; host AdamW runs whole updates")
        split = False
    # not model_fields_set: a job that came over the bus has every field set (the codec sends them all)
    explicit_k = job.device_update_layers is not None
    if not fmt.default and (job.device_update_layers or job.device_resident_layers):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{fmt.describe()} are updated on the host only: leave out "
                            "--device-update-layers and --device-resident-layers (or keep fp32 state)")
    if explicit_k or job.device_resident_layers is not None:
        r = job.device_resident_layers or 0
        k = job.device_update_layers if explicit_k else r
        if r > k:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{r} GPU-resident layers but only {k} GPU-updated ones; "
                                "--device-resident-layers counts among --device-update-layers")
        placement = Placement(min(r, config.num_layers), min(k, config.num_layers), sets, "given")
        bound = step_bound(config, job.batch_size, job.seq_len, placement, rates or H200, dtype.itemsize, split)
    elif not fmt.default:
        # The GPU's update (device_update.py) keeps fp32 state. No bound: step_bound models the fp32
        # state's passes and bytes.
        placement = Placement(0, 0, sets, f"{fmt.describe()}: the host updates every layer")
        bound = {}
    elif device.type == "cuda":
        rates = rates or measure_rates(device)
        placement, bound = choose_placement(config, dtype, job.batch_size, job.seq_len, cap, rates, split, sets,
                                            mlp_chunk, packed=data.packed, deterministic=job.deterministic,
                                            sm_count=sms)
    else:
        placement = Placement(0, 0, sets, "CPU: the host updates every layer")
        bound = {}
    return JobSetup(config, init_from, model_name, device, dtype, resume, output_dir, data, split, placement,
                    plan_for(placement, split), bound, tokenizer_dir=tokenizer_dir)


def job_adapter(job: TrainJob, init_from: Path | None, model_name: str, output_dir: Path) -> AdapterConfig | None:
    """The adapter a LoRA job trains (None: a full-training job), once its targets are known and its
    output directory cannot hold the other kind's checkpoint (their files overlap); else
    ``invalid_request`` in one line naming the flag."""
    if job.lora_rank is None:
        if has_adapter_checkpoint(output_dir):
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{output_dir} holds a LoRA adapter's checkpoint; give "
                                "full training another --output-dir (or add --lora-rank to continue the adapter)")
        return None
    try:
        targets = check_targets(job.lora_targets)
    except AdapterError as exc:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    if init_from is not None and init_from.resolve() == output_dir.resolve():
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "a LoRA run writes its adapter beside no model: give it an "
                            "--output-dir of its own, not the base model's directory")
    if has_checkpoint(output_dir):
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"{output_dir} holds a full-training checkpoint; give the LoRA "
                            "run another --output-dir (or train it in full: leave out --lora-rank)")
    return lora_config(job.lora_rank, job.lora_alpha, targets, str(init_from) if init_from else model_name)


def _lora_setup(job: TrainJob, config: ModelConfig, init_from: Path | None, model_name: str, device: torch.device,
                dtype: torch.dtype, resume: bool, output_dir: Path, data: TokenData | FinetuneData,
                lora: AdapterConfig, cap: int | None, host_free: int | None, mlp_chunk: int, sms: int,
                rates: Rates | None, tokenizer_dir: Path | None) -> JobSetup:
    """A LoRA job's setup: the base layers kept on the GPU (``job.device_resident_layers``, or as many
    as the cap holds: plan.choose_lora_resident), the rest streamed; no layer is updated, so
    ``--device-update-layers`` is refused."""
    if job.device_update_layers:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, "a LoRA run updates no base layer: leave out "
                            "--device-update-layers (--device-resident-layers keeps base layers on the GPU)")
    if job.device_resident_layers is not None:
        placement = Placement(min(job.device_resident_layers, config.num_layers) if device.type == "cuda" else 0,
                              reason="given", frozen=True)
    elif device.type == "cuda":
        placement = choose_lora_resident(config, dtype, job.batch_size, job.seq_len, cap, lora, mlp_chunk,
                                         packed=data.packed, deterministic=job.deterministic, sm_count=sms)
    else:
        placement = Placement(reason="CPU: the base in host memory", frozen=True)
    plan = memory_plan(config, dtype, job.batch_size, job.seq_len, placement, device=device.type, split=False,
                       gpu_cap=cap, host_available=host_free, mlp_chunk=mlp_chunk, data_bytes=data.nbytes,
                       packed=data.packed, deterministic=job.deterministic, sm_count=sms, lora=lora)
    bound = lora_step_bound(config, job.batch_size, job.seq_len, placement.resident, rates or H200,
                            dtype.itemsize) if device.type == "cuda" else {}
    return JobSetup(config, init_from, model_name, device, dtype, resume, output_dir, data, False, plan.placement,
                    plan, bound, lora, tokenizer_dir)


def job_tokenizer(dataset: str, vocab_size: int, output_dir: Path, resume: bool) -> Path:
    """The directory of the BPE a from-scratch preset trains on: the checkpoint's own when resuming,
    else one trained now on ``dataset`` into ``output_dir``/tokenizer (deterministic: a rerun trains
    the same one)."""
    if resume and (output_dir / "tokenizer.json").is_file():
        return output_dir
    files = dataset_files(dataset)
    started = time.perf_counter()
    tokenizer = train_bpe(files, vocab_size)
    path = write_tokenizer_dir(tokenizer, output_dir / "tokenizer")
    log.info("trained a %d-entry BPE on %s (%d files) in %.1f s: %s", vocab_size, dataset, len(files),
             time.perf_counter() - started, path)
    return path


def load_data(job: TrainJob, config: ModelConfig, init_from: Path | None,
              model_name: str) -> TokenData | FinetuneData:
    """The job's data: text (``data.TokenData``) or fine-tuning records (``finetune_data``) as
    ``job.data_format`` says, tokenized with the model's tokenizer, the one in ``init_from`` unless the
    model is byte-level (records also with its chat template)."""
    tokenizer = (ByteTokenizer() if config.byte_tokenizer or init_from is None
                 else HFTokenizer(init_from, eos_token_ids=config.eos_token_ids))
    kind = records_kind(job.dataset, job.data_format)
    if kind is None:
        return TokenData.load(job.dataset, tokenizer, config.vocab_size)
    pad = config.pad_token_id if config.pad_token_id is not None and config.pad_token_id < config.vocab_size else 0
    template, problem = None, None
    try:
        template = training_template(init_from, config.byte_tokenizer)
    except ChatTemplateError as exc:  # refused at the first chat record, if there is one
        problem = str(exc)
    return FinetuneData.load(Path(job.dataset), kind, tokenizer, template,
                             eos_id=config.eos_token_ids[0] if config.eos_token_ids else None,
                             vocab_size=config.vocab_size, seq_len=job.seq_len, pack=job.pack, pad_id=pad,
                             model_name=f"model {model_name!r}", template_problem=problem)


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int,
                    adapter_params: int | None = None) -> float:
    """Model FLOPs per trained token, the usual 6N plus causal attention's 6·L·d·seq (recompute not
    counted). With a LoRA adapter of ``adapter_params`` the frozen N cost 4 (forward and the input's
    gradient: no weight gradient) and the adapter 6."""
    attention = 6 * num_layers * hidden * seq_len
    if adapter_params is not None:
        return 4 * num_params + 6 * adapter_params + attention
    return 6 * num_params + attention


def state_format(job: TrainJob) -> StateFormat:
    return StateFormat(job.master_weights, job.adam_moments)


def output_dir_of(job: TrainJob, job_id: str, data_dir: Path) -> Path:
    return Path(job.output_dir) if job.output_dir else Path(data_dir) / "train" / job_id


class TrainLoop:
    """A job (its placement: see :func:`plan_job`). Refuses (ProtocolError, one line) a job
    whose memory plan does not fit before allocating anything large."""

    def __init__(self, job: TrainJob, job_id: str, data_dir: Path, mlp_chunk: int = 16384,
                 rates: Rates | None = None) -> None:
        self.job, self.job_id = job, job_id
        self.output_dir = output_dir_of(job, job_id, data_dir)
        self.setup = setup = plan_job(job, self.output_dir, rates, mlp_chunk)
        try:
            setup.plan.check()
        except PlanError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"job {job_id}: {exc}") from None
        self.device, self.model_name, self.placement = setup.device, setup.model_name, setup.placement
        if self.device.type == "cuda" and job.gpu_memory_gib:
            total = torch.cuda.get_device_properties(self.device).total_memory
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, job.gpu_memory_gib * 2**30 / total), index)
        config, init_from, dtype = setup.config, setup.init_from, setup.dtype
        self.source_dir = init_from or setup.tokenizer_dir  # what a checkpoint takes its tokenizer files from
        pin = self.device.type == "cuda"
        self.start_step = 0
        self.lr_at = lr_schedule(job.lr, job.warmup_steps, job.steps)
        self.compile_layers = job.compile_layers if job.compile_layers is not None else self.device.type == "cuda"
        self.config = config
        self.data = setup.data
        self.num_params = count_parameters(config)
        self.adapter: TrainedAdapter | None = None
        if setup.lora is not None:
            self._init_lora(setup, mlp_chunk, pin)
            return
        fmt = state_format(job)
        if setup.resume:
            self.state = HostState.from_checkpoint(config, self.output_dir, dtype, pin, fmt)
            self.start_step = int(restore_optimizer(self.output_dir, self.state)["step"])
            log.info("resuming %s from %s at step %d", job_id, self.output_dir, self.start_step)
        elif init_from is not None:
            self.state = HostState.from_checkpoint(config, init_from, dtype, pin, fmt)
        else:
            self.state = HostState.random(config, job.seed, dtype, pin, fmt)
        self.optimizer = HostAdamW(self.state, self.lr_at, job.weight_decay, job.grad_clip, split=setup.split,
                                   seed=job.seed)
        self.engine = OffloadStep(config, self.state, self.optimizer, self.device, mlp_chunk=mlp_chunk,
                                      device_update_layers=self.placement.device_update,
                                      device_update_sets=self.placement.sets,
                                      device_resident_layers=self.placement.resident,
                                      compile_layers=self.compile_layers, deterministic=job.deterministic)
        log.info("job %s: placement %s (%s)", job_id, self.placement.describe(config.num_layers),
                 self.placement.reason)
        self.flops_per_token = flops_per_token(self.num_params, config.num_layers, config.hidden_size, job.seq_len)
        log.info("job %s: %s, %.3fB parameters, %s, data %s, host state %.1f GiB (%s)", job_id, job.model,
                 self.num_params / 1e9, self.device, self.data.description, self.state.nbytes() / 2**30,
                 fmt.describe())

    def _init_lora(self, setup: JobSetup, mlp_chunk: int, pin: bool) -> None:
        """A LoRA job's base, adapter, optimizer and step (see the module)."""
        job, config, device = self.job, setup.config, self.device
        resident = setup.placement.resident
        if setup.init_from is not None:
            self.state = FrozenBase.from_checkpoint(config, setup.init_from, setup.dtype, device, resident, pin)
        else:
            self.state = FrozenBase.random(config, job.seed, setup.dtype, device, resident, pin)
        self.adapter = TrainedAdapter(config, setup.lora, device)
        if setup.resume:
            try:
                self.start_step = int(restore_adapter(self.output_dir, config, self.adapter)["step"])
            except AdapterError as exc:
                raise ProtocolError(ErrorCode.INVALID_REQUEST, f"job {self.job_id}: {exc}") from None
            log.info("resuming %s from %s at step %d", self.job_id, self.output_dir, self.start_step)
        else:
            self.adapter.init_(job.seed)
        self.optimizer = AdapterAdamW(self.adapter, self.lr_at, job.weight_decay, job.grad_clip, BETAS, EPS)
        self.engine = LoraStep(config, self.state, self.optimizer, device, mlp_chunk=mlp_chunk,
                               compile_layers=self.compile_layers, deterministic=job.deterministic)
        trained = adapter_numel(config, setup.lora)
        self.flops_per_token = flops_per_token(self.num_params, config.num_layers, config.hidden_size, job.seq_len,
                                               trained)
        log.info("job %s: placement %s (%s)", self.job_id, self.placement.describe(config.num_layers),
                 self.placement.reason)
        log.info("job %s: %s, %.3fB frozen parameters (%.1f GiB in host RAM, %.1f GiB on %s), LoRA rank %d on %s: "
                 "%.2fM trained, data %s", self.job_id, job.model, self.num_params / 1e9,
                 self.state.host_nbytes() / 2**30, self.state.device_nbytes() / 2**30, device, setup.lora.rank,
                 ",".join(setup.lora.targets), trained / 1e6, self.data.description)

    def checkpoint(self, step: int) -> Path:
        self.optimizer.wait_all(self.engine.version)
        self.engine.synchronize()
        if self.adapter is not None:
            return save_adapter_checkpoint(self.output_dir, self.adapter, step, self.job.model_dump())
        return save_checkpoint(self.output_dir, self.state, step, self.job.model_dump(),
                               extra=self._tokenizer_files(self.output_dir))

    def _has_checkpoint(self) -> bool:
        return (has_adapter_checkpoint if self.adapter is not None else has_checkpoint)(self.output_dir)

    def _tokenizer_files(self, path: Path) -> dict[str, Path | str]:
        """What a checkpoint in ``path`` takes beside the weights, so it serves as its source did: the
        source's tokenizer and chat template files; and for a model fine-tuned on chat records with
        no template file of its own (the byte-level models' built-in one), the template it was
        trained with as chat_template.jinja. Committed with the weights (never a checkpoint without
        the tokenizer it was trained with)."""
        files: dict[str, Path | str] = {}
        copied = self.source_dir is not None and (not path.exists() or self.source_dir.resolve() != path.resolve())
        if copied:  # (trained in place, they are there already)
            for name in TOKENIZER_FILES:
                if (self.source_dir / name).is_file():
                    files[name] = self.source_dir / name
            templates = self.source_dir / TEMPLATE_DIR
            if templates.is_dir():
                files.update({str(f.relative_to(self.source_dir)): f for f in sorted(templates.rglob("*"))
                              if f.is_file()})
        template = getattr(self.data, "chat_template", None)
        if template is not None and TEMPLATE_FILE not in files:
            has_one = (copied and ChatTemplate.from_model_dir(self.source_dir) is not None) or (
                path.is_dir() and ChatTemplate.from_model_dir(path) is not None)
            if not has_one:
                files[TEMPLATE_FILE] = template.source
        return files

    def run(self, on_step: Callable[[TrainStepMetrics], None] | None = None,
            on_trace: Callable[[int, list[TimelineOp], float], None] | None = None,
            on_checkpoint: Callable[[Path, int], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False, trace_every_s: float = 1.0,
            final_checkpoint: bool = True, checkpoint_every_s: float = 0.0) -> RunSummary:
        """Train until ``job.steps`` or until ``should_stop()`` (asked before each step: the step in
        flight finishes first, and the checkpoint at the end is of whole steps only, so a resume goes
        on from it exactly); checkpoint every ``job.checkpoint_every`` steps, after a step once
        ``checkpoint_every_s`` seconds passed since the last checkpoint (0: never so), and at the end.
        ``on_trace(step, ops, hidden_fraction)`` gets one step's ops at most every ``trace_every_s``
        seconds (0: every step)."""
        job, step, losses = self.job, self.start_step, []
        self.optimizer.start()
        started = last = last_save = time.perf_counter()
        last_trace, traces = -math.inf, []
        state, path = "finished", None
        try:
            while step < job.steps:
                if should_stop():
                    state = "stopped"
                    break
                record = on_trace is not None and time.perf_counter() - last_trace >= trace_every_s
                batch = self.data.batch(step, job.batch_size, job.seq_len, job.seed)
                handle = self.engine.step(batch.inputs, batch.targets, record_timeline=record, segments=batch.segments)
                loss = handle.loss()
                grad_norm = float(self.engine.sumsq_host.sum().sqrt())
                now = time.perf_counter()
                dt, last, step = now - last, now, step + 1
                losses.append(loss)
                if record:
                    last_trace = now
                    traces.append(handle)
                if on_step is not None:
                    on_step(self._metrics(step, loss, grad_norm, dt, batch.segments))
                traces = self._emit_traces(traces, on_trace, wait=False)
                due = (job.checkpoint_every and step % job.checkpoint_every == 0) or (
                    checkpoint_every_s > 0 and now - last_save >= checkpoint_every_s)
                if due and step < job.steps:
                    path = self._save(step, on_checkpoint)
                    last_save = time.perf_counter()
            self.optimizer.wait_all(self.engine.version)
            self.engine.synchronize()
            self._emit_traces(traces, on_trace, wait=True)
            if final_checkpoint and (step > self.start_step or not self._has_checkpoint()):
                path = self._save(step, on_checkpoint)
        finally:
            self.optimizer.close()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        tail = losses[-10:]
        return RunSummary(state, step, losses[-1] if losses else None, sum(tail) / len(tail) if tail else None,
                          time.perf_counter() - started, path)

    def _save(self, step: int, on_checkpoint: Callable[[Path, int], None] | None) -> Path:
        path = self.checkpoint(step)
        log.info("job %s: checkpoint at step %d in %s", self.job_id, step, path)
        if on_checkpoint is not None:
            on_checkpoint(path, step)
        return path

    def _metrics(self, step: int, loss: float, grad_norm: float, dt: float,
                 segments: torch.Tensor | None) -> TrainStepMetrics:
        """A step's metrics; its rates count only the tokens that are not padding (segment -1)."""
        positions = self.job.batch_size * self.job.seq_len
        tokens = positions if segments is None else int((segments >= 0).sum())
        cuda = self.device.type == "cuda"
        return TrainStepMetrics(
            job_id=self.job_id, step=step, loss=loss, grad_norm=grad_norm, lr=self.lr_at(step),
            tokens_per_s=tokens / dt, model_tflops=self.flops_per_token * tokens / dt / 1e12, step_time_s=dt,
            padding_fraction=1 - tokens / positions,
            gpu_memory_bytes=torch.cuda.memory_allocated(self.device) if cuda else 0,
            gpu_memory_peak_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else 0,
        )

    @staticmethod
    def _emit_traces(handles: list[StepHandle], on_trace, wait: bool) -> list[StepHandle]:  # noqa: ANN001
        """Hand out the traces whose optimizer update finished (its ops belong to the trace)."""
        left = []
        for index, handle in enumerate(handles):
            if not (wait or handle.job.done.is_set()):
                left = handles[index:]
                break
            handle.job.done.wait()
            ops = handle.trace.device_ops()
            on_trace(handle.job.version, ops + handle.trace.host_ops, hidden_fraction(ops))
        return left
