"""The ``tandem`` command.

    tandem up [--nats-url URL] [--model tiny|DIR] [--prefill N] [--decode N] [--demo [PROMPT]]
              [--planner] [--min-prefill N] [--max-prefill N] [--min-decode N] [--max-decode N]
    tandem serve router|prefill|decode|kvstore|planner|trainer --nats-url URL [its settings flags]
    tandem train [--default] [--model tiny|1b|3b|7b|DIR] [--steps N] [--batch-size B] [--seq-len S] ...
    tandem generate PROMPT [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                           [--stop S ...] [--json] [--nats-url URL]
    tandem bench serve [--dataset-name random|prefix] [--request-rate R] [--goodput ttft:MS tpot:MS] ...
    tandem bench compare [--concurrency 1 8 32 64] [--requests N] [--json-out FILE]   (also: plain `tandem bench`)
    tandem console [--nats-url URL]

The settings flags are generated from :mod:`tandem.shared.infra.config` (:mod:`tandem.flags`): every
one is also a ``TANDEM_*`` environment variable, and ``tandem serve <service> --help`` lists each
with its default.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tandem.bench_serve import add_arguments as add_bench_serve
from tandem.flags import CLIENT, SERVICE_SETTINGS, add_settings, given, settings_from

SERVICES = tuple(SERVICE_SETTINGS)
SERVICE_HELP = {
    "router": "place requests on prefill and decode workers",
    "prefill": "a prefill worker: prompts in, KV and the first token out to a decode worker",
    "decode": "a decode worker: takes hand-offs (or prefills itself) and streams tokens",
    "kvstore": "KV blocks by prefix hash in host RAM and on local disk",
    "planner": "decides worker counts from TTFT/TPOT targets and the live load",
    "trainer": "training jobs over NATS",
    "frontend": "the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models)",
}
DEMO_PROMPT = "def fibonacci(n):"
SETTINGS_NOTE = ("Each flag is also a TANDEM_ environment variable (shown after its default); "
                 "a flag wins over its variable. The settings: shared/infra/config.py.")


def add_common(p: argparse.ArgumentParser) -> None:
    """--nats-url, --data-dir, --log-level: for commands that talk to a running tandem."""
    add_settings(p, *CLIENT)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="tandem", description=__doc__.split("\n\n")[0])
    sub = root.add_subparsers(dest="command", required=True)

    from tandem.up import add_up_parser

    add_up_parser(sub, SETTINGS_NOTE, DEMO_PROMPT)

    serve = sub.add_parser("serve", help="run one service against an existing NATS server",
                           description="One service against an existing NATS server. "
                                       "`tandem serve SERVICE --help` lists its flags with their defaults.")
    services = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, specs in SERVICE_SETTINGS.items():
        one = services.add_parser(name, help=SERVICE_HELP[name], epilog=SETTINGS_NOTE,
                                  description=f"tandem serve {name}: {SERVICE_HELP[name]}.")
        add_settings(one, *specs)

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
    compare = bench.add_parser("compare", help="bus path versus in-process engine, same run", epilog=SETTINGS_NOTE)
    add_settings(compare, "model", *CLIENT, "engine", "kv_ring")
    compare.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    compare.add_argument("--requests", type=int, default=0, help="requests per level (default: 4x concurrency, >= 32)")
    compare.add_argument("--input-len", type=int, default=64)
    compare.add_argument("--output-len", type=int, default=64)
    compare.add_argument("--json-out")
    return root


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.services.common.runtime import setup_logging

    settings = settings_from(args)
    setup_logging(settings.log_level)
    if args.service == "planner":
        from tandem.services.planner.service import main
    elif args.service == "trainer":
        from tandem.services.trainer.service import main
    elif args.service == "kvstore":
        from tandem.services.kvstore.service import main
    elif args.service == "frontend":
        from tandem.services.frontend.service import main
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

    return run_up(args, settings_from(args), given(args))


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.client import TandemError, connect
    from tandem.runstate import find_running_url
    from tandem.services.common.runtime import run_async

    settings = settings_from(args)
    url = settings.bus.nats_url or find_running_url(settings.data_dir)
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
    from tandem.runstate import find_running_url

    settings = settings_from(args)
    return run_console(settings.bus.nats_url or find_running_url(settings.data_dir))


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

    return run_bench(args, settings_from(args), given(args))


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
