"""The GPU serving benchmarks run on CPU too (small models), so their code paths stay working.

``benchmarks/serving_gpu.py`` falls back to ``random:llama-test`` and ``benchmarks/serving_system.py``
to the tiny model behind a real ``tandem up``; ``benchmarks/kv_transfer.py`` moves CPU memory;
``benchmarks/swap_vs_recompute.py`` serves the tiny model on a small pool.
These tests check that each prints its figures.
"""

from __future__ import annotations

import json
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def figures(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


# Stands in for benchmarks/peers/hf_generate.py (tests/unit/benchmarks/test_peers.py runs the real
# one): the same command line, one row per batch at 2 tokens/s.
STAND_IN_PEER = """import argparse, json
ap = argparse.ArgumentParser()
ap.add_argument("--batches", type=int, nargs="+")
ap.add_argument("--prompt-len", type=int)
args, _ = ap.parse_known_args()
for batch in args.batches:
    print(json.dumps({"peer": "hf_generate", "batch": batch, "prompt_len": args.prompt_len, "decode_tok_s": 2.0}))
"""


@pytest.mark.slow  # a whole benchmark script run
def test_in_process_benchmark_prints_batch1_throughput_and_the_peer(tmp_path: Path) -> None:
    peer = tmp_path / "peer.py"
    peer.write_text(STAND_IN_PEER)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "serving_gpu.py"), "--hf-peer", str(peer)],
                         capture_output=True, text=True, timeout=300, check=True)
    got = figures(out.stdout)
    kinds = [(g["figure"], g.get("batch", g.get("cuda_graphs"))) for g in got]
    assert ("batch1", True) in kinds and ("throughput", 8) in kinds, f"figures printed: {kinds}"
    ours = [g for g in got if g["figure"] != "hf_generate"]
    for g in ours:
        assert g["output_tokens"] == g["requests"] * 128, f"every request gets its 128 tokens: {g}"
    batch1 = next(g for g in ours if g["figure"] == "batch1" and g["cuda_graphs"])
    throughput8 = next(g for g in ours if g["figure"] == "throughput" and g["batch"] == 8)
    peers = {(g["batch"], g["prompt_len"]): g for g in got if g["figure"] == "hf_generate"}
    assert set(peers) == {(1, 512), (4, 1024), (8, 1024)}, f"the peer at the batch1 and throughput shapes: {peers}"
    assert peers[1, 512]["tandem_batch1_over_hf"] == round(batch1["decode_tok_s"] / 2.0, 1), peers[1, 512]
    assert peers[8, 1024]["tandem_over_hf"] == round(throughput8["decode_tok_s"] / 2.0, 2), peers[8, 1024]


@pytest.mark.slow  # a whole benchmark script run
def test_a_failing_peer_is_named_in_one_line_and_tandems_rows_are_kept(tmp_path: Path) -> None:
    peer = tmp_path / "peer.py"
    peer.write_text('import sys; sys.exit("CUDA out of memory in the peer")\n')
    kept = tmp_path / "rows.json"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "serving_gpu.py"), "--parts", "batch1",
                          "--hf-peer", str(peer), "--json-out", str(kept)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0, "a failed peer must fail the run"
    assert "Traceback" not in out.stderr and "CUDA out of memory in the peer" in out.stderr, out.stderr[-2000:]
    rows = json.loads(kept.read_text())
    assert [r["cuda_graphs"] for r in rows if r["figure"] == "batch1"] == [True, False], f"rows kept: {rows}"
    (failed,) = [r for r in rows if r["figure"] == "hf_generate"]
    assert "CUDA out of memory in the peer" in failed["error"] and "\n" not in failed["error"], failed


