"""The decode step's floor in ``benchmarks/serving_gpu.py`` (each part at the larger of its HBM and
compute time) on the 8B preset's shapes with the H200's measured rates (../shared/DESIGN.md:
4,229 GB/s, 782 TFLOP/s), and its closed loop, the in-process peer of ``tandem bench serve``.

Run: ``python3 -m pytest -q tests/unit/cli/test_benchmark_floors.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tandem.shared.model.meta import load_model_meta

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "serving_gpu.py"
GBPS, TFLOPS = 4229.0, 782.0


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("serving_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llama3_8b():
    return load_model_meta("random:llama3-8b").config


@pytest.mark.parametrize(("batch", "bounds", "floor_ms"), [
    (1, ("hbm", "hbm", "hbm"), 3.56),  # the weights but the embedding table, read once
    (32, ("hbm", "hbm", "hbm"), 4.63),
    (256, ("compute", "hbm", "compute"), 13.5),  # 2 x 7.0e9 x 256 FLOP: 4.6 ms against 3.3 ms of reads
], ids=["batch1", "batch32", "batch256"])
def test_each_part_counts_at_its_slower_side(bench, llama3_8b, batch: int, bounds: tuple, floor_ms: float) -> None:
    floor = bench.step_floor(llama3_8b, batch, 1024 + 64, GBPS, TFLOPS)
    assert tuple(floor[p]["bound"] for p in ("matmuls", "attention", "lm_head")) == bounds, floor
    parts = sum(max(floor[p]["hbm_ms"], floor[p]["compute_ms"]) for p in ("matmuls", "attention", "lm_head"))
    assert floor["floor_ms"] == pytest.approx(parts, abs=2e-3)
    assert floor["floor_ms"] == pytest.approx(floor_ms, rel=0.01), floor


def test_the_corrected_floor_exceeds_the_bytes_only_one_at_batch_256(bench, llama3_8b) -> None:
    """Issue 19's bytes-only floor at batch 256 (12.4 ms, the embedding table counted as read) is
    below the compute the projections need: the corrected floor is higher."""
    cfg = llama3_8b
    kv_per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    bytes_only_ms = (16.06e9 + 256 * 1088 * kv_per_token) / (GBPS * 1e9) * 1e3
    assert bytes_only_ms == pytest.approx(12.4, rel=0.01)
    assert bench.step_floor(cfg, 256, 1088, GBPS, TFLOPS)["floor_ms"] > bytes_only_ms + 1.0


@pytest.mark.parametrize("concurrency", [1, 3])
def test_the_closed_loop_keeps_its_concurrency_and_serves_every_request(bench, concurrency: int) -> None:
    from tandem.shared.model.loader import load_model

    device = torch.device("cpu")
    loaded = load_model("random:llama-test", device=device)
    engine = bench.make_engine(loaded, device, 8, 256, True, 0.05)
    seen: list[int] = []
    step = engine.step

    def counting_step():
        seen.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return step()

    engine.step = counting_step
    prompts = bench.random_prompts(5, 20, loaded.config.vocab_size, seed=1)
    result = bench.run_closed_loop(engine, prompts, concurrency, 4, device)
    assert result["output_tokens"] == 5 * 4 and result["requests"] == 5, result
    assert max(seen) == concurrency, f"requests in the engine at each step: {seen}"
    assert result["ttft_p50_ms"] > 0 and result["tpot_p50_ms"] > 0


def test_prefill_flops_count_causal_attention_and_one_head_row_per_prompt(bench, llama3_8b) -> None:
    """The 8B preset, 256 prompts of 1,024 tokens (issue 19's prefill row): 7.0e9 weights in the
    layers at 2 FLOPs a token, causal attention over 1,024 x 1,025 / 2 positions a prompt, the LM head
    once a prompt."""
    cfg = llama3_8b
    flops = bench.prefill_flops(cfg, 256, 1024)
    layer_weights = sum(p.numel() for name, p in _layer_shapes(cfg))
    assert flops["linear"] == 2 * cfg.num_layers * layer_weights * 1024 * 256
    assert flops["attention"] == 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (1024 * 1025 // 2) * 256
    assert flops["lm_head"] == 2 * cfg.vocab_size * cfg.hidden_size * 256
    assert flops["total"] == pytest.approx(3.73e15, rel=0.01), flops  # 14.2 GFLOP a prompt token
    assert 0.015 < flops["attention"] / flops["total"] < 0.025, "attention is ~1.9% of an 8B 1K-token prefill"


def _layer_shapes(cfg):
    """One decoder layer's weights as the model builds them (meta tensors: no memory)."""
    from tandem.shared.model.llama import LlamaDecoderLayer

    with torch.device("meta"):
        layer = LlamaDecoderLayer(cfg, 0)
    return [(name, p) for name, p in layer.named_parameters() if p.dim() == 2]
