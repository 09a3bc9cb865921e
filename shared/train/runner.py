"""One training job from start to finish: what `tandem train`, the trainer service and the
benchmark run. Builds the host state (fresh, from a Hugging Face directory, or resumed from the
job's own checkpoint), the host optimizer and the streaming engine, then steps, reporting each step,
a per-op trace at a bounded rate, and checkpoints.

    runner = TrainRunner(TrainJob(model="tiny", steps=100), "job-1", data_dir=Path("~/.local/share/tandem"))
    summary = runner.run(on_step=print)
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.shared.model.config import ModelLoadError
from tandem.shared.model.meta import read_hf_config
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.training import TimelineOp, TrainJob, TrainStepMetrics
from tandem.shared.text.tokenizer import ByteTokenizer, HFTokenizer
from tandem.shared.train.checkpoint import has_checkpoint, restore_optimizer, save_checkpoint
from tandem.shared.train.data import TokenData
from tandem.shared.train.engine import StepHandle, StreamingEngine
from tandem.shared.train.host_state import HostState
from tandem.shared.train.lanes import hidden_fraction
from tandem.shared.train.layout import count_parameters
from tandem.shared.train.optimizer import HostAdamW, lr_schedule
from tandem.shared.train.presets import resolve_model

log = logging.getLogger("tandem.train")


@dataclass
class RunSummary:
    state: str  # "finished" or "stopped"
    step: int
    loss: float | None
    mean_loss: float | None  # over the last 10 steps
    wall_s: float
    checkpoint: Path | None


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"device {spec!r} asked for, but CUDA is not available")
    return device


def _fits_in_host_ram(nbytes: int, share: float = 0.85) -> bool:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return True
    return nbytes <= share * total


def flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int) -> float:
    """DESIGN.md's model FLOPs per trained token: 6N + 6·L·d·seq (recompute not counted)."""
    return 6 * num_params + 6 * num_layers * hidden * seq_len


class TrainRunner:
    def __init__(self, job: TrainJob, job_id: str, data_dir: Path, mlp_chunk: int = 16384) -> None:
        self.job, self.job_id = job, job_id
        self.device = resolve_device(job.device)
        if self.device.type == "cuda" and job.gpu_memory_gib:
            total = torch.cuda.get_device_properties(self.device).total_memory
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, job.gpu_memory_gib * 2**30 / total), index)
        self.output_dir = Path(job.output_dir) if job.output_dir else Path(data_dir) / "train" / job_id
        try:
            config, init_from, self.model_name = resolve_model(job.model)
        except ModelLoadError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
        self.source_dir = init_from
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        pin = self.device.type == "cuda"
        self.start_step = 0
        if job.resume and has_checkpoint(self.output_dir):
            config = read_hf_config(self.output_dir)
            self.state = HostState.from_checkpoint(config, self.output_dir, dtype, pin)
            self.start_step = int(restore_optimizer(self.output_dir, self.state)["step"])
            log.info("resuming %s from %s at step %d", job_id, self.output_dir, self.start_step)
        elif init_from is not None:
            self.state = HostState.from_checkpoint(config, init_from, dtype, pin)
        else:
            self.state = HostState.random(config, job.seed, dtype, pin)
        self.config = config
        tokenizer = ByteTokenizer() if config.byte_tokenizer or init_from is None else HFTokenizer(init_from)
        self.data = TokenData.load(job.dataset, tokenizer, config.vocab_size)
        self.lr_at = lr_schedule(job.lr, job.warmup_steps, job.steps)
        split = job.split_update if job.split_update is not None else self.device.type == "cuda"
        if split and job.split_update is None and not _fits_in_host_ram(self.state.nbytes() + self.state.grad_nbytes()):
            log.info("job %s: no room in host RAM for a second gradient buffer; host AdamW runs whole updates", job_id)
            split = False
        self.optimizer = HostAdamW(self.state, self.lr_at, job.weight_decay, job.grad_clip, split=split)
        self.compile_layers = job.compile_layers if job.compile_layers is not None else self.device.type == "cuda"
        self.engine = StreamingEngine(config, self.state, self.optimizer, self.device, mlp_chunk=mlp_chunk,
                                      device_update_layers=job.device_update_layers,
                                      device_update_sets=job.device_update_sets,
                                      compile_layers=self.compile_layers)
        self.num_params = count_parameters(config)
        self.flops_per_token = flops_per_token(self.num_params, config.num_layers, config.hidden_size, job.seq_len)
        log.info("job %s: %s, %.3fB parameters, %s, data %s, host state %.1f GiB", job_id, job.model,
                 self.num_params / 1e9, self.device, self.data.description, self.state.nbytes() / 2**30)

    def checkpoint(self, step: int) -> Path:
        self.optimizer.wait_all(self.engine.version)
        self.engine.synchronize()
        path = save_checkpoint(self.output_dir, self.state, step, self.job.model_dump())
        if self.source_dir is not None and (self.source_dir / "tokenizer.json").is_file():
            shutil.copyfile(self.source_dir / "tokenizer.json", path / "tokenizer.json")
        return path

    def run(self, on_step: Callable[[TrainStepMetrics], None] | None = None,
            on_trace: Callable[[int, list[TimelineOp], float], None] | None = None,
            on_checkpoint: Callable[[Path, int], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False, trace_every_s: float = 1.0,
            final_checkpoint: bool = True) -> RunSummary:
        """Train until ``job.steps`` (or ``should_stop()``); checkpoint every ``checkpoint_every``
        steps and at the end. ``on_trace(step, ops, hidden_fraction)`` gets one step's ops at most
        every ``trace_every_s`` seconds (0: every step)."""
        job, step, losses = self.job, self.start_step, []
        self.optimizer.start()
        started = last = time.perf_counter()
        last_trace, traces = -math.inf, []
        state, path = "finished", None
        try:
            while step < job.steps:
                if should_stop():
                    state = "stopped"
                    break
                record = on_trace is not None and time.perf_counter() - last_trace >= trace_every_s
                inputs, targets = self.data.batch(step, job.batch_size, job.seq_len, job.seed)
                handle = self.engine.step(inputs, targets, record_timeline=record)
                loss = handle.loss()
                grad_norm = float(self.engine.sumsq_host.sum().sqrt())
                now = time.perf_counter()
                dt, last, step = now - last, now, step + 1
                losses.append(loss)
                if record:
                    last_trace = now
                    traces.append(handle)
                if on_step is not None:
                    on_step(self._metrics(step, loss, grad_norm, dt))
                traces = self._emit_traces(traces, on_trace, wait=False)
                if job.checkpoint_every and step % job.checkpoint_every == 0 and step < job.steps:
                    path = self._save(step, on_checkpoint)
            self.optimizer.wait_all(self.engine.version)
            self.engine.synchronize()
            self._emit_traces(traces, on_trace, wait=True)
            if final_checkpoint and (step > self.start_step or not has_checkpoint(self.output_dir)):
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

    def _metrics(self, step: int, loss: float, grad_norm: float, dt: float) -> TrainStepMetrics:
        tokens = self.job.batch_size * self.job.seq_len
        cuda = self.device.type == "cuda"
        return TrainStepMetrics(
            job_id=self.job_id, step=step, loss=loss, grad_norm=grad_norm, lr=self.lr_at(step),
            tokens_per_s=tokens / dt, model_tflops=self.flops_per_token * tokens / dt / 1e12, step_time_s=dt,
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