@pytest.mark.slow  # a whole benchmark script run
def test_prefill_part_prints_a_row_per_step_budget_after_the_closed_loop() -> None:
    """``--parts throughput,closed,prefill``: the prefill part makes its own engines, after the parts
    that share one, and counts the FLOPs it achieved."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "serving_gpu.py"), "--parts", "throughput,closed,prefill",
                          "--closed", "2", "--prefill-chunks", "256", "512"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"serving_gpu.py failed:\n{out.stderr[-2000:]}"
    got = figures(out.stdout)
    assert [g["figure"] for g in got][-3:] == ["closed", "prefill", "prefill"], got
    for row, chunk in zip(got[-2:], (256, 512)):
        assert row["chunk_tokens"] == chunk and row["prompt_tok_s"] > 0 and row["achieved_tflops"] >= 0, row
        assert 0 < row["attention_share"] < 0.1, row


@pytest.mark.slow  # a whole benchmark script run
def test_system_benchmark_runs_bench_serve_against_tandem_up(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "serving_system.py"), "--concurrency", "2",
                          "--prompts-per-level", "4", "--input-len", "48", "--output-len", "6",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"serving_system.py failed:\n{out.stderr[-2000:]}"
    (system,) = [g for g in figures(out.stdout) if g["figure"] == "system"]
    assert (system["completed"], system["failed"]) == (4, 0), system
    assert system["ttft_ms"]["median"] > 0 and system["output_throughput"] > 0


def test_kv_transfer_benchmark_moves_the_bytes_both_ways() -> None:
    """The KV transfer benchmark (NATS frames vs the shared-memory ring, consumer reading from tasks)
    checks the bytes that land on both paths and prints one row per block size."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "kv_transfer.py"), "--block-kib", "64",
                          "--total-mib", "4", "--repeat", "1", "--consumer-copies", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    row = out.stdout.strip().splitlines()[-1].split("|")
    assert (row[0].strip() == "64 KiB" and float(row[1].replace(",", "")) > 0
            and float(row[2].replace(",", "")) > 0), out.stdout


@pytest.mark.slow  # a whole benchmark script run
def test_several_outputs_benchmark_prints_shared_blocks_and_the_beam_peer() -> None:
    """One n = 8 request holds the prompt's full blocks once (8 independent requests hold 8 copies);
    the beam search figure compares the engine with transformers' generate(num_beams=4)."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "several_outputs.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    blocks, beam = figures(out.stdout)
    # 100-token prompt, 16 tokens each: 6 shared full blocks, 8 copies of the partial one, 8 new ones.
    assert (blocks["one_request"]["peak_blocks"], blocks["independent_requests"]["peak_blocks"]) == (22, 64), blocks
    assert blocks["one_request"]["output_tokens"] == blocks["independent_requests"]["output_tokens"] == 8 * 16
    assert beam["figure"] == "beam" and beam["tandem"]["output_tokens"] == 12, beam
    assert beam["tandem_over_transformers"] > 0


@pytest.mark.slow  # a whole benchmark script run
def test_swap_vs_recompute_benchmark_preempts_both_ways() -> None:
    """The same workload on a pool too small for it, preempting by swap and by recompute: the same
    tokens either way, each run's preemptions of its own kind, and the throughput ratio."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "swap_vs_recompute.py"), "--modes", "swap,recompute",
                          "--requests", "8", "--prompt-len", "32", "--output-len", "64"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {g["figure"]: g for g in figures(out.stdout)}
    swap, recompute, both = got["swap"], got["recompute"], got["swap_vs_recompute"]
    assert swap["output_tokens"] == recompute["output_tokens"] == 8 * 64
    assert swap["swaps"] == swap["preemptions"] > 0 and swap["recomputes"] == 0, swap
    assert recompute["recomputes"] == recompute["preemptions"] > 0 and recompute["swaps"] == 0, recompute
    assert both["same_tokens"] == "8/8" and both["swap_over_recompute"] > 0, both


@pytest.mark.slow  # a whole benchmark script run, with a follower process per size
def test_tensor_parallel_benchmark_prints_each_size_against_one_rank() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "tensor_parallel.py"), "--batches", "1", "4",
                          "--new-tokens", "12", "--check-tokens", "8"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = figures(out.stdout)
    rows = {(r["size"], r["batch"]): r for r in printed if r["figure"] == "tensor_parallel"}
    assert set(rows) == {(1, 1), (1, 4), (2, 1), (2, 4)}, rows
    assert all(r["greedy_same_as_one_rank"] and r["decode_tok_s"] > 0 for r in rows.values()), rows
    assert rows[(2, 1)]["over_one_rank"] > 0
    (channel,) = [r for r in printed if r["figure"] == "tp_commands"]
    assert channel["shared_memory_us"] > 0 and channel["gloo_us"] > 0, channel


