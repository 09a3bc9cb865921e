"""The multi-LoRA Triton kernels (``shared/lora/triton_bgmv.py``) on CPU, under Triton's interpreter,
against the torch references in ``shared/lora/ops.py``: ``add_bgmv`` (both ways, ``rows`` and
``grouped``) against ``add_gathered`` and ``add_sgmv`` against ``add_segmented``, in float32 within 1e-5.

The cases bring what the kernels must get right: rows and runs of slot -1 (left exactly as they
were), rows no run covers, an empty run, several targets whose column blocks straddle a boundary,
ranks 8 (padded to 16 for ``tl.dot``) and 16 (and 32, 64 and a padded 12 among the slow cases), one
row and 37, runs longer than a row tile, and the ``in`` dimension split across programs (a batch of
one row) with a ragged last split (partial sums in planes for ``rows``, atomic adds for the others).

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported (the interpreter swaps the
language's own jitted helpers at import), and other tests of this session import it first; so the
cases run in one child interpreter (this file run as a script), which prints each case's errors as
JSON, and the tests here check them. bf16 and CUDA graphs: tests/gpu/test_lora_kernels_gpu.py (the
interpreter multiplies bf16 ``tl.dot`` operands as their raw bits, so bf16 is checked there only).

Run: ``python -m pytest -q tests/unit/lora/test_lora_kernels_interpret.py`` (``-m slow`` for more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tandem.shared.lora import triton_bgmv

HERE = Path(__file__).resolve()
TOLERANCE = 1e-5  # absolute and relative, float32
SLOTS = 3

# (out_sizes, in_features) of a group: three targets straddling column blocks, two, one.
GROUPS = {"qkv": ((40, 36, 20), 600), "gate_up": ((48, 48), 200), "o": ((72,), 64)}

# method (add_bgmv's "rows" or "grouped", or add_sgmv), group, rank, layout: row slot patterns for
# add_bgmv, runs for add_sgmv.
FAST = [
    ("rows", "qkv", 8, "one"), ("rows", "qkv", 16, "one"), ("rows", "qkv", 8, "mixed37"),
    ("rows", "qkv", 16, "mixed37"), ("rows", "o", 8, "none1"), ("rows", "gate_up", 16, "mixed37"),
    ("grouped", "qkv", 8, "one"), ("grouped", "qkv", 16, "one"), ("grouped", "qkv", 8, "mixed37"),
    ("grouped", "qkv", 16, "mixed37"), ("grouped", "gate_up", 16, "mixed100"), ("grouped", "o", 8, "none1"),
    ("sgmv", "qkv", 8, "one"), ("sgmv", "qkv", 16, "one"), ("sgmv", "qkv", 8, "runs37"),
    ("sgmv", "qkv", 16, "runs37"), ("sgmv", "gate_up", 16, "runs100"),
]
SLOW = [
    ("rows", "qkv", 32, "mixed37"), ("rows", "qkv", 64, "mixed37"), ("rows", "gate_up", 8, "one"),
    ("rows", "o", 16, "mixed37"), ("rows", "qkv", 16, "mixed100"),
    ("grouped", "qkv", 32, "mixed37"), ("grouped", "qkv", 64, "mixed100"), ("grouped", "o", 16, "mixed37"),
    ("grouped", "gate_up", 8, "one"),
    ("sgmv", "qkv", 32, "runs37"), ("sgmv", "qkv", 64, "runs100"), ("sgmv", "o", 8, "runs37"),
    ("sgmv", "gate_up", 8, "runs100_known"),
    ("rows", "qkv", 12, "mixed37"), ("grouped", "qkv", 12, "mixed37"), ("sgmv", "gate_up", 12, "runs37"),  # R masked
]

RUNS = {  # (slot, start, end) with -1 runs and an empty run; rows no run names are left alone
    "one": [(1, 0, 1)],
    "runs37": [(1, 0, 5), (0, 5, 6), (-1, 6, 9), (2, 9, 30), (0, 30, 30), (1, 30, 35)],
    "runs100": [(0, 0, 70), (-1, 70, 71), (2, 71, 100)],
    "runs100_known": [(0, 0, 70), (-1, 70, 71), (2, 71, 100)],
}


def _row_slots(layout: str, generator: torch.Generator) -> list[int]:
    if layout == "one":
        return [2]
    if layout == "none1":
        return [-1]
    tokens = int(layout.removeprefix("mixed"))
    slots = torch.randint(-1, SLOTS, (tokens,), generator=generator).tolist()
    slots[:4] = [-1, 0, 0, 2]  # a -1 row and neighbours sharing a slot, whatever the draw
    return slots


def _run_case(method: str, group_name: str, rank: int, layout: str) -> dict:
    """In the child: one case's kernel output against its reference."""
    from tandem.shared.lora import ops
    from tandem.shared.lora.groups import LoraGroup

    sizes, in_features = GROUPS[group_name]
    group = LoraGroup(group_name, tuple(f"t{i}" for i in range(len(sizes))), in_features, sizes)
    generator = torch.Generator().manual_seed(zlib.crc32(repr((method, group_name, rank, layout)).encode()))
    n = len(sizes)
    a = torch.randn(SLOTS, n * rank, in_features, generator=generator) / in_features ** 0.5
    b = torch.randn(SLOTS, group.out_features, rank, generator=generator) / rank ** 0.5
    if method != "sgmv":
        slots = _row_slots(layout, generator)
        tokens = len(slots)
        untouched = [row for row, slot in enumerate(slots) if slot < 0]
    else:
        runs = RUNS[layout]
        tokens = 1 if layout == "one" else int(layout.removeprefix("runs").removesuffix("_known"))
        covered = {row for slot, start, end in runs if slot >= 0 for row in range(start, end)}
        untouched = [row for row in range(tokens) if row not in covered]
    x = torch.randn(tokens, in_features, generator=generator)
    before = torch.randn(tokens, group.out_features, generator=generator)
    out, reference = before.clone(), before.clone()
    if method != "sgmv":
        token_slots = torch.tensor(slots, dtype=torch.long)
        triton_bgmv.add_bgmv(out, x, a, b, group, rank, token_slots, method=method)
        ops.add_gathered(reference, x, a, b, group, rank, token_slots)
    else:
        starts = torch.tensor([start for _, start, _ in runs] + [runs[-1][2]], dtype=torch.int32)
        run_slots = torch.tensor([slot for slot, _, _ in runs], dtype=torch.int64)
        longest = max(end - start for _, start, end in runs) if layout.endswith("_known") else None
        triton_bgmv.add_sgmv(out, x, a, b, group, rank, starts, run_slots, max_segment_rows=longest)
        ops.add_segmented(reference, x, a, b, group, rank, [run for run in runs if run[0] >= 0])
    error = (out - reference).abs()
    return {"max_error": error.max().item(), "max_reference": reference.abs().max().item(),
            "excess": (error - TOLERANCE * (1 + reference.abs())).max().item(),
            "changed": (reference - before).abs().max().item(),
            "untouched_equal": bool(torch.equal(out[untouched], before[untouched])),
            "supports": triton_bgmv.supports(x)}


