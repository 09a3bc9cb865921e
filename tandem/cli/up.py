"""``tandem up`` as a command: refuse what cannot work (a bad model, a taken port, a data dir another
``up`` holds: :mod:`tandem.client.runstate`) before anything starts, place the workers on the devices it
sees (:func:`tandem.cli.gpus.plan_placement`: on one GPU no prefill worker unless asked) and say so in
one line, start the system (:mod:`tandem.cli.supervisor`), print its URLs, optionally generate a demo,
then supervise it (:mod:`tandem.cli.scaling`) until Ctrl-C or SIGTERM, drain it (:mod:`tandem.cli.shutdown`;
a second Ctrl-C stops at once) and stop it all."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.shared.infra.config import Settings

if TYPE_CHECKING:
    from tandem.cli.gpus import Placement
    from tandem.cli.supervisor import Supervisor

log = logging.getLogger("tandem.cli.up")


def add_up_parser(sub: argparse._SubParsersAction, settings_note: str, demo_prompt: str) -> None:
    """``tandem up``'s flags: its own, then every settings flag (handed on to the children)."""
    from tandem.cli.flags import UP_SETTINGS, add_settings, int_at_least

    up = sub.add_parser("up", help="run the whole system on this machine", epilog=settings_note,
                        description="The whole system on this machine: an embedded nats-server (unless --nats-url; "
                                    "on --port if given), KV-stores, decode and prefill workers, a router and the "
                                    "OpenAI-compatible HTTP frontend (--http-port) as child processes. Settings "
                                    "flags given here are handed on to the children whose service uses them; "
                                    "--metrics-port N gives the i-th child N+i.")
    up.add_argument("--prefill", type=int_at_least(0), default=None,
                    help="prefill workers (default: by the devices: none on one GPU, where the decode workers prefill "
                         "themselves; else 1). Given on one GPU, they are started and used there")
    up.add_argument("--decode", type=int_at_least(0), default=1, help="decode workers (default: 1)")
    for kind in ("prefill", "decode"):
        up.add_argument(f"--{kind}-tensor-parallel-size", type=int_at_least(1), default=None, metavar="K",
                        help=f"GPUs (tensor-parallel ranks) per {kind} worker (default: --tensor-parallel-size)")
    up.add_argument("--kvstore", type=int_at_least(0), default=1,
                    help="KV-stores (RAM, then disk under <data-dir>/kvstore; default: 1)")
    up.add_argument("--demo", nargs="?", const=demo_prompt, metavar="PROMPT",
                    help="once up, generate from PROMPT and print it")
    up.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo")
    up.add_argument("--planner", action=argparse.BooleanOptionalAction, default=False,
                    help="run the planner and carry out its scaling decisions (default: off, counts stay as given)")
    add_settings(up, *UP_SETTINGS)


