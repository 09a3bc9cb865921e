"""The ``tandem`` command.

    tandem up [--nats-url URL] [--model tiny|DIR] [--prefill N] [--decode N] [--demo [PROMPT]]
              [--planner] [--min-prefill N] [--max-prefill N] [--min-decode N] [--max-decode N]
    tandem serve router|prefill|decode|kvstore|planner|trainer --nats-url URL [engine flags] [kvstore flags]
    tandem train [--default] [--model tiny|1b|3b|7b|DIR] [--steps N] [--batch-size B] [--seq-len S] ...
    tandem generate PROMPT [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                           [--stop S ...] [--json] [--nats-url URL]
    tandem bench serve [--dataset-name random|prefix] [--request-rate R] [--goodput ttft:MS tpot:MS] ...
    tandem bench compare [--concurrency 1 8 32 64] [--requests N] [--json-out FILE]   (also: plain `tandem bench`)
    tandem console [--nats-url URL]

Every flag can also be set as a ``TANDEM_*`` environment variable (see tandem.shared.infra.config).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from tandem.bench_serve import add_arguments as add_bench_serve
from tandem.planner_flags import PLANNER_FLAGS, add_planner_flags
from tandem.shared.infra.config import load_settings

SERVICES = ("router", "prefill", "decode", "kvstore", "planner", "trainer")
DEMO_PROMPT = "def fibonacci(n):"


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nats-url", help="NATS server URL (default: embedded server / the running `tandem up`)")
    p.add_argument("--data-dir", help="where models, checkpoints and run state live")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING")


def add_engine(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="'tiny' (built in) or a Hugging Face model directory")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-blocks", type=int, help="KV pool size in blocks (0: from memory)")
    p.add_argument("--kv-cache-mib", type=int, help="KV pool budget on CPU")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="share of the GPU's memory for this worker, weights included (up: for all workers)")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget per step; the prefill chunk size")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--torch-threads", type=int, help="CPU threads per worker for model math (0: torch default)")
    p.add_argument("--kv-ring-mib", type=int,
                   help="shared-memory ring for same-host KV hand-offs (decode: its size; 0 turns the fast path off)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse cached KV blocks of shared prompt prefixes (default: on)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA: no decode CUDA graphs (default: graphs for batch sizes up to --max-num-seqs)")
    p.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=None,
                   help="with decode graphs: queue decode step N+1 before step N's tokens reach the host (default: on)")


ENGINE_FLAGS = ("device", "dtype", "block_size", "num_blocks", "kv_cache_mib", "gpu_memory_utilization", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "torch_threads", "enable_prefix_caching", "kv_ring_mib",
                "enforce_eager", "overlap_steps")
KVSTORE_FLAGS = ("kvstore_ram_mib", "kvstore_disk_mib", "kvstore_dir")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n\n")[0])
    sub = root.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the whole system on this machine")
    add_common(up)
    add_engine(up)
    up.add_argument("--prefill", type=int, default=1, help="prefill workers")
    up.add_argument("--decode", type=int, default=1, help="decode workers")
    up.add_argument("--kvstore", type=int, default=1, help="KV-stores (RAM, then disk under <data-dir>/kvstore)")
    up.add_argument("--demo", nargs="?", const=DEMO_PROMPT, metavar="PROMPT",
                    help="once up, generate from PROMPT and print it")
    up.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo")
    add_planner_flags(up, switch=True)

    serve = sub.add_parser("serve", help="run one service against an existing NATS server")
    serve.add_argument("service", choices=SERVICES)
    add_common(serve)
    add_engine(serve)
    serve.add_argument("--instance-id", help="this instance's id (default: service-host-random)")
    serve.add_argument("--kvstore-ram-mib", type=float, help="kvstore: host-RAM tier size")
    serve.add_argument("--kvstore-disk-mib", type=float, help="kvstore: disk tier size (0: RAM only)")
    serve.add_argument("--kvstore-dir", help="kvstore: disk tier folder (default: <data-dir>/kvstore)")
    serve.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0: a free one, -1: none)")
    add_planner_flags(serve)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt")
    add_common(gen)
    gen.add_argument("--model", help="model name (default: the router's)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout", type=float, default=60.0)
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")

    from tandem.train_cli import add_train_parser

    add_train_parser(sub, add_common)

    console = sub.add_parser("console", help="the ops console (a terminal UI) for a running tandem")
    add_common(console)

    bench = sub.add_parser("bench", help="load benchmarks").add_subparsers(dest="bench_command", required=True)
    serve_bench = bench.add_parser("serve", help="load a running tandem, report latency and goodput (vllm bench serve)")
    add_common(serve_bench)
    add_bench_serve(serve_bench)
    compare = bench.add_parser("compare", help="bus path versus in-process engine, same run")
    add_common(compare)
    add_engine(compare)
    compare.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    compare.add_argument("--requests", type=int, default=0, help="requests per level (default: 4x concurrency, >= 32)")
    compare.add_argument("--input-len", type=int, default=64)
    compare.add_argument("--output-len", type=int, default=64)
    compare.add_argument("--json-out")
    return root


def settings_from(args: argparse.Namespace, *names: str):
    flags = {n: getattr(args, n, None) for n in ("nats_url", "data_dir", "log_level", "model", "instance_id", *names)}
    return load_settings(**flags)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """Engine flags given to ``up``/``bench``, passed on to the workers it starts."""
    argv = []
    for name in ENGINE_FLAGS:
        value, flag = getattr(args, name, None), name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            argv += [f"--{flag}", str(value)]
    return argv


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.services.common.runtime import setup_logging

    settings = settings_from(args, *ENGINE_FLAGS, *KVSTORE_FLAGS, *PLANNER_FLAGS, "metrics_port")
    setup_logging(settings.log_level)
    if args.service == "planner":
        from tandem.services.planner.service import main
    elif args.service == "trainer":
        from tandem.services.trainer.service import main
    elif args.service == "kvstore":
        from tandem.services.kvstore.service import main
    elif args.service == "router":
        from tandem.services.router.service import main
    elif args.service == "prefill":
        from tandem.services.prefill.service import main
    else:
        from tandem.services.decode.service import main
    main(settings)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from tandem.up import run_up

    return run_up(args, settings_from(args, *ENGINE_FLAGS), engine_argv(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.client import TandemError, connect
    from tandem.services.common.runtime import run_async
    from tandem.supervisor import find_running_url

    settings = settings_from(args)
    url = settings.nats_url or find_running_url(settings.data_dir)
    if url is None:
        print("tandem generate: no running tandem found; start one with `tandem up` or pass --nats-url",
              file=sys.stderr)
        return 2
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)

    async def run() -> None:
        async with connect(url, request_timeout_s=args.timeout) as client:
            if args.json:
                result = await client.complete(args.prompt, model=args.model, **params)
                print(json.dumps({
                    "request_id": result.request_id, "text": result.text,
                    "prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids,
                    "finish_reason": result.finish_reason, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                }))
                return
            async for chunk in client.generate(args.prompt, model=args.model, **params):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")

    try:
        run_async(run())
    except TandemError as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from tandem.console.app import run_console
    from tandem.supervisor import find_running_url

    settings = settings_from(args)
    return run_console(settings.nats_url or find_running_url(settings.data_dir))


def cmd_train(args: argparse.Namespace) -> int:
    from tandem.services.common.runtime import setup_logging
    from tandem.train_cli import cmd_train as run_train

    settings = settings_from(args)
    setup_logging(settings.log_level)
    return run_train(args, settings)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from tandem.bench_serve import run_bench_serve

        return run_bench_serve(args, settings_from(args))
    from tandem.bench import run_bench

    return run_bench(args, settings_from(args, *ENGINE_FLAGS), engine_argv(args))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in ("serve", "compare", "-h", "--help")):
        argv.insert(1, "compare")  # plain `tandem bench` is the comparison it always was
    args = parser().parse_args(argv)
    logging.captureWarnings(True)
    handler = {"up": cmd_up, "serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench,
               "console": cmd_console, "train": cmd_train}[args.command]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