def _child_results(cases: list[tuple]) -> dict[tuple, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(HERE), json.dumps(cases)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"the interpreted cases failed:\n{done.stdout}\n{done.stderr}"
    return {tuple(case): result for case, result in json.loads(done.stdout.strip().splitlines()[-1])}


needs_triton = pytest.mark.skipif(not triton_bgmv.HAS_TRITON, reason="Triton is not installed")


@pytest.fixture(scope="module")
def fast_results() -> dict[tuple, dict]:
    return _child_results(FAST)


@pytest.fixture(scope="module")
def slow_results() -> dict[tuple, dict]:
    return _child_results(SLOW)


def check(case: tuple, result: dict) -> None:
    assert result["supports"], "supports() is False for a CPU tensor under the interpreter"
    assert result["excess"] <= 0, (f"{case}: max |kernel - reference| {result['max_error']:.3g} over "
                                   f"{TOLERANCE} (reference up to {result['max_reference']:.3g})")
    assert result["untouched_equal"], f"{case}: a row with no adapter (slot -1 or outside every run) changed"
    if case[3] != "none1":
        assert result["changed"] > 0.01, f"{case}: the reference added nothing; the case checks nothing"


@needs_triton
@pytest.mark.slow  # a Triton interpreter subprocess, ~6 s on 2 cores; the GPU run tests the kernels compiled
@pytest.mark.parametrize("case", FAST, ids=["-".join(map(str, case)) for case in FAST])
def test_kernel_matches_reference(case: tuple, fast_results: dict[tuple, dict]) -> None:
    check(case, fast_results[case])


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=["-".join(map(str, case)) for case in SLOW])
def test_kernel_matches_reference_more_shapes(case: tuple, slow_results: dict[tuple, dict]) -> None:
    check(case, slow_results[case])