def run_up(args: argparse.Namespace, settings: Settings, overrides: dict[str, Any]) -> int:
    """``overrides``: the settings flags given (flat name -> value), handed on to the children.

    Everything that can be refused is refused before anything starts, each in one line: a usage
    problem (a model that cannot load, a fixed port taken) exits 2, a data dir another ``up`` holds 1."""
    from tandem.cli.gpus import PlacementError
    from tandem.cli.supervisor import Supervisor, UsageError
    from tandem.client.runstate import AlreadyRunning, claim, nats_dir
    from tandem.shared.infra.natsserver import NatsServerError
    from tandem.shared.infra.process import run_async, setup_logging

    setup_logging(settings.log_level)
    problem = usage_problem(settings)
    if problem:
        print(f"tandem up: {problem}", file=sys.stderr)
        return 2
    try:
        held = claim(settings.data_dir)
    except AlreadyRunning as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a data dir it may not write to (or a file where the folder should be)
        print(f"tandem up: --data-dir {settings.data_dir}: cannot keep its run state there "
              f"({exc.strerror or exc}: {exc.filename})", file=sys.stderr)
        return 2
    if held.removed:
        log.info("cleaned up after a tandem up that was killed: %s", "; ".join(held.removed))
    try:
        gpus, placement = place(settings, args, overrides)
    except PlacementError as exc:
        held.release()
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    sup = Supervisor(settings, num_prefill=placement.prefill, num_decode=args.decode, num_kvstore=args.kvstore,
                     prefill_ranks=placement.prefill_ranks, decode_ranks=placement.decode_ranks,
                     overrides=overrides, planner=args.planner, frontend=True, gpus=gpus,
                     nats_workdir=None if settings.bus.nats_url else nats_dir(settings.data_dir),
                     min_prefill=overrides.get("planner_min_prefill"), max_prefill=placement.planner_max_prefill,
                     min_decode=overrides.get("planner_min_decode"), max_decode=overrides.get("planner_max_decode"))
    try:
        sup.check_ports()
    except UsageError as exc:
        held.release()
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2

    stopping = False  # the final stop has begun: a signal must not cut it short

    def on_signal(_signum, _frame):
        # Starting, the demo and the final stop (while serving, the loop takes the signals itself:
        # serve_until_stopped). SIGTERM stops as cleanly as Ctrl-C. The flag as well: an exception
        # raised here is lost when the signal lands inside a weakref callback or a __del__, and the
        # supervisor's loops check it. During the final stop nothing is raised: it must not be cut short.
        if stopping or sup.stop_requested:
            sup.stop_now = True
        sup.stop_requested = True
        if not stopping:
            raise KeyboardInterrupt

    # Both explicitly: a shell that starts `up` in the background hands it SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"tandem up: {placement.line}", flush=True)
    try:
        sup.start()
        run_async(sup.wait_ready())
        sup.write_state()
        scaling = "planner on, prefill {}..{}, decode {}..{}".format(*sup.limits("prefill"), *sup.limits("decode"))
        http = f", HTTP at {sup.http_url}" if sup.http_url else ""
        print(f"tandem up: NATS at {sup.url}{http} (router, {placement.prefill} prefill, {args.decode} decode, "
              f"{args.kvstore} kvstore; {scaling if args.planner else 'planner off'}; Ctrl-C stops)", flush=True)
        print("\n".join(sup.url_lines()), flush=True)
        if args.demo:
            run_async(demo(sup.url, args.demo, sup.client_creds()))
            weights_note(sup.settings)
            if args.exit_after_demo:
                return 0
        run_async(serve_until_stopped(sup, on_signal))
        return 0
    except KeyboardInterrupt:
        return 0
    except (NatsServerError, RuntimeError) as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    finally:
        stopping = True
        sup.stop()
        held.release()
        print("tandem up: stopped", flush=True)


async def serve_until_stopped(sup: Supervisor, sync_handler: Callable[[int, Any], None]) -> None:
    """Supervise until the first SIGINT/SIGTERM, then drain (both in ``sup.supervise()``); a second
    signal stops at once. The loop takes the signals here, so none lands as an exception inside a
    callback; ``sync_handler`` takes them again afterwards."""
    loop = asyncio.get_running_loop()

    def on_stop() -> None:
        if sup.stop_requested and not sup.stop_now:
            sup.stop_now = True
            print("tandem up: stopping at once", flush=True)
        sup.stop_requested = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop)
    try:
        await sup.supervise()  # restarts crashed children, carries out the planner's decisions, then drains
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
            signal.signal(sig, sync_handler)


