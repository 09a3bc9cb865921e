"""The ``tandem`` command.

    tandem up [--nats-url URL] [--model tiny|DIR] [--prefill N] [--decode N] [--demo [PROMPT]]
              [--planner] [--min-prefill N] [--max-prefill N] [--min-decode N] [--max-decode N]
    tandem serve router|prefill|decode|kvstore|planner|trainer --nats-url URL [its settings flags]
    tandem train [--default] [--model tiny|1b|3b|7b|DIR] [--steps N] [--batch-size B] [--seq-len S] ...
    tandem generate PROMPT|-|@FILE [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                           [--stop S ...] [--n N] [--best-of N] [--beam-width K] [--length-penalty F]
                           [--early-stopping true|false|never] [--presence-penalty X] [--frequency-penalty X]
                           [--repetition-penalty X] [--min-tokens N] [--logit-bias ID=BIAS ...]
                           [--logprobs N] [--prompt-logprobs N] [--priority P] [--json] [--nats-url URL]
    tandem bench serve [--dataset-name random|prefix] [--request-rate R] [--goodput ttft:MS tpot:MS]
                       [--base-url http://HOST:PORT] ...
    tandem bench compare [--concurrency 1 8 32 64] [--requests N] [--json-out FILE]   (also: plain `tandem bench`)
    tandem console [--nats-url URL]
    tandem services [--json] [--nats-url URL]
    tandem ping router|prefill|decode|kvstore|planner|trainer|frontend [--host HOST] [--wait S] [--nats-url URL]
    tandem bundle --out DIR [--torch cpu|cuda] [--platform TAG] [--python-version X.Y] [--images auto|require|skip]
                  [--force] [--dry-run]      (everything an offline host needs: wheels, images, install.sh)
    tandem --version

The settings flags are generated from :mod:`tandem.shared.infra.config` (:mod:`tandem.cli.flags`): every
one is also a ``TANDEM_*`` environment variable, and ``tandem serve <service> --help`` lists each
with its default. Every other flag's help ends with its default too. Flags are never abbreviated
(``--nats`` is an error, not ``--nats-url``), and a command line that cannot run gets one line naming
what to change, exit status 2.

The base install (``pip install tandem``, no torch) runs every command that talks to a running
tandem, so nothing those commands import at module level may need the engine; ``up``, ``serve``,
``train`` and ``bench compare`` need the ``serve`` or ``train`` extra and, without it, say which in
one line, exit status 2 (:mod:`tandem.cli.extras`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from contextlib import aclosing
from pathlib import Path
from typing import Any, TextIO

from tandem.cli.bench_serve import add_arguments as add_bench_serve
from tandem.cli.extras import missing_extra
from tandem.cli.flags import (
    CLIENT,
    SERVICE_SETTINGS,
    Parser,
    SettingsError,
    add_settings,
    given,
    int_at_least,
    invalid_value,
    settings_from,
    show_defaults,
)
from tandem.shared.infra.version import VERSION

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
# generate's flag for each SamplingParams field: a refused value is reported by its flag.
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                  "top_k": "--top-k", "seed": "--seed", "stop": "--stop", "ignore_eos": "--ignore-eos",
                  "logprobs": "--logprobs", "prompt_logprobs": "--prompt-logprobs", "n": "--n",
                  "best_of": "--best-of", "beam_width": "--beam-width", "length_penalty": "--length-penalty",
                  "early_stopping": "--early-stopping", "presence_penalty": "--presence-penalty",
                  "frequency_penalty": "--frequency-penalty", "repetition_penalty": "--repetition-penalty",
                  "min_tokens": "--min-tokens", "logit_bias": "--logit-bias",
                  "structured_output": "--json-schema/--regex/--choice/--grammar"}
EARLY_STOPPING = {"true": True, "false": False, "never": "never"}  # --early-stopping's words -> the wire's values
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


class UsageError(Exception):
    """A command line that cannot run as given; ``str()`` is the one line naming what to change (exit 2)."""


class UnreachableError(Exception):
    """The NATS server a command was pointed at does not answer; ``str()`` says which (exit 1)."""


def add_common(p: argparse.ArgumentParser) -> None:
    """--nats-url, --data-dir, --log-level: for commands that talk to a running tandem."""
    add_settings(p, *CLIENT)


def parser() -> argparse.ArgumentParser:
    # Parser (tandem.cli.flags): no abbreviated flags, one-line errors; every subparser below, those
    # tandem/cli/up.py and tandem/cli/train.py add included, is made of the same class by argparse.
    root = Parser(prog="tandem", description="tandem: disaggregated LLM serving (prefill and decode workers over "
                                              "NATS) and single-GPU training of models larger than GPU memory.")
    root.add_argument("--version", action="version", version=f"tandem {VERSION}")
    sub = root.add_subparsers(dest="command", required=True)

    from tandem.cli.up import add_up_parser

    add_up_parser(sub, SETTINGS_NOTE, DEMO_PROMPT)

    serve = sub.add_parser("serve", help="run one service against an existing NATS server",
                           description="One service against an existing NATS server. "
                                       "`tandem serve SERVICE --help` lists its flags with their defaults.")
    services = serve.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, specs in SERVICE_SETTINGS.items():
        one = services.add_parser(name, help=SERVICE_HELP[name], epilog=SETTINGS_NOTE,
                                  description=f"tandem serve {name}: {SERVICE_HELP[name]}.")
        add_settings(one, *specs)

    gen = sub.add_parser("generate", help="generate text from a prompt",
                         description="Generate from PROMPT on the running tandem, streaming the text as it comes. "
                                     "Ctrl-C stops it and cancels the request on the workers.")
    gen.add_argument("prompt", help="the prompt; - reads it from standard input, @FILE from a file (as is, "
                                    "trailing newline included)")
    add_common(gen)
    gen.add_argument("--model", help="model name (default: the router's)")
    gen.add_argument("--max-tokens", metavar="N", type=int, default=64, help="stop after this many tokens")
    gen.add_argument("--temperature", metavar="T", type=float, default=1.0, help="0: greedy")
    gen.add_argument("--top-p", metavar="P", type=float, default=1.0,
                     help="keep the most likely tokens holding this much probability; 1: off")
    gen.add_argument("--top-k", metavar="K", type=int, default=-1, help="keep the K most likely tokens; -1: off")
    gen.add_argument("--seed", metavar="S", type=int,
                     help="samples depend only on the seed and the output position (default: unset, a different "
                          "sample each run)")
    gen.add_argument("--stop", metavar="TEXT", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="go on past the model's end-of-sequence token")
    gen.add_argument("--timeout", metavar="SECONDS", type=float, default=60.0,
                     help="seconds without output before giving up")
    gen.add_argument("--priority", metavar="P", type=int, default=0,
                     help="place before requests of a higher P while the decode workers are full (-100..100; "
                          "equal priorities first come, first served)")
    gen.add_argument("--n", metavar="N", type=int, default=1,
                     help="outputs to return (1..64); more than one are printed whole at the end, best first")
    gen.add_argument("--best-of", metavar="N", type=int,
                     help="draw N candidates and return the --n with the highest cumulative logprob (default: --n)")
    gen.add_argument("--beam-width", metavar="K", type=int, default=1,
                     help="beam search with K beams, returning the --n best (deterministic; --temperature, --top-p, "
                          "--top-k and --seed do not apply); 1: off")
    gen.add_argument("--length-penalty", metavar="F", type=float, default=1.0,
                     help="beam search: a beam scores sum(logprobs) / length ** F")
    gen.add_argument("--early-stopping", choices=tuple(EARLY_STOPPING), default="false",
                     help="beam search: true stops once --beam-width beams have finished, false when a better one "
                          "is unlikely (a heuristic), never only when none can be better (transformers' meanings)")
    gen.add_argument("--presence-penalty", metavar="X", type=float, default=0.0,
                     help="subtract X from the logit of every token already in the output (-2..2)")
    gen.add_argument("--frequency-penalty", metavar="X", type=float, default=0.0,
                     help="subtract X from a token's logit per time it is already in the output (-2..2)")
    gen.add_argument("--repetition-penalty", metavar="X", type=float, default=1.0,
                     help="divide the positive logits (multiply the negative) of tokens in the prompt or output by X; "
                          "1: off")
    gen.add_argument("--min-tokens", metavar="N", type=int, default=0,
                     help="no end-of-sequence or stop token before N output tokens")
    gen.add_argument("--logit-bias", metavar="ID=BIAS", type=logit_bias_pair, action="append", default=[],
                     help="add BIAS (-100..100) to token ID's logit (repeatable)")
    gen.add_argument("--logprobs", metavar="N", type=int,
                     help="with --json: each token's log-probability and the N most likely tokens of its step "
                          "(0..20; raw log_softmax of the model's logits)")
    gen.add_argument("--prompt-logprobs", metavar="N", type=int,
                     help="with --json: the same for every prompt token but the first (0..20)")
    structured = gen.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE",
                            help="constrain the output to JSON that FILE's JSON schema admits (- : standard input)")
    structured.add_argument("--regex", metavar="RE", help="constrain the output to text the regular expression matches")
    structured.add_argument("--choice", metavar="TEXT", action="append",
                            help="constrain the output to exactly one of the --choice texts (repeatable)")
    structured.add_argument("--grammar", metavar="FILE",
                            help="constrain the output to FILE's grammar (Lark, or GBNF: rules written name ::= ...)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object instead of streaming: prompt_token_ids and outputs (each text, "
                          "token_ids, finish_reason, cumulative_logprob, logprobs), best first")

    from tandem.cli.train import add_train_parser

    add_train_parser(sub, add_common)
    describe_train_defaults(sub.choices["train"])

    from tandem.cli.auth_init import add_auth_parser

    add_auth_parser(sub)

    from tandem.cli.bundle import add_bundle_parser

    add_bundle_parser(sub)

    console = sub.add_parser("console", help="the ops console (a terminal UI) for a running tandem")
    add_common(console)

    listing = sub.add_parser("services", help="list the service instances of a running tandem ($SRV discovery)",
                             description="Every service instance that answers $SRV.INFO on the running tandem's "
                                         "NATS server: name, instance id, version, host, pid and URLs.")
    add_common(listing)
    listing.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    listing.add_argument("--wait", type=float, default=0.5, help="seconds to collect answers")

    ping = sub.add_parser("ping", help="exit 0 when a service instance on this host answers $SRV.PING (a "
                                       "readiness probe)",
                          description="Ask every instance of SERVICE on the bus $SRV.PING and exit 0 as soon as one "
                                      "on HOST answers, else 1: a container's readiness probe (its hostname is the "
                                      "one its service reports). Connects with --creds / TANDEM_NATS_CREDS, which a "
                                      "service's container already has (its role may ping its own service).")
    ping.add_argument("service", choices=SERVICES, help="which service")
    add_common(ping)
    ping.add_argument("--host", help="the host the instance must report (default: this one's hostname)")
    ping.add_argument("--wait", type=float, default=2.0, help="seconds to wait for its answer")

    bench = sub.add_parser("bench", help="load benchmarks").add_subparsers(dest="bench_command", required=True)
    serve_bench = bench.add_parser("serve", help="load a running tandem, report latency and goodput (vllm bench serve)")
    add_common(serve_bench)
    add_bench_serve(serve_bench)
    compare = bench.add_parser("compare", help="bus path versus in-process engine, same run", epilog=SETTINGS_NOTE)
    add_settings(compare, "model", *CLIENT, "engine", "kv_ring")
    compare.add_argument("--concurrency", type=int_at_least(1), nargs="+", default=[1, 8, 32, 64],
                         help="requests in flight, one level each")
    compare.add_argument("--requests", type=int_at_least(0), default=0,
                         help="requests per level (default: 4x concurrency, >= 32)")
    compare.add_argument("--input-len", type=int_at_least(1), default=64, help="prompt tokens")
    compare.add_argument("--output-len", type=int_at_least(1), default=64, help="output tokens, exactly")
    compare.add_argument("--json-out", help="write the figures here (default: not written)")
    show_defaults(root)
    return root


def describe_train_defaults(train: argparse.ArgumentParser) -> None:
    """Put each job flag's default in its help. The flags themselves default to None (a flag left out
    takes the TrainJob field's default, or the tiny run's with --default: train_cli.DEFAULT_JOB), so
    the generic ``(default: ...)`` of :func:`show_defaults` would say "unset" for all of them."""
    from tandem.cli.train import DEFAULT_JOB, JOB_FLAGS
    from tandem.shared.protocol.training import TrainJob

    for action in train._actions:
        text = action.help or ""
        if action.dest not in JOB_FLAGS or action.nargs == 0 or "default" in text:
            continue
        value = TrainJob.model_fields[action.dest].default
        shown = "unset" if value is None else str(value)
        tiny = DEFAULT_JOB.get(action.dest)
        if tiny is not None and tiny != value:
            shown += f"; {tiny} with --default"
        action.help = f"{text} (default: {shown})".strip().replace("%", "%%")


def command_parser(root: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the subcommand ``args`` ran (``tandem generate``'s for ``tandem generate ...``)."""
    current = root
    while True:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None:
            return current
        current = subs[0].choices[name]