def test_supports_only_cuda_or_the_interpreter() -> None:
    assert triton_bgmv.supports(torch.zeros(1)) == triton_bgmv.INTERPRETED


def test_tile_rules() -> None:
    """The split of ``in``: whole tiles, ragged last split, none when the rows already fill the GPU."""
    assert triton_bgmv._split_k(4096, 3, 528, 128) == (32, 128)  # one row of q/k/v spreads over 96 programs
    assert triton_bgmv._split_k(4096, 768, 528, 128) == (1, 4096)  # 256 rows need no split
    splits, per_split = triton_bgmv._split_k(600, 3, 8, 128)
    assert (splits, per_split) == (3, 256) and (splits - 1) * per_split < 600 <= splits * per_split
    splits, per_split = triton_bgmv._split_k(14336, 1, 10_000, 128)  # down's one row: capped, whole tiles
    assert splits <= triton_bgmv.MAX_SPLITS and per_split % 128 == 0 and (splits - 1) * per_split < 14336


def test_shape_errors_are_reported() -> None:
    from tandem.shared.lora.groups import LoraGroup

    group = LoraGroup("qkv", ("q", "k", "v"), 8, (4, 2, 2))
    x, out = torch.zeros(2, 8), torch.zeros(2, 8)
    with pytest.raises(ValueError, match="a is"):
        triton_bgmv.add_bgmv(out, x, torch.zeros(1, 8, 8), torch.zeros(1, 8, 4), group, 4, torch.zeros(2))
    with pytest.raises(ValueError, match="b is"):
        triton_bgmv.add_bgmv(out, x, torch.zeros(1, 12, 8), torch.zeros(1, 8, 8), group, 4, torch.zeros(2))
    with pytest.raises(ValueError, match="seg_starts"):
        triton_bgmv.add_sgmv(out, x, torch.zeros(1, 12, 8), torch.zeros(1, 8, 4), group, 4, torch.zeros(2),
                             torch.zeros(2))
    with pytest.raises(ValueError, match="method"):
        triton_bgmv.add_bgmv(out, x, torch.zeros(1, 12, 8), torch.zeros(1, 8, 4), group, 4, torch.zeros(2),
                             method="fast")
    five = LoraGroup("five", tuple("abcde"), 8, (2, 2, 2, 1, 1))
    with pytest.raises(ValueError, match="targets"):
        triton_bgmv.add_bgmv(out, x, torch.zeros(1, 5, 8), torch.zeros(1, 8, 1), five, 1, torch.zeros(2))


@needs_triton
@pytest.mark.slow  # the whole benchmark script runs, as for every benchmark's test
def test_benchmark_runs_its_quick_configuration() -> None:
    """``benchmarks/lora_kernels.py --quick`` on the CPU: every path's figure for every group, and the
    layer's sums."""
    script = HERE.parents[3] / "benchmarks" / "lora_kernels.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--batches", "1", "4", "--repeats", "1"],
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    groups = [r for r in records if r["figure"] == "group"]
    expected = {(batch, group) for batch in (1, 4) for group in ("qkv", "o", "gate_up", "down")}
    assert {(r["batch"], r["group"]) for r in groups} == expected
    for record in groups + [r for r in records if r["figure"] == "layer"]:
        for path in ("base", "bgmv_rows", "bgmv_grouped", "bgmv_auto", "sgmv", "gathered"):
            assert record[f"{path}_us"] > 0, f"{path} missing from {record}"


if __name__ == "__main__":  # the child: TRITON_INTERPRET=1 in its environment
    assert triton_bgmv.INTERPRETED, "run with TRITON_INTERPRET=1 set"
    wanted = [tuple(case) for case in json.loads(sys.argv[1])]
    print(json.dumps([[case, _run_case(*case)] for case in wanted]))
