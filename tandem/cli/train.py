"""``tandem train``: run one training job in this process, with a progress line every few steps.

    tandem train --default                 # tiny byte model on the Python stdlib -> <data-dir>/models/tiny
    tandem train --model 3b --device cuda --steps 20 --batch-size 8 --seq-len 2048 --gpu-memory-gib 16
    tandem train --model DIR --dataset notes/ --steps 500 --output-dir out/ [--resume]
    tandem train --model DIR --dataset chat.jsonl --steps 300 --seq-len 1024 --lr 2e-5 --output-dir tuned/
    tandem train --model 3b --device cuda --batch-size 8 --seq-len 2048 --gpu-memory-gib 16 --plan
    tandem train --model DIR --dataset chat.jsonl --lora-rank 16 --steps 300 --output-dir adapter/

``--default`` trains the built-in tiny model where ``tandem up`` finds it (a few minutes on 2 CPU
cores) and prints a sample. With ``--nats-url`` a ``WeightsUpdated`` event follows every checkpoint,
so running workers that serve the model reload it. Before allocating, the job's memory plan
(shared/train/plan.py) is checked: a job that does not fit in host RAM or under the GPU cap is
refused in one line naming what to change; ``--plan`` prints the plan, the placement of each
layer's fp32 state and the predicted step bound, and exits. A ``.jsonl`` dataset is fine-tuning
records, chat (``{"messages": [...]}``) or prompt/completion, trained on the answers only and packed
(shared/train/finetune_data.py); a bad line is refused in one line naming it. ``--lora-rank R`` trains
a LoRA adapter on the frozen model instead of the whole model (shared/train/lora.py) and writes it
in PEFT's format (adapter_config.json + adapter_model.safetensors) into ``--output-dir``; no
``WeightsUpdated`` follows its checkpoints (an adapter is not a model to reload); with ``--publish NAME``
each checkpoint is published to the serving fleet as adapter NAME instead (a new version each time,
a copy of the adapter under ``--output-dir``/published/), served at once by the running workers.

Stopping. Ctrl-C (SIGINT) or SIGTERM lets the step in flight finish, saves a checkpoint of it, says
in one line where and how to continue (the same command with ``--resume``), and exits 130 or 143
(128 + the signal, as a shell reports a command the signal ended). A second signal gives the save
up and exits at once; the folder then still holds the previous checkpoint, whole
(shared/train/checkpoint.py). Besides, a checkpoint is saved every ``--checkpoint-every``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

DEFAULT_JOB = dict(model="tiny", dataset="stdlib", steps=200, batch_size=16, seq_len=256, lr=3e-3, warmup_steps=20,
                   weight_decay=0.1, grad_clip=1.0)
JOB_FLAGS = ("model", "dataset", "data_format", "pack", "steps", "batch_size", "seq_len", "lr", "weight_decay",
             "grad_clip", "warmup_steps", "seed", "device", "output_dir", "resume",
             "gpu_memory_gib", "device_update_layers", "device_resident_layers", "device_update_sets",
             "compile_layers", "split_update", "master_weights", "adam_moments", "deterministic", "lora_rank",
             "lora_alpha", "lora_targets", "publish_adapter")
SAMPLE_PROMPT = "def "
CHECKPOINT_EVERY = "30m"
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class CheckpointEvery:
    """``--checkpoint-every``: a number of steps, or of seconds (both 0: only at the end)."""

    steps: int = 0
    seconds: float = 0.0


def lora_targets(text: str) -> list[str]:
    """``--lora-targets``' value: projection names separated by commas (checked against the model's
    projections when the job is planned, shared/train/lora.py)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def checkpoint_every(text: str) -> CheckpointEvery:
    """``--checkpoint-every``'s value: ``N`` steps, or a time (``90s``, ``30m``, ``2h``); 0: only at the end."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    if found is None or (not found[2] and "." in found[1]):
        raise argparse.ArgumentTypeError(f"takes N steps or a time such as 90s, 30m, 2h (0: only at the end), "
                                         f"not {text!r}")
    if not found[2]:
        return CheckpointEvery(steps=int(found[1]))
    return CheckpointEvery(seconds=float(found[1]) * UNIT_SECONDS[found[2]])


class StopAtOnce(KeyboardInterrupt):
    """A stop signal that ends ``tandem train`` now: the first before training began, the second after."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """SIGINT and SIGTERM while ``tandem train`` runs (see the module): :meth:`training` turns the
    first into a request to stop at the next step boundary (:attr:`signum`); before it, and for a
    second one, :class:`StopAtOnce` is raised, once: what follows it (finishing a committed save,
    the last line) is short and must not be cut by a third. SIGINT inherited as ignored (a command
    started in the background by a shell) stays ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.in_training = False
        self.stopping_at_once = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self.previous[signum] = signal.signal(signum, self.on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def training(self) -> None:
        self.in_training = True

    def stop_requested(self) -> bool:
        return self.signum is not None

    def on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stopping_at_once:
            return
        if not self.in_training or self.signum is not None:
            self.signum, self.stopping_at_once = signum, True
            raise StopAtOnce(signum)
        self.signum = signum
        # os.write: print() here could land inside another print() to the same stream and raise
        os.write(2, f"tandem train: {signal.Signals(signum).name}: finishing the step in flight, then saving a "
                    "checkpoint (again: stop at once, keeping the previous checkpoint)\n".encode())


def exit_status(signum: int) -> int:
    """What a shell reports for a command a signal ended: 128 + the signal (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def add_train_parser(sub: argparse._SubParsersAction, add_common) -> None:  # noqa: ANN001
    """The ``train`` subcommand; ``add_common`` adds --nats-url/--data-dir/--log-level."""
    from tandem.cli.flags import int_at_least

    p = sub.add_parser("train", help="train a model in this process (layers streamed from host RAM on a GPU)")
    add_common(p)
    p.add_argument("--default", action="store_true",
                   help="the tiny byte model on the Python stdlib, saved where `tandem up` finds it")
    p.add_argument("--model", help="tiny, 1b, 3b, 7b, 13b, 34b, 70b, or a Hugging Face directory to start from")
    p.add_argument("--dataset", help="stdlib, random, a text file or a folder of them, or a JSONL file of fine-tuning "
                                     "records: {\"messages\": [...]} chats or {\"prompt\", \"completion\"} pairs")
    p.add_argument("--data-format", choices=("auto", "text", "chat", "completion"),
                   help="auto: a .jsonl dataset is fine-tuning records of either kind (loss on the assistant's "
                        "tokens or the completion), anything else text; chat, completion: JSONL of only that "
                        "kind; text: plain text whatever the name")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="fine-tuning records: pack short examples into each --seq-len row, attention kept "
                        "within each example (default: on; --no-pack: one example a row, padded)")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--grad-clip", type=float, help="global-norm clipping (0: off)")
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--checkpoint-every", type=checkpoint_every, default=None, metavar="N|TIME",
                   help=f"save a checkpoint every N steps, or every TIME of training (90s, 30m, 2h); 0: only at "
                        f"the end and when stopped (default: {CHECKPOINT_EVERY}: the most a crash that leaves no time "
                        "to save, such as SIGKILL, running out of memory or a lost host, can cost, while each save "
                        "stays a small part of the run: a 7B model's masters and moments are about 84 GB to write; "
                        "time, not steps, since a step takes milliseconds on the tiny model and minutes on a large "
                        "one)")
    p.add_argument("--output-dir", help="checkpoint directory (default: <data-dir>/train/<job-id>)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the checkpoint in --output-dir")
    p.add_argument("--gpu-memory-gib", type=float, help="cap this process's GPU memory")
    p.add_argument("--device-update-layers", type=int,
                   help="CUDA: the GPU computes the AdamW of this many first layers, the CPU the rest "
                        "(default: chosen from --gpu-memory-gib; given alone, none of them GPU-resident)")
    p.add_argument("--device-resident-layers", type=int,
                   help="of those, how many keep fp32 masters and moments on the GPU for the whole run "
                        "(default: chosen from --gpu-memory-gib)")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan, the placement and the predicted step bound, and exit")
    p.add_argument("--device-update-sets", type=int,
                   help="GPU buffer sets for those updates: more load state ahead, 1.8 GB each at 3B (default 2)")
    p.add_argument("--compile-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the layer blocks (default: on CUDA)")
    p.add_argument("--split-update", action=argparse.BooleanOptionalAction, default=None,
                   help="host AdamW as preview + commit (default: on CUDA when host RAM has room)")
    p.add_argument("--master-weights", choices=["fp32", "bf16-sr", "bf16-kahan"],
                   help="the masters in host RAM: fp32 (4 bytes a parameter), bf16 rounded stochastically (2; on "
                        "CUDA also the working copy) or bf16 with a bf16 Kahan compensation (4); not fp32: every "
                        "layer is updated on the host (default: fp32)")
    p.add_argument("--adam-moments", choices=["fp32", "int8"],
                   help="AdamW's two moments in host RAM: fp32 (8 bytes a parameter) or 8-bit block-quantized "
                        "(2, as bitsandbytes' Adam8bit); int8: every layer is updated on the host (default: fp32)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: backward kernels with a fixed reduction order, so a rerun or a resume is bit-exact "
                        "(default: on; --no-deterministic: the atomics-based kernels, last bits vary)")
    p.add_argument("--lora-rank", type=int,
                   help="train a LoRA adapter of this rank on the frozen model instead of the whole model: the "
                        "base takes 2 bytes a parameter in host RAM (bf16), only the adapter's A and B and their "
                        "AdamW state are trained; the adapter is saved in PEFT's format in --output-dir "
                        "(default: unset: full training)")
    p.add_argument("--lora-alpha", type=float,
                   help="LoRA's alpha: the adapter's output is scaled by alpha / rank (default: 2 x --lora-rank)")
    p.add_argument("--lora-targets", type=lora_targets, metavar="NAME,...",
                   help="the projections the adapter trains, separated by commas (default: all seven: "
                        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)")
    p.add_argument("--publish", dest="publish_adapter", metavar="NAME",
                   help="with --lora-rank: publish every checkpoint of the adapter to the running tandem (the "
                        "one on --data-dir, or --nats-url) as LoRA adapter NAME, which requests then name as "
                        "their model; each checkpoint a new version, served without a restart (default: unset)")
    p.add_argument("--job-id", help="name of the run (default: random)")
    p.add_argument("--log-every", type=int_at_least(1), default=10, help="steps between progress lines")
    p.add_argument("--threads", type=int_at_least(1), help="CPU threads for torch (default: torch's)")


def build_job(args: argparse.Namespace, data_dir: Path):  # noqa: ANN201 - TrainJob
    from tandem.shared.model.meta import trained_tiny_dir
    from tandem.shared.protocol.training import TrainJob

    if args.default and getattr(args, "lora_rank", None) is not None:
        raise ValueError("--default trains the tiny model in full; leave out --lora-rank, or give --model instead")
    fields = dict(DEFAULT_JOB) if args.default else {}
    if args.default:
        fields["output_dir"] = str(trained_tiny_dir(data_dir))
    fields.update({k: getattr(args, k) for k in JOB_FLAGS if getattr(args, k, None) is not None})
    fields["checkpoint_every"] = checkpoint_interval(args).steps
    return TrainJob(**fields)


def checkpoint_interval(args: argparse.Namespace) -> CheckpointEvery:
    """``--checkpoint-every`` as given, else its default."""
    return getattr(args, "checkpoint_every", None) or checkpoint_every(CHECKPOINT_EVERY)


def job_problem(exc: Exception) -> str:
    """A refused job in one line: a field's bad value as the flag that gave it (``--steps must be >= 1``)."""
    from pydantic import ValidationError

    from tandem.cli.flags import invalid_value
    from tandem.shared.protocol.base import ProtocolError
    from tandem.shared.protocol.training import TrainJob

    if isinstance(exc, ValidationError) and exc.title == TrainJob.__name__:
        flags = {name: "--" + name.replace("_", "-") for name in TrainJob.model_fields}
        return invalid_value(exc, TrainJob, {**flags, "publish_adapter": "--publish"})
    if isinstance(exc, ProtocolError):
        return exc.message
    return " ".join(str(exc).split())


def progress(step: int, steps: int, loss: float, tokens_per_s: float, tflops: float, elapsed: float,
             padding: float = 0.0) -> str:
    """One progress line; ``padding`` (the fraction of positions that were padding) shows when any were."""
    width = 24
    done = int(width * step / steps)
    eta = elapsed / max(1, step) * (steps - step)
    pad = f" ({padding:.0%} padding)" if padding > 0 else ""
    return (f"[{'#' * done}{'.' * (width - done)}] step {step}/{steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s"
            f"{pad}  {tflops:.2f} TFLOP/s  {elapsed:.0f}s elapsed, eta {eta:.0f}s")


def cmd_train(args: argparse.Namespace, settings) -> int:  # noqa: ANN001 - tandem.shared.infra.config.Settings
    """Run the job; 0 when it finished, 2 when refused, 128 + the signal when stopped by one."""
    with StopSignals() as stops:
        try:
            return train(args, settings, stops)
        except StopAtOnce as stop:  # before training began: nothing to save
            print(f"tandem train: stopped by {signal.Signals(stop.signum).name} before training began; nothing "
                  "saved", file=sys.stderr)
            return exit_status(stop.signum)


def train(args: argparse.Namespace, settings, stops: StopSignals) -> int:  # noqa: ANN001 - Settings
    import torch
    from pydantic import ValidationError

    from tandem.shared.protocol.base import ProtocolError
    from tandem.shared.train.loop import TrainLoop

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        job = build_job(args, settings.data_dir)
        job_id = args.job_id or f"train-{uuid.uuid4().hex[:8]}"
        if getattr(args, "plan", False):
            return print_plan(job, job_id, settings.data_dir)
        started = time.perf_counter()
        runner = TrainLoop(job, job_id, settings.data_dir)
    except (ValidationError, ProtocolError, ValueError) as exc:
        print(f"tandem train: {job_problem(exc)}", file=sys.stderr)
        return 2
    print(f"tandem train: {runner.model_name} ({runner.num_params / 1e6:.1f}M parameters) on {runner.device}, "
          f"{runner.data.description}; batch {job.batch_size} x {job.seq_len}, {job.steps} steps, "
          f"checkpoints in {runner.output_dir}", flush=True)
    print(f"tandem train: placement: {runner.placement.describe(runner.config.num_layers)} "
          f"({runner.placement.reason})", flush=True)
    from tandem.client.access import BusConnectError
    from tandem.shared.auth.credentials import CredentialsError

    try:
        # an adapter is not a model for the workers to reload: a LoRA run announces nothing
        announce = settings.bus.nats_url and job.lora_rank is None
        publisher = _Publisher(settings, runner.model_name, job_id) if announce else None
        if job.publish_adapter is not None:
            publisher = _AdapterPublisher(settings, job.publish_adapter, job_id)
    except (BusConnectError, CredentialsError) as exc:
        print(f"tandem train: {exc}", file=sys.stderr)
        return 1
    recent: list = []

    def on_step(m) -> None:  # noqa: ANN001
        recent.append(m)
        if m.step % args.log_every == 0 or m.step == job.steps:
            window = recent[-args.log_every:]
            tps = sum(x.tokens_per_s * x.step_time_s for x in window) / sum(x.step_time_s for x in window)
            tflops = sum(x.model_tflops * x.step_time_s for x in window) / sum(x.step_time_s for x in window)
            padding = sum(x.padding_fraction for x in window) / len(window)
            print(progress(m.step, job.steps, m.loss, tps, tflops, time.perf_counter() - started, padding), flush=True)

    stops.training()
    try:
        summary = runner.run(on_step=on_step, on_checkpoint=publisher.publish if publisher else None,
                             should_stop=stops.stop_requested,
                             checkpoint_every_s=checkpoint_interval(args).seconds)
    except StopAtOnce as stop:
        print(f"tandem train: a second signal ({signal.Signals(stop.signum).name}): stopped at once without "
              f"saving; {kept_checkpoint(args, runner.output_dir)}", file=sys.stderr, flush=True)
        return exit_status(stop.signum)
    finally:
        if publisher:
            publisher.close()
    if stops.signum is not None and summary.state == "stopped":
        hint = resume_hint(args, runner.output_dir)
        print(f"tandem train: stopped by {signal.Signals(stops.signum).name} after step {summary.step} of "
              f"{job.steps}; checkpoint saved in {runner.output_dir}; to continue, {hint}", flush=True)
        return exit_status(stops.signum)
    mean = f"{summary.mean_loss:.4f}" if summary.mean_loss is not None else "n/a"
    saved = "LoRA adapter (PEFT format) saved to" if job.lora_rank is not None else "saved to"
    print(f"tandem train: {summary.state} at step {summary.step} in {time.perf_counter() - started:.0f}s, "
          f"mean loss of the last 10 steps {mean}; {saved} {summary.checkpoint}", flush=True)
    if args.default and summary.checkpoint is not None and stops.signum is None:
        print(f"--- sample (temperature 0.8, top-k 40):\n{sample(summary.checkpoint, SAMPLE_PROMPT)}", flush=True)
    return 0


def resume_hint(args: argparse.Namespace, output_dir: Path) -> str:
    """How to continue a stopped run: the same command with what it lacks to find its checkpoint."""
    missing = []
    if not (args.output_dir or args.default):  # else a new job id, so a new folder
        missing += ["--output-dir", str(output_dir)]
    if not args.resume:
        missing.append("--resume")
    return "run the same command again" + (f" with {shlex.join(missing)}" if missing else "")


def kept_checkpoint(args: argparse.Namespace, output_dir: Path) -> str:
    """What a run stopped in the middle left in ``output_dir``: the checkpoint there and how to
    continue from it, or that there is none."""
    import json

    from tandem.shared.train.checkpoint import STATE_FILE, finish_interrupted_save, has_checkpoint

    try:
        finish_interrupted_save(output_dir)  # a save stopped after its commit record is whole: finish it
        if not has_checkpoint(output_dir):
            return f"no checkpoint in {output_dir}"
        step = json.loads((output_dir / STATE_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError) as exc:
        return f"could not read the checkpoint in {output_dir} ({exc})"
    return f"{output_dir} holds the checkpoint of step {step}; to continue, {resume_hint(args, output_dir)}"


def print_plan(job, job_id: str, data_dir: Path) -> int:  # noqa: ANN001 - TrainJob
    """``--plan``: the plan (allocating nothing large); 0 when it fits, 2 (with the refusal) when not."""
    from tandem.shared.train.loop import output_dir_of, plan_job
    from tandem.shared.train.plan import PlanError

    setup = plan_job(job, output_dir_of(job, job_id, data_dir))
    print(setup.plan.describe())
    if setup.bound:
        terms = ", ".join(f"{k} {v:.3f}" for k, v in setup.bound.items() if k != "bound" and v)
        print(f"  predicted step bound {setup.bound['bound']:.3f} s ({terms}; s per step)")
    try:
        setup.plan.check()
    except PlanError as exc:
        print(f"tandem train: {exc}", file=sys.stderr)
        return 2
    return 0


def sample(path: Path, prompt: str, max_new_tokens: int = 160, seed: int = 0) -> str:
    """A sampled continuation from the checkpoint at ``path`` (a quick look at what it learned)."""
    import torch

    from tandem.shared.model.loader import load_model
    from tandem.shared.model.reference import reference_logits

    loaded = load_model(str(path))
    ids = loaded.tokenizer.encode(prompt)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits = reference_logits(loaded.model, ids)[-1] / 0.8
        top = torch.topk(logits, 40)
        ids.append(int(top.indices[torch.multinomial(top.values.softmax(-1), 1, generator=gen)]))
    return loaded.tokenizer.decode(ids)


class _Publisher:
    """Publishes WeightsUpdated after each checkpoint from this synchronous process, as the
    operator (``models.updated`` is the operator's and the trainer's to send; see shared/auth/roles.py)."""

    def __init__(self, settings, model: str, job_id: str, url: str | None = None) -> None:  # noqa: ANN001
        import asyncio

        from tandem.client.access import connect_command, operator_options

        url = url or settings.bus.nats_url
        self.model, self.job_id = model, job_id
        self.loop = asyncio.new_event_loop()
        self.nc = self.loop.run_until_complete(connect_command(url, operator_options(settings, "tandem-train", url)))

    def publish(self, path: Path, step: int) -> None:
        from tandem.shared.protocol import subjects
        from tandem.shared.protocol.codec import encode
        from tandem.shared.protocol.training import WeightsUpdated

        msg = WeightsUpdated(model=self.model, path=str(path), step=step, version=f"{self.job_id}.{step}")
        self.loop.run_until_complete(self.nc.publish(subjects.WEIGHTS_UPDATED, encode(msg)))
        self.loop.run_until_complete(self.nc.flush())

    def close(self) -> None:
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()


class _AdapterPublisher(_Publisher):
    """Publishes each checkpoint of a LoRA run as a new version of adapter ``name`` through the routers
    (``tandem.v1.router.adapters``, the operator's and the trainer's to send): a copy of the adapter
    that later checkpoints leave alone, so a worker that reads a version later reads what was published."""

    def __init__(self, settings, name: str, job_id: str) -> None:  # noqa: ANN001 - Settings
        from tandem.client.access import BusConnectError
        from tandem.client.runstate import find_running_url

        url = settings.bus.nats_url or find_running_url(settings.data_dir)
        if not url:
            raise BusConnectError(f"--publish {name}: no running tandem on --data-dir {settings.data_dir}: start "
                                  "one with `tandem up`, or give its --nats-url")
        super().__init__(settings, name, job_id, url)

    def publish(self, path: Path, step: int) -> None:
        from tandem.client import Client, TandemError
        from tandem.shared.lora.peft_format import snapshot_adapter

        version = f"{self.job_id}.{step}"
        try:
            record = self.loop.run_until_complete(Client(self.nc).load_adapter(
                self.model, snapshot_adapter(path, version), version, source="trainer"))
        except (TandemError, OSError) as exc:  # the run goes on; the next checkpoint tries again
            print(f"tandem train: publishing adapter {self.model} (step {step}) failed: {exc}", flush=True)
            return
        print(f"tandem train: published adapter {record.name} version {record.version} (step {step}); requests "
              f"naming model {record.name!r} run with it now", flush=True)