@pytest.mark.slow  # a whole benchmark script run
def test_prefill_profile_splits_a_step_into_kernel_families_and_host_phases() -> None:
    """``decode_profile.py --prefill-kernels`` on the CPU: the step's ops by family (matmuls and the
    prefill attention among them, each rate against its FLOPs), and the host's phases nested as the
    engine calls them (``launch`` holds ``prepare``, ``postprocess`` holds the wait)."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / "decode_profile.py"), "--prefill-kernels", "--batch", "4",
                          "--chunk", "512"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"decode_profile.py failed:\n{out.stderr[-2000:]}"
    (row,) = [g for g in figures(out.stdout) if g["figure"] == "prefill_kernels"]
    assert row["prompts"] == 4 and row["chunk_tokens"] == 512 and row["steps"] >= 8, row  # 4 x 1,024 tokens
    assert {"matmuls", "prefill_attention"} <= set(row["families_ms"]), row["families_ms"]
    assert row["matmuls_tflops"] >= 0 and row["prefill_attention_tflops"] >= 0, row  # 0.1 TFLOP/s or less here
    phases = row["host_phases_ms"]
    assert phases["launch"] >= phases["prepare"] > 0 and phases["postprocess"] >= phases["wait"], phases
    assert abs(row["host_wait_ms"] + row["host_work_ms"] - row["step_ms"]) < 0.01, row
    assert "the host's side of the same steps" in out.stdout, out.stdout[-2000:]


@pytest.mark.slow  # a whole benchmark script run
def test_eager_host_profile_is_written_where_asked(tmp_path: Path) -> None:
    """``decode_profile.py --eager --pstats-out``: the host's profile of decode steps without graphs,
    printed by own time and kept in pstats form, the engine's step among its entries."""

    kept = tmp_path / "eager.prof"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "decode_profile.py"), "--batch", "2", "--steps", "3",
                          "--eager", "--pstats-out", str(kept)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"decode_profile.py failed:\n{out.stderr[-2000:]}"
    assert "batch 2, eager:" in out.stdout and "ms per decode step" in out.stdout, out.stdout[:1000]
    stats = pstats.Stats(str(kept))
    steps = [key for key in stats.stats if key[2] == "step" and key[0].endswith("engine.py")]
    assert steps and stats.stats[steps[0]][1] == 3, f"engine.step called 3 times in the profile: {steps}"


@pytest.mark.slow  # a whole benchmark script run
def test_structured_decoding_benchmark_prints_both_tpots_and_the_compile(tmp_path: Path) -> None:
    out_file = tmp_path / "structured.json"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "structured_decoding.py"), "--batches", "1", "4",
                          "--max-tokens", "16", "--json-out", str(out_file)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = {(r["figure"], r.get("batch")): r for r in json.loads(out_file.read_text())}
    compile_figure = figures[("compile", None)]
    assert compile_figure["schema_cold_ms"] > compile_figure["schema_cached_ms"] > 0
    for batch in (1, 4):
        tpot = figures[("tpot", batch)]
        assert tpot["free_tpot_ms"] > 0 and tpot["constrained_tpot_ms"] > 0 and tpot["ratio"] > 0, tpot
        assert tpot["host_mask_fill_ms"] > 0, "the constrained run filled no mask"


@pytest.mark.slow  # a whole benchmark script run
def test_lora_serving_benchmark_prints_decode_prefill_and_load(tmp_path: Path) -> None:
    out_file = tmp_path / "lora.json"
    out = subprocess.run([sys.executable, str(BENCHMARKS / "lora_serving.py"), "--batch", "2", "--adapters", "2",
                          "--rank", "8", "--max-tokens", "12", "--prefill-prompts", "2", "--prefill-len", "32",
                          "--json-out", str(out_file)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = {r["figure"]: r for r in json.loads(out_file.read_text())}
    decode = figures["decode"]
    assert set(decode["tpot_ms"]) == {"baseline", "slots_no_adapter_rows", "adapters"}, decode
    assert all(ms > 0 for ms in decode["tpot_ms"].values()) and decode["adapters_vs_baseline"] > 0, decode
    assert all(ms > 0 for ms in figures["prefill"]["ms"].values()), figures["prefill"]
    assert figures["load"]["adapter_mib"] > 0 and figures["load"]["read_ms"] > 0, figures["load"]
