"""The ``tandem`` client surface as a user meets it, in real processes against real services: the
prompt from standard input or a file, Ctrl-C in ``generate`` (one line, exit 130, the request
cancelled on the workers), ``tandem services``, ``tandem bench serve`` over NATS and over the HTTP
frontend (``--base-url``), its first failure's reason, and ``benchmarks/frontend_overhead.py``.

One system per module (router, prefill, decode on the session's nats-server) with one frontend;
the failure test has a server and a router of its own, so no worker can answer there."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import nats
import nats.errors
import pytest
from cli_support import (
    TANDEM,
    ctrl_c_reaches_it,
    launch,
    run_sync,
    service_env,
    stop_process,
    tandem_env,
    wait_for,
)

from tandem import __version__
from tandem.cli.supervisor import wait_until_ready
from tandem.client.discovery import scrape_services, service_infos
from tandem.client.runstate import find_running
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol import subjects
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.serving import Cancel

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FRONTEND = "frontend-surface"


async def frontend_url(url: str, instance: str) -> str:
    nc = await nats.connect(url)
    try:
        infos = await service_infos(nc, name="tandem-frontend")
    finally:
        await nc.close()
    return next(i["metadata"]["http_url"] for i in infos if i["metadata"]["instance_id"] == instance)


@pytest.fixture(scope="module")
def system(start_system):
    """Router, prefill, decode and a frontend; ``system.http`` is the frontend's URL."""
    system = start_system(prefill=1, decode=1)
    system.processes[FRONTEND] = launch(system.url, "frontend", FRONTEND, system.logdir, system.env,
                                        ["--http-port", "0"])
    run_sync(wait_until_ready(system.url, {"frontend": 1}, system.check_alive, 60))
    system.http = run_sync(frontend_url(system.url, FRONTEND))
    wait_for(lambda: httpx.get(f"{system.http}/v1/models", timeout=5).status_code == 200, 30, "the frontend's API")
    yield system
    if FRONTEND in system.processes:
        system.stop(FRONTEND)


@pytest.fixture(scope="module")
def lonely_router(tmp_path_factory):
    """The NATS URL of a server of its own with a router and no worker: every request gets no_workers."""
    server = NatsServer.start()
    logdir = tmp_path_factory.mktemp("lonely")
    router = launch(server.url, "router", "router-lonely", logdir, service_env(logdir), [])

    def check() -> None:
        assert router.poll() is None, (logdir / "router-lonely.log").read_text()[-2000:]

    try:
        run_sync(wait_until_ready(server.url, {"router": 1}, check, 60))
        yield server.url
    finally:
        stop_process(router, signal.SIGTERM, 20)
        server.stop()