def cmd_serve(args: argparse.Namespace) -> int:
    from tandem.shared.infra.process import setup_logging

    settings = settings_from(args)
    if not settings.bus.nats_url:  # every service is on a bus: nothing would run without one
        raise SettingsError("--nats-url (or TANDEM_NATS_URL) is required: the NATS server to serve on")
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
    from tandem.cli.up import run_up

    return run_up(args, settings_from(args), given(args))


def read_prompt(arg: str, stdin: TextIO | None = None) -> str:
    """The prompt ``arg`` gives: itself, standard input for ``-``, a file's text for ``@FILE``;
    :class:`UsageError` for a file that cannot be read or an empty prompt."""
    if arg == "-":
        prompt, where = (stdin or sys.stdin).read(), "standard input"
    elif arg.startswith("@"):
        path = Path(arg[1:])
        try:
            prompt = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"the prompt file {path} is not UTF-8 text") from None
        except OSError as exc:
            raise UsageError(f"cannot read the prompt file {path}: {exc.strerror or exc}") from None
        where = f"the prompt file {path}"
    else:
        prompt, where = arg, "the command line"
    if not prompt:
        raise UsageError(f"the prompt from {where} is empty")
    return prompt


def logit_bias_pair(text: str) -> tuple[int, float]:
    """``--logit-bias ID=BIAS`` as (token id, bias); its bounds are the wire's, checked with the rest."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes ID=BIAS (a token id and a number), not {text!r}") from None


def sampling_params(args: argparse.Namespace) -> dict[str, Any]:
    """generate's sampling flags as SamplingParams fields, checked against its bounds first: a value
    out of bounds is :class:`UsageError` naming the flag and the bound the model declares."""
    from pydantic import ValidationError

    from tandem.shared.protocol.serving import MAX_PRIORITY, MIN_PRIORITY, SamplingParams

    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                  prompt_logprobs=args.prompt_logprobs, n=args.n, best_of=args.best_of, beam_width=args.beam_width,
                  length_penalty=args.length_penalty, early_stopping=EARLY_STOPPING[args.early_stopping],
                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                  repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
                  logit_bias=list(args.logit_bias))
    structured = structured_output(args)
    if structured is not None:
        params["structured_output"] = structured
    try:
        SamplingParams(**params)
    except ValidationError as exc:
        raise UsageError(invalid_value(exc, SamplingParams, SAMPLING_FLAGS)) from None
    if not args.timeout > 0:
        raise UsageError("--timeout must be > 0")
    if not MIN_PRIORITY <= args.priority <= MAX_PRIORITY:
        raise UsageError(f"--priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}]")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(args, name) is not None and not args.json:
            flag = SAMPLING_FLAGS[name]
            raise UsageError(f"{flag} needs --json (the streamed text has no place for them)")
    if args.beam_width == 1:  # as vLLM: a beam-search knob without beam search is a mistake, not a no-op
        if args.length_penalty != 1.0:
            raise UsageError("--length-penalty applies to beam search only (--beam-width > 1)")
        if args.early_stopping != "false":
            raise UsageError("--early-stopping applies to beam search only (--beam-width > 1)")
    return params


def structured_output(args: argparse.Namespace) -> dict[str, Any] | None:
    """generate's --json-schema, --regex, --choice or --grammar as a StructuredOutput's fields (the
    workers compile it: a spec that does not compile comes back as the request's error)."""
    from tandem.shared.protocol.serving import grammar_syntax

    if args.regex is not None:
        return {"kind": "regex", "spec": args.regex}
    if args.choice:
        return {"kind": "choice", "choices": args.choice}
    if args.grammar is not None:
        text = read_spec_file(args.grammar, "--grammar")
        return {"kind": grammar_syntax(text), "spec": text}
    if args.json_schema is not None:
        text = read_spec_file(args.json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"--json-schema: {args.json_schema} is not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise UsageError(f"--json-schema: {args.json_schema} holds a {type(schema).__name__}, not a schema object")
        return {"kind": "json_schema", "spec": json.dumps(schema, separators=(",", ":"))}
    return None


def read_spec_file(path: str, flag: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag}: cannot read {path} ({exc.strerror if isinstance(exc, OSError) else exc})") from None


def logprobs_fields(result) -> dict[str, Any]:
    """``--json``'s top-level logprobs fields (the best output's, in the shape one-output requests
    always printed) for a ``Completion`` that asked for them (none when it did not): per token its
    id, logprob and top alternatives, and their sum."""
    if result.logprobs is None:
        return {}
    tokens = [{"token_id": token_id, "logprob": entry.logprob,
               "top_logprobs": [{"token_id": top_id, "logprob": value} for top_id, value in entry.top]}
              for token_id, entry in zip(result.token_ids, result.logprobs)]
    return {"logprobs": tokens, "cumulative_logprob": result.cumulative_logprob}


def token_logprobs_json(entry) -> dict[str, Any]:
    """One token's logprob and its step's top alternatives as ``--json`` prints them in ``outputs``."""
    return {"logprob": entry.logprob, "top": [[top_id, value] for top_id, value in entry.top]}


def completion_json(result) -> dict[str, Any]:
    """``--json``'s one object for a ``Completion``: the prompt's ids, every output best first, and
    beside them the best output's fields as one-output requests always printed them."""
    outputs = [{"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                "cumulative_logprob": out.cumulative_logprob,
                "logprobs": None if out.logprobs is None else [token_logprobs_json(e) for e in out.logprobs]}
               for out in result.outputs]
    shown: dict[str, Any] = {"request_id": result.request_id, "prompt_token_ids": result.prompt_token_ids,
                             "outputs": outputs}
    if result.prompt_logprobs is not None:
        shown["prompt_logprobs"] = [None if e is None else token_logprobs_json(e) for e in result.prompt_logprobs]
    return {**shown, "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "ttft_s": result.ttft_s, "tpot_s": result.tpot_s, **logprobs_fields(result)}


def labelled_outputs(result) -> str:
    """Several outputs as plain text: each under a line saying its rank, why it ended and its score."""
    lines = []
    for rank, out in enumerate(result.outputs, 1):
        score = "" if out.cumulative_logprob is None else f", cumulative logprob {out.cumulative_logprob:.3f}"
        lines.append(f"--- output {rank} of {len(result.outputs)} ({out.finish_reason or 'unfinished'}{score})")
        lines.append(out.text)
    return "\n".join(lines) + "\n"


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.client import TandemError, connect
    from tandem.client.access import command_auth
    from tandem.client.runstate import find_running_url
    from tandem.shared.infra.process import run_async

    prog = "tandem generate"
    try:
        params = sampling_params(args)
        prompt = read_prompt(args.prompt)
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    settings = settings_from(args)
    url = settings.bus.nats_url or find_running_url(settings.data_dir)
    if url is None:
        print(f"{prog}: no running tandem found; start one with `tandem up` or pass --nats-url", file=sys.stderr)
        return 2
    streamed = False  # text went out: an interrupted stream still ends its line

    async def run() -> None:
        nonlocal streamed
        async with connect(url, request_timeout_s=args.timeout, **command_auth(settings)) as client:
            if args.json:
                result = await client.complete(prompt, model=args.model, priority=args.priority, **params)
                print(json.dumps(completion_json(result)))
                return
            if args.n > 1:  # interleaved outputs cannot share one terminal line: each whole, labelled
                result = await client.complete(prompt, model=args.model, priority=args.priority, **params)
                sys.stdout.write(labelled_outputs(result))
                return
            # Closed on every way out (Ctrl-C cancels this task, a closed stdout raises): closing a
            # stream that has not finished sends its cancel, so the workers free the request at once.
            stream = client.generate(prompt, model=args.model, priority=args.priority, **params)
            async with aclosing(stream):
                async for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    streamed = True
            sys.stdout.write("\n")

    try:
        run_async(run())
    except TandemError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if streamed:
            print(flush=True)
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0


async def discover(url: str, wait_s: float, options: dict[str, Any] | None = None) -> list[dict]:
    """Every ``$SRV.INFO`` answer on the NATS server at ``url`` within ``wait_s``; ``options``:
    ``nats.connect``'s (the identity, TLS)."""

    from tandem.client.access import BusConnectError, connect_command
    from tandem.client.discovery import service_infos

    try:
        # Two tries, then NoServersError: nats-py retries an initial connect forever with
        # max_reconnect_attempts 0, and allow_reconnect=False does not stop that loop either.
        nc = await connect_command(url, options or {}, name="tandem-services", connect_timeout=3,
                                   max_reconnect_attempts=1, reconnect_time_wait=0.2)
    except BusConnectError as exc:
        raise UnreachableError(str(exc)) from None
    try:
        return await service_infos(nc, wait_s=wait_s)
    finally:
        await nc.close()


def service_rows(infos: list[dict]) -> list[dict[str, Any]]:
    """One row per service instance, sorted by service and instance id: the fields ``tandem
    services`` shows (``http_url`` None where the instance serves no HTTP API), plus its whole metadata."""
    rows = []
    for info in infos:
        meta = info.get("metadata") or {}
        pid = str(meta.get("pid", ""))
        instance = meta.get("instance_id") or info.get("id", "")
        rows.append({"service": str(info.get("name", "")), "instance": str(instance),
                     "version": str(info.get("version", "")), "host": str(meta.get("host", "")),
                     "pid": int(pid) if pid.isdigit() else None, "metrics_url": meta.get("metrics_url") or None,
                     "http_url": meta.get("http_url") or None, "id": info.get("id"), "metadata": meta})
    return sorted(rows, key=lambda r: (r["service"], r["instance"]))


def services_table(rows: list[dict[str, Any]]) -> str:
    """The rows as aligned columns; the HTTP column only when an instance serves one."""
    columns = [("SERVICE", "service"), ("INSTANCE", "instance"), ("VERSION", "version"), ("HOST", "host"),
               ("PID", "pid"), ("METRICS", "metrics_url")]
    if any(r["http_url"] for r in rows):
        columns.append(("HTTP", "http_url"))
    cells = [[title for title, _ in columns]]
    cells += [["-" if r[key] is None or r[key] == "" else str(r[key]) for _, key in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def bus_target(prog: str, args: argparse.Namespace):
    """(settings, the NATS URL) of a command that asks the bus for ``--wait`` seconds, or None after
    saying in one line what to change (a bad ``--wait``, no URL and no running ``tandem up``)."""
    from tandem.client.runstate import find_running_url

    if not args.wait > 0:
        print(f"{prog}: --wait must be > 0", file=sys.stderr)
        return None
    settings = settings_from(args)
    url = settings.bus.nats_url or find_running_url(settings.data_dir)
    if url is None:
        print(f"{prog}: no running tandem found; start one with `tandem up` or pass --nats-url", file=sys.stderr)
        return None
    return settings, url


def cmd_ping(args: argparse.Namespace) -> int:
    import asyncio
    import socket

    from tandem.client.access import BusConnectError, bus_options, command_auth, connect_command
    from tandem.shared.auth.credentials import CredentialsError
    from tandem.shared.infra.process import run_async

    prog = "tandem ping"
    target = bus_target(prog, args)
    if target is None:
        return 2
    settings, url = target
    host = args.host or socket.gethostname()

    async def answered() -> bool:
        # The operator's key under `tandem up`; in a service's container, its role's (TANDEM_NATS_CREDS).
        options = bus_options("operator", f"ping-{host}", url, **command_auth(settings))
        nc = await connect_command(url, options, name=f"tandem-ping-{host}", connect_timeout=3,
                                   max_reconnect_attempts=1, reconnect_time_wait=0.2)
        found = asyncio.Event()

        async def on_pong(msg) -> None:
            try:
                meta = json.loads(msg.data).get("metadata") or {}
            except (ValueError, AttributeError):
                return
            if meta.get("host") == host:
                found.set()

        try:
            inbox = nc.new_inbox()
            await nc.subscribe(inbox, cb=on_pong)
            await nc.publish(f"$SRV.PING.tandem-{args.service}", b"", reply=inbox)
            try:
                await asyncio.wait_for(found.wait(), args.wait)
            except TimeoutError:
                return False
            return True
        finally:
            await nc.close()

    try:
        if run_async(answered()):
            return 0
    except (BusConnectError, CredentialsError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    print(f"{prog}: no {args.service} on {host} answered $SRV.PING on {url} within {args.wait:g}s", file=sys.stderr)
    return 1


def cmd_services(args: argparse.Namespace) -> int:
    from tandem.client.access import operator_options
    from tandem.shared.auth.credentials import CredentialsError
    from tandem.shared.infra.process import run_async

    prog = "tandem services"
    target = bus_target(prog, args)
    if target is None:
        return 2
    settings, url = target
    try:
        rows = service_rows(run_async(discover(url, args.wait, operator_options(settings, "tandem-services", url))))
    except (UnreachableError, CredentialsError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=2))
    elif rows:
        print(services_table(rows))
    if not rows:
        print(f"{prog}: no service answered $SRV.INFO on {url} within {args.wait:g}s", file=sys.stderr)
        return 1
    return 0


def cmd_console(args: argparse.Namespace) -> int:
    from tandem.console.app import run_console

    settings = settings_from(args)
    # No URL: follow the running up, restarts included.
    return run_console(settings.bus.nats_url, settings.data_dir, settings)


def cmd_train(args: argparse.Namespace) -> int:
    from tandem.cli.train import cmd_train as run_train
    from tandem.shared.infra.process import setup_logging

    settings = settings_from(args)
    setup_logging(settings.log_level)
    return run_train(args, settings)


def cmd_auth(args: argparse.Namespace) -> int:
    from tandem.cli.auth_init import run_auth

    return run_auth(args)


def cmd_bundle(args: argparse.Namespace) -> int:
    from tandem.cli.bundle import run_bundle

    return run_bundle(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from tandem.cli.bench_serve import run_bench_serve

        return run_bench_serve(args, settings_from(args))
    from tandem.cli.bench import run_bench

    return run_bench(args, settings_from(args), given(args))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in ("serve", "compare", "-h", "--help")):
        argv.insert(1, "compare")  # plain `tandem bench` is the comparison it always was
    root = parser()
    args, extras = root.parse_known_args(argv)
    command = command_parser(root, args)
    if extras:  # reported by the subcommand they were given to: `tandem generate: unrecognized ...`
        command.error(f"unrecognized arguments: {' '.join(extras)}")
    logging.captureWarnings(True)
    lacking = missing_extra(args)
    if lacking:  # the base install is the client side: say which extra this command needs, not a traceback
        print(f"{command.prog}: {lacking}", file=sys.stderr)
        return 2
    handler = {"up": cmd_up, "serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench,
               "console": cmd_console, "train": cmd_train, "services": cmd_services, "auth": cmd_auth,
               "ping": cmd_ping, "bundle": cmd_bundle}[args.command]
    try:
        return handler(args)
    except SettingsError as exc:  # a bad value from a flag or a TANDEM_ variable: a usage error, as argparse's
        command.error(str(exc))
    except KeyboardInterrupt:
        print(f"{command.prog}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        # The reader left (`tandem services --json | head`): say nothing, and keep the interpreter's
        # last flush of stdout from failing again on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
