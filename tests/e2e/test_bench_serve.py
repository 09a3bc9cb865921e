"""``tandem bench serve`` against a running ``tandem up`` (found through its state file): the table,
the JSON result, exact output lengths, and a TTFT that agrees with the services' own histogram from
the same run. Plus the datasets and statistics, and ``tandem bench`` (compare) still working."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
from cli_support import TANDEM, running_up, tandem_env

from tandem.cli.bench_data import RequestResult, arrival_gaps, make_requests, parse_goodput, percentile, summarize

# slow: whole bench runs, about 13 s on 2 cores (bench serve against tandem up runs by default in
# test_bus_auth.py); .ci/run runs it
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    with running_up(tmp_path_factory.mktemp("bench-serve"), "--kvstore", "0") as data_dir:
        yield data_dir


def test_bench_serve_prints_the_table_and_agrees_with_the_services_ttft(up, tmp_path):
    out_file = tmp_path / "result.json"
    cmd = [*TANDEM, "bench", "serve", "--input-len", "384", "--output-len", "8", "--range-ratio", "0.25",
           "--num-prompts", "16", "--max-concurrency", "2", "--goodput", "ttft:5000", "tpot:5000",
           "--json-out", str(out_file)]
    out = subprocess.run(cmd, env=tandem_env(up), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    for line in ("Serving Benchmark Result", "Successful requests:", "Request goodput (req/s):",
                 "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):",
                 "Mean TTFT, time_to_first_token_seconds (ms):"):
        assert line in out.stdout, f"table lacks {line!r}:\n{out.stdout}"
    assert "16/16" in out.stderr, "expected a progress bar on stderr"
    result = json.loads(out_file.read_text())
    s = result["summary"]
    assert s["completed"] == 16 and s["failed"] == 0
    lengths = [r["output_len"] for r in result["requests"]]
    assert sum(lengths) == s["total_output_tokens"] and all(6 <= n <= 10 for n in lengths), lengths
    assert all(r["output_len"] == r["max_tokens"] for r in result["requests"]), "ignore_eos: exact lengths"
    assert s["good_requests"] == 16 and s["request_goodput"] == pytest.approx(16 / s["duration_s"])
    client, server = s["ttft_ms"]["mean"], s["server_ttft_mean_ms"]
    assert s["server_ttft_count"] == 16, "the histograms count exactly the measured requests (warm-ups before)"
    assert abs(client - server) <= 0.10 * client, f"client TTFT {client:.1f} ms vs services' {server:.1f} ms"
    assert server <= client, "the services' TTFT starts later (router accept) than the client's"


@pytest.mark.parametrize("backend", [[], ["--base-url", "http"]], ids=["nats", "http"])
def test_the_json_dataset_holds_every_output_to_its_schema_at_exact_lengths(up, backend, tmp_path):
    """Structured outputs under load: every request decodes its whole output_len under the schema."""
    if backend:
        backend = ["--base-url", json.loads((up / "run" / "up.json").read_text())["http_url"]]
    out_file = tmp_path / "result.json"
    cmd = [*TANDEM, "bench", "serve", "--dataset-name", "json", "--input-len", "64", "--output-len", "24",
           "--num-prompts", "8", "--max-concurrency", "4", "--json-out", str(out_file), *backend]
    out = subprocess.run(cmd, env=tandem_env(up), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out_file.read_text())
    assert result["summary"]["completed"] == 8 and result["summary"]["failed"] == 0, result["summary"]
    assert all(r["output_len"] == r["max_tokens"] == 24 for r in result["requests"]), "the schema cut an output"


def test_bench_serve_without_a_system_says_how_to_start_one(tmp_path):
    out = subprocess.run([*TANDEM, "bench", "serve"], env=tandem_env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "tandem up" in out.stderr


def test_plain_bench_is_still_the_comparison(tmp_path):
    out_file = tmp_path / "compare.json"
    out = subprocess.run([*TANDEM, "bench", "--concurrency", "2", "--requests", "4", "--input-len", "16",
                          "--output-len", "4", "--json-out", str(out_file)], env=tandem_env(tmp_path),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    levels = json.loads(out_file.read_text())
    assert levels[0][-1]["path"].startswith("bus") and levels[0][-1]["requests"] == 4


def test_datasets_are_valid_for_the_vocab_and_shaped_as_asked():
    reqs = make_requests("random", 200, 100, 10, vocab_size=259, range_ratio=0.5, seed=3)
    assert all(50 <= len(r.prompt) <= 150 and 5 <= r.output_len <= 15 for r in reqs)
    assert all(0 <= t < 259 for r in reqs for t in r.prompt)
    fixed = make_requests("random", 5, 64, 8, vocab_size=1000)
    assert [len(r.prompt) for r in fixed] == [64] * 5 and {r.output_len for r in fixed} == {8}
    shared = make_requests("prefix", 6, 100, 8, vocab_size=1000, prefix_ratio=0.75, num_prefixes=2)
    assert shared[0].prompt[:75] == shared[2].prompt[:75] != shared[1].prompt[:75]
    assert shared[0].prompt[75:] != shared[2].prompt[75:]


def test_arrivals_match_the_rate_and_burstiness():
    assert arrival_gaps(4, math.inf) == [0.0] * 4
    gaps = arrival_gaps(4001, rate=10.0, burstiness=1.0)
    assert gaps[0] == 0 and sum(gaps) / 4000 == pytest.approx(0.1, rel=0.08)
    bursty = arrival_gaps(4001, rate=10.0, burstiness=0.25)
    assert sum(bursty) / 4000 == pytest.approx(0.1, rel=0.15)
    assert percentile(bursty[1:], 50) < percentile(gaps[1:], 50), "burstier: more short gaps"


def test_goodput_counts_requests_meeting_every_slo():
    slos = parse_goodput(["ttft:100", "tpot:10"])
    results = [RequestResult(10, 5, ttft=0.05, e2e=0.05 + 4 * 0.005, itls=[0.005] * 4),  # meets both
               RequestResult(10, 5, ttft=0.2, e2e=0.2 + 4 * 0.005, itls=[0.005] * 4),  # TTFT too long
               RequestResult(10, 5, ttft=0.05, e2e=0.05 + 4 * 0.02, itls=[0.02] * 4),  # TPOT too long
               RequestResult(10, 0, ok=False, error="boom")]
    s = summarize(results, 2.0, slos)
    assert (s["completed"], s["failed"], s["good_requests"]) == (3, 1, 1) and s["request_goodput"] == 0.5
    assert s["tpot_ms"]["median"] == pytest.approx(5.0) and s["itl_ms"]["p99"] == pytest.approx(20.0)
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])