def place(settings: Settings, args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[list[str], Placement]:
    """The GPUs the workers get and how many of each kind run there (:func:`tandem.cli.gpus.plan_placement`).
    Sets the router's ``prefill_on_shared_device`` in ``overrides`` as the placement wants, unless given."""
    from tandem.cli.gpus import plan_placement, visible_gpus

    gpus = visible_gpus(settings.engine.device)
    # --device cuda:N pins every worker to that one device: shared, as one GPU is.
    devices = len(gpus) or int(settings.engine.device.startswith("cuda:"))
    ranks = {kind: getattr(args, f"{kind}_tensor_parallel_size", None) or settings.engine.tensor_parallel_size
             for kind in ("prefill", "decode")}
    placement = plan_placement(devices, args.prefill, args.decode, overrides.get("planner_max_prefill"),
                               ranks["prefill"], ranks["decode"])
    if placement.prefill_on_shared_device:
        overrides.setdefault("router_prefill_on_shared_device", True)
    return gpus, placement


def usage_problem(settings: Settings) -> str:
    """Why these settings cannot run, in one line naming the flag ("" when they can). The model is
    read as the workers will read it (config and tokenizer, no weights, no torch), so a bad
    ``--model`` is refused before the server and every worker start only to fail the same way."""
    from tandem.shared.model.meta import load_model_meta

    if settings.bus.nats_url and settings.supervisor.nats_port:
        return (f"--port {settings.supervisor.nats_port} and --nats-url {settings.bus.nats_url}: --port is the "
                "embedded server's, --nats-url means no embedded server; give one")
    if settings.bus.nats_url and settings.supervisor.nats_monitor_port != -1:
        return (f"--nats-monitor-port {settings.supervisor.nats_monitor_port} and --nats-url {settings.bus.nats_url}: "
                "--nats-monitor-port is the embedded server's, --nats-url means no embedded server; give one")
    try:
        meta = load_model_meta(settings.model, settings.data_dir)
    except Exception as exc:  # a config or tokenizer that does not parse raises its library's own errors
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"--model {settings.model}: {reason}"
    return lora_modules_problem(settings, meta.config)


def lora_modules_problem(settings: Settings, config) -> str:  # noqa: ANN001 - a ModelConfig
    """``--lora-modules`` checked as the router will check them (config and tensor shapes, against the
    workers' --max-lora-rank), and refused without adapter slots: "" when they can be served."""
    from tandem.shared.infra.config import lora_modules
    from tandem.shared.lora.peft_format import AdapterError, check_adapter

    modules = lora_modules(settings.router.lora_modules)
    if modules and not settings.engine.max_loras:
        return (f"--lora-modules names {len(modules)} adapter(s) but the workers have no adapter slots: add "
                f"--max-loras {max(len(modules), 1)} (adapters resident on a GPU at once)")
    for name, path in modules:
        try:
            check_adapter(path, config, settings.engine.max_lora_rank)
        except AdapterError as exc:
            return f"--lora-modules {name}={path}: {exc}"
    return ""


async def demo(url: str, prompt: str, creds: str | None) -> None:
    """One sampled generation through the whole system, printed in one piece with its timings
    (streaming it would interleave with the services' log lines on the same terminal)."""
    from tandem.client import connect

    async with connect(url, creds=creds) as client:
        result = await client.complete(prompt, max_tokens=64, temperature=0.8, top_k=40, seed=0)
    print(f"--- demo: {prompt!r} (temperature 0.8, top-k 40, seed 0, 64 tokens)\n{prompt}{visible(result.text)}\n"
          f"--- {len(result.token_ids)} tokens, finish {result.finish_reason}, first token after "
          f"{result.ttft_s * 1e3:.0f} ms, then {result.tpot_s * 1e3:.1f} ms per token", flush=True)


def weights_note(settings) -> None:
    """Say which weights the built-in model's demo came from, and how to train your own."""
    from tandem.shared.model.meta import CODER, TINY, TINY_RANDOM, load_model_meta, trained_tiny_dir

    if settings.model not in (CODER, TINY, TINY_RANDOM):
        return
    meta = load_model_meta(settings.model, settings.data_dir)
    if settings.model == CODER:
        note = (f"the coder model is your checkpoint in {meta.checkpoint}" if meta.source == "data-dir" else
                "the coder model is the code model shipped with tandem, trained from scratch by `tandem train` on "
                f"the Python standard library (how: {meta.checkpoint}/PROVENANCE.md)")
    elif meta.source == "data-dir":
        note = f"the tiny model is your checkpoint in {meta.checkpoint}"
    elif meta.source == "shipped":
        note = ("the tiny model is the checkpoint shipped with tandem, made by `tandem train --default` (200 steps "
                "on the Python standard library: Python-shaped, not fluent); that command saves your own run to "
                f"{trained_tiny_dir(settings.data_dir)}, which `tandem up` then serves instead")
    elif settings.model == TINY_RANDOM:
        note = "tiny-random is the tiny model with seeded random weights: noise, by design"
    else:
        note = ("the tiny model has random weights (no checkpoint in the data dir, none shipped in the package); "
                "`tandem train --default` trains it on the Python standard library in a few minutes, and "
                "`tandem up` then serves the trained one")
    print(f"--- {note}", flush=True)


def visible(text: str) -> str:
    """Control characters as escapes: an untrained model emits plenty, and a terminal hides them."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)