def tandem(args: list[str], tmp_path: Path, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """``tandem ARGS`` as a user runs it, with a data dir where no tandem runs."""
    return subprocess.run([*TANDEM, *args], env=tandem_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.mark.parametrize(("args", "code", "stdout", "stderr"), [
    (["--version"], 0, f"tandem {__version__}\n", ""),
    (["generate", "--nat", "4", "x"], 2, "",
     "tandem generate: unrecognized arguments: --nat x (see tandem generate --help)\n"),
    (["generate", "--n", "3", "--best-of", "2", "x"], 2, "",
     "tandem generate: --best-of (2) must be at least --n (3)\n"),
    (["generate", "--top-p", "0", "x"], 2, "", "tandem generate: --top-p must be in (0, 1]\n"),
    (["generate", "@/no/such/prompt.txt"], 2, "",
     "tandem generate: cannot read the prompt file /no/such/prompt.txt: No such file or directory\n"),
    (["bench", "serve", "--num-prompts", "0"], 2, "", "tandem bench serve: --num-prompts must be >= 1\n"),
    (["services"], 2, "",
     "tandem services: no running tandem found; start one with `tandem up` or pass --nats-url\n"),
])
def test_command_line_answers_in_one_line(args, code, stdout, stderr, tmp_path):
    done = tandem(args, tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (code, stdout, stderr)


INTEGER = "must be a valid integer, unable to parse string as an integer"


@pytest.mark.parametrize(("args", "env", "stderr"), [
    (["serve", "decode", "--num-blocks", "-5"], {},
     "tandem serve decode: --num-blocks must be >= 0, not -5 (see tandem serve decode --help)"),
    (["serve", "router", "--metrics-port", "70000"], {},
     "tandem serve router: --metrics-port must be in [-1, 65535], not 70000 (see tandem serve router --help)"),
    (["serve", "router"], {}, "tandem serve router: --nats-url (or TANDEM_NATS_URL) is required: the NATS server "
                              "to serve on (see tandem serve router --help)"),
    (["up", "--http-port", "-3"], {}, "tandem up: --http-port must be in [0, 65535], not -3 (see tandem up --help)"),
    (["up"], {"TANDEM_HTTP_PORT": "abc"}, f"tandem up: TANDEM_HTTP_PORT {INTEGER}, not 'abc' (see tandem up --help)"),
    (["up", "--decode", "-1"], {}, "tandem up: argument --decode: must be >= 0, not -1 (see tandem up --help)"),
    (["generate", "x"], {"TANDEM_NUM_BLOCKS": "-1"},
     "tandem generate: TANDEM_NUM_BLOCKS must be >= 0, not '-1' (see tandem generate --help)"),
    (["bench", "compare", "--kv-ring-mib", "-1"], {},
     "tandem bench compare: --kv-ring-mib must be >= 0, not -1 (see tandem bench compare --help)"),
    (["bench", "--concurrency", "0"], {},
     "tandem bench compare: argument --concurrency: must be >= 1, not 0 (see tandem bench compare --help)"),
    (["train", "--steps", "0"], {}, "tandem train: --steps must be >= 1"),
    (["train", "--log-every", "0"], {},
     "tandem train: argument --log-every: must be >= 1, not 0 (see tandem train --help)"),
    (["serve", "router", "--log-level", "LOUD"], {},
     "tandem serve router: --log-level LOUD: must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL "
     "(see tandem serve router --help)"),
], ids=["serve-bound", "serve-metrics-port", "serve-no-bus", "up-bound", "up-variable", "up-count", "generate-variable",
        "bench-setting", "bench-count", "train-job", "train-flag", "log-level"])
def test_a_bad_value_exits_2_with_one_line_naming_where_it_came_from(args, env, stderr, tmp_path):
    """A usage error, whatever refuses the value (argparse, the settings, the job): exit status 2 and
    one line naming the flag, or the TANDEM_ variable the value came from; nothing starts."""
    done = subprocess.run([*TANDEM, *args], env={**tandem_env(tmp_path), **env}, capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr.splitlines(), done.stdout) == (2, [stderr], ""), done.stderr[-2000:]


@pytest.mark.parametrize("source", ["stdin", "file"])
def test_generate_takes_the_prompt_from_stdin_or_a_file(system, source, tmp_path):
    prompt = "def add(a, b):\n    return"  # the newline must survive: the prompt is read as is
    path = tmp_path / "prompt.txt"
    path.write_text(prompt)
    arg, stdin = ("-", prompt) if source == "stdin" else (f"@{path}", None)
    done = tandem(["generate", arg, "--nats-url", system.url, "--max-tokens", "4", "--temperature", "0",
                   "--ignore-eos", "--json"], tmp_path, input=stdin)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["prompt_token_ids"] == list(prompt.encode()), "the byte-level tiny model: one token per byte"
    assert len(result["token_ids"]) == 4


def test_generate_json_prints_logprobs_of_the_model(system, tiny, tmp_path):
    """``--logprobs 2 --json``: each token's logprob and its step's top 2, equal to ``log_softmax``
    of the model's own logits (the first token comes from the prefill worker, the rest from decode)."""
    import torch

    from tandem.shared.model.reference import reference_logits

    prompt = "def add(a, b):"
    done = tandem(["generate", prompt, "--nats-url", system.url, "--max-tokens", "5", "--temperature", "0",
                   "--ignore-eos", "--logprobs", "2", "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    tokens, entries = result["token_ids"], result["logprobs"]
    assert [e["token_id"] for e in entries] == tokens and len(tokens) == 5
    ids = result["prompt_token_ids"] + tokens
    expected = torch.log_softmax(reference_logits(tiny.model, ids[:-1])[len(ids) - 1 - len(tokens):], dim=-1)
    for token, entry, row in zip(tokens, entries, expected):
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        values, top_ids = row.topk(2)
        assert [t["token_id"] for t in entry["top_logprobs"]] == top_ids.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(values.tolist(), abs=1e-4)
    assert result["cumulative_logprob"] == pytest.approx(sum(e["logprob"] for e in entries))


def test_generate_json_of_one_output_has_it_in_outputs_too(system, tmp_path):
    done = tandem(["generate", "def f(x):", "--nats-url", system.url, "--max-tokens", "4", "--temperature", "0",
                   "--ignore-eos", "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    (output,) = result["outputs"]
    assert (output["text"], output["token_ids"], output["finish_reason"]) == \
        (result["text"], result["token_ids"], result["finish_reason"]), "the fields beside outputs are its own"
    assert output["logprobs"] is None and len(output["token_ids"]) == 4


@pytest.mark.parametrize("flags", [["--n", "3", "--temperature", "1", "--seed", "2"],
                                   ["--n", "2", "--best-of", "3", "--temperature", "1", "--seed", "2"],
                                   ["--beam-width", "3", "--n", "2"]], ids=["n", "best-of", "beams"])
def test_generate_json_prints_every_output_best_first(system, flags, tmp_path):
    """Waits on the engine's several outputs (n > 1 streams, held best_of and beam outputs)."""
    done = tandem(["generate", "def add(a, b):", "--nats-url", system.url, "--max-tokens", "5", "--ignore-eos",
                   "--logprobs", "1", *flags, "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    n = int(flags[flags.index("--n") + 1])
    outputs = result["outputs"]
    assert len(outputs) == n and all(len(o["token_ids"]) == 5 and o["finish_reason"] == "length" for o in outputs)
    assert all(len(o["logprobs"]) == 5 and o["cumulative_logprob"] is not None for o in outputs)
    if "--beam-width" not in flags:  # beams are ranked by their length-penalised score instead
        scores = [o["cumulative_logprob"] for o in outputs]
        assert scores == sorted(scores, reverse=True), "streamed samples: best first"
    assert result["text"] == outputs[0]["text"] and result["prompt_token_ids"] == list(b"def add(a, b):")


def test_generate_prints_several_outputs_labelled(system, tmp_path):
    """Waits on the engine's parallel sampling."""
    done = tandem(["generate", "x = ", "--nats-url", system.url, "--max-tokens", "3", "--ignore-eos", "--n", "2",
                   "--seed", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    labels = [line for line in done.stdout.splitlines() if line.startswith("--- output ")]
    assert [label.split(" (")[0] for label in labels] == ["--- output 1 of 2", "--- output 2 of 2"], done.stdout


def abort_count(url: str) -> float:
    """Requests the decode workers ended as aborted (cancelled or their client gone)."""
    async def scrape() -> float:
        nc = await nats.connect(url)
        try:
            pages = await scrape_services(nc, ("tandem-decode",))
        finally:
            await nc.close()
        return sum(v for page in pages.values() for k, v in page[0].items()
                   if k.startswith("tandem:request_success_total") and 'finished_reason="abort"' in k)

    return run_sync(scrape())


async def test_ctrl_c_in_generate_cancels_the_request(system, tmp_path):
    aborted = abort_count(system.url)
    nc = await nats.connect(system.url)
    cancels = await nc.subscribe(subjects.CANCEL_ALL)
    proc = subprocess.Popen([*TANDEM, "generate", "def f(x):", "--nats-url", system.url, "--max-tokens", "2000",
                             "--ignore-eos"], env=tandem_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=ctrl_c_reaches_it)
    try:
        # Tokens streaming from the decode worker (2000 of them take half a minute here): stop it mid-way.
        first = await asyncio.to_thread(proc.stdout.read, 32)
        assert len(first) == 32, proc.stderr.read().decode()
        proc.send_signal(signal.SIGINT)
        try:
            msg = await cancels.next_msg(timeout=10)
        except nats.errors.TimeoutError:
            state = "still running" if proc.poll() is None else f"exited {proc.returncode}"
            raise AssertionError(f"no Cancel within 10 s of SIGINT; tandem generate {state}") from None
        code = await asyncio.to_thread(proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
        await nc.close()
    rest, err = proc.communicate()
    assert code == 130, err.decode()
    assert err.decode() == "tandem generate: interrupted\n", "one line, no traceback"
    assert decode(msg.data, Cancel).request_id, "the client sent the request's cancel"
    assert rest.endswith(b"\n"), "the interrupted output still ends its line"
    wait_for(lambda: abort_count(system.url) > aborted, 10, "the decode worker to abort the request")


def test_services_lists_every_instance(system, tmp_path):
    done = tandem(["services", "--nats-url", system.url, "--json"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {r["instance"]: r for r in json.loads(done.stdout)}
    for name, proc in system.processes.items():
        assert name in rows, f"{name} missing from tandem services: {sorted(rows)}"
        row = rows[name]
        assert row["service"] == f"tandem-{name.split('-')[0]}" and row["version"] == __version__, row
        assert row["pid"] == proc.pid and row["host"], row
        assert httpx.get(row["metrics_url"], timeout=5).status_code == 200, f"{name}'s metrics_url answers"
    assert rows[FRONTEND]["http_url"] == system.http
    assert all(r["http_url"] is None for n, r in rows.items() if n != FRONTEND)

    table = tandem(["services", "--nats-url", system.url], tmp_path)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["SERVICE", "INSTANCE", "VERSION", "HOST", "PID", "METRICS", "HTTP"]
    (frontend,) = [line for line in lines if FRONTEND in line]
    assert frontend.split()[-1] == system.http


def test_services_against_no_server_is_one_line(tmp_path):
    done = tandem(["services", "--nats-url", "nats://127.0.0.1:1"], tmp_path)
    assert done.returncode == 1 and done.stderr.startswith("tandem services: cannot reach NATS at nats://127.0.0.1:1")
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.slow  # a benchmark run, as every benchmark script's test
def test_bench_serve_over_http_measures_the_frontend(system, tmp_path):
    out_file = tmp_path / "http.json"
    done = tandem(["bench", "serve", "--base-url", system.http, "--nats-url", system.url, "--input-len", "64",
                   "--output-len", "6", "--num-prompts", "8", "--max-concurrency", "2", "--no-progress",
                   "--json-out", str(out_file)], tmp_path, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("Successful requests:", "Mean TTFT (ms):", "Median ITL (ms):", "Services' own TTFT"):
        assert line in done.stdout, f"table lacks {line!r}:\n{done.stdout}"
    result = json.loads(out_file.read_text())
    s = result["summary"]
    assert (result["backend"], result["url"], s["completed"], s["failed"]) == ("http", system.http, 8, 0), s
    assert all(r["output_len"] == r["max_tokens"] == 6 for r in result["requests"]), "ignore_eos: exact lengths"
    assert s["server_ttft_count"] == 8, "the workers' histograms count exactly the measured requests"
    assert s["server_ttft_mean_ms"] <= s["ttft_ms"]["mean"], "the services' TTFT starts later than the client's"


def test_bench_serve_says_why_requests_failed(lonely_router, tmp_path):
    done = tandem(["bench", "serve", "--nats-url", lonely_router, "--num-prompts", "3", "--num-warmups", "0",
                   "--input-len", "8", "--output-len", "2", "--no-progress"], tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Failed requests:                                           3" in done.stdout, done.stdout
    last = done.stderr.splitlines()[-1]
    assert last.startswith("tandem bench serve: 3 of 3 requests failed; first failure: no_workers: "), done.stderr
    assert "Traceback" not in done.stderr


def check_overhead(stdout: str, json_out: Path, levels: list[int], n: int) -> None:
    rows = [line.split() for line in stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == levels, stdout
    result = json.loads(json_out.read_text())
    for level, row in zip(levels, result["levels"]):
        assert row["concurrency"] == level and row["requests"] == n
        nats_, http = row["nats"], row["http"]
        assert (nats_["completed"], nats_["failed"], http["completed"], http["failed"]) == (n, 0, n, 0), row
        assert nats_["total_output_tokens"] == http["total_output_tokens"] == n * 4, "the same workload on both"
        assert row["ttft_p50_diff_ms"] == pytest.approx(http["ttft_ms"]["median"] - nats_["ttft_ms"]["median"])
        assert row["throughput_ratio"] == pytest.approx(http["output_throughput"] / nats_["output_throughput"])


@pytest.mark.slow  # a benchmark script run, as every benchmark script's test
def test_frontend_overhead_benchmark_drives_both_paths(system, tmp_path):
    out_file = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "frontend_overhead.py"), "--nats-url", system.url,
                           "--base-url", system.http, "--concurrency", "1", "4", "--num-prompts", "4",
                           "--input-len", "16", "--output-len", "4", "--num-warmups", "1", "--no-progress",
                           "--json-out", str(out_file)], env=tandem_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "TTFT p50 NATS" in done.stdout and "HTTP/NATS" in done.stdout, done.stdout
    check_overhead(done.stdout, out_file, [1, 4], 4)


@pytest.mark.slow
def test_frontend_overhead_benchmark_starts_its_own_tandem_up(tmp_path):
    out_file = tmp_path / "overhead.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "frontend_overhead.py"), "--concurrency", "2",
                           "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--num-warmups", "1",
                           "--no-progress", "--json-out", str(out_file)], env=tandem_env(tmp_path),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "frontend_overhead: starting -m tandem up --http-port 0" in done.stderr, done.stderr
    check_overhead(done.stdout, out_file, [2], 4)
    assert find_running(tmp_path) is None, "the tandem up it started is stopped again"


@pytest.mark.parametrize("flags, admitted", [
    (["--regex", "[0-9]{2}-[a-z]{3}"], lambda text: re.fullmatch(r"[0-9]{2}-[a-z]{3}", text)),
    pytest.param(["--choice", "left", "--choice", "right"], lambda text: text in ("left", "right"),
                 marks=pytest.mark.slow),
    (["--json-schema", "@schema"], lambda text: json.loads(text)["n"] in range(10)),
    pytest.param(["--grammar", "@grammar"], lambda text: re.fullmatch(r"a(b|cc)d", text), marks=pytest.mark.slow),
], ids=["regex", "choice", "json-schema", "grammar"])
def test_generate_constrains_the_output(system, flags, admitted, tmp_path):
    schema, grammar = tmp_path / "schema.json", tmp_path / "grammar.gbnf"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}},
                                  "required": ["n"], "additionalProperties": False}))
    grammar.write_text('root ::= "a" ("b" | "cc") "d"')
    flags = [str({"@schema": schema, "@grammar": grammar}.get(flag, flag)) for flag in flags]
    done = tandem(["generate", "x = ", "--nats-url", system.url, "--max-tokens", "40", "--seed", "1", "--json",
                   *flags], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["finish_reason"] == "stop" and admitted(result["text"]), result


@pytest.mark.parametrize("flags, stderr", [
    (["--regex", "[a-"], "unclosed character class"),
    pytest.param(["--json-schema", "/nonexistent.json"],
                 "tandem generate: --json-schema: cannot read /nonexistent.json", marks=pytest.mark.slow),
    pytest.param(["--regex", "a", "--choice", "b"], "not allowed with argument", marks=pytest.mark.slow),
], ids=["bad regex", "missing file", "two at once"])
def test_generate_with_a_bad_structured_output_says_so_in_one_line(system, flags, stderr, tmp_path):
    done = tandem(["generate", "x", "--nats-url", system.url, *flags], tmp_path)
    assert done.returncode in (1, 2) and len(done.stderr.splitlines()) == 1 and stderr in done.stderr, done.stderr
