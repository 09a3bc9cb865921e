"""``benchmarks/grammar_engines.py`` runs its whole main path on the byte vocabulary at small batches:
every figure it writes is there and positive, the documents it drives the matchers through are JSON
valid for its schema, and a missing xgrammar (or llguidance) is reported, never a crash.

The xgrammar figures are checked only where xgrammar is installed; llguidance is a dependency.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest

pytestmark = pytest.mark.slow  # the whole benchmark script runs, as for every benchmark's test

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grammar_engines.py"
# Enough steps at batch 4 for rows to finish byte-level documents of a few hundred tokens.
ARGS = ["--vocab", "byte", "--batch", "1", "4", "--steps", "400", "--warmup", "20", "--repeats", "1",
        "--agree-documents", "2"]
SPECS = {"json schema", "regex"}


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("grammar_engines_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def run_main(bench: ModuleType, argv: list[str]) -> tuple[dict[str, Any], str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        returned = bench.main(argv)
    return returned, stdout.getvalue()


@pytest.fixture(scope="module")
def outcome(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], str]:
    path = tmp_path_factory.mktemp("grammar_engines") / "out.json"
    returned, printed = run_main(bench, [*ARGS, "--json", str(path)])
    return json.loads(path.read_text()), returned, printed


def rows_of(result: dict[str, Any], part: str, library: str) -> list[dict[str, Any]]:
    return [row for row in result[part] if row["library"] == library]


def check_library(result: dict[str, Any], library: str, schema: dict[str, Any]) -> None:
    compiles = rows_of(result, "compile", library)
    assert {row["spec"].split(" (")[0] for row in compiles} >= SPECS | {"grammar"}, compiles
    for row in compiles:
        assert "error" not in row, row
        for key in ("cold_ms", "cold_first_mask_ms", "again_ms", "per_request_ms", "per_request_first_mask_ms",
                    "primed_first_mask_ms"):
            assert row[key] > 0, (key, row)
    masks = {row["batch"]: row for row in rows_of(result, "mask", library)}
    assert set(masks) == {1, 4}, masks.keys()
    for batch, row in masks.items():
        for key in ("fill", "fill_each", "advance", "advance_each"):
            assert row[f"{key}_median_us"] > 0 and row[f"{key}_p90_us"] >= row[f"{key}_median_us"], (key, row)
            assert row[f"{key}_per_row_us"] == pytest.approx(row[f"{key}_median_us"] / batch), (key, row)
        assert row["fill_api"] and row["advance_api"], row
        assert row["validated_with"] == "jsonschema", row
        assert row["valid_documents"] == row["documents"] and not row["invalid"], row["invalid"]
    assert masks[4]["documents"] >= 1, f"batch 4 should finish documents in 420 steps: {masks[4]}"
    documents = [text for row in masks.values() for text in row["sample_documents"]]
    assert documents, masks
    for text in documents:
        jsonschema.validate(json.loads(text), schema)
    statuses = {row["feature"]: row[library] for row in result["support"]}
    assert statuses["json: string pattern"] == "ok" and statuses["regex"] == "ok", statuses
    assert all(status == "ok" or status.startswith(("error:", "not enforced", "rejects valid"))
               for status in statuses.values()), statuses


def test_writes_every_figure_as_json(bench: ModuleType, outcome) -> None:
    result, returned, printed = outcome
    assert result == json.loads(json.dumps(returned)), "the JSON file holds what main returned"
    assert result["vocabularies"]["byte"]["size"] == 259 and result["vocabularies"]["byte"]["eos_id"] == 257
    assert set(result["vocabularies"]) == {"byte"}, "--vocab byte builds no BPE"
    assert result["versions"]["llguidance"] and result["threads"] >= 1
    assert result["schema"] == bench.SCHEMA
    assert [row["feature"] for row in result["support"]] == [probe[0] for probe in bench.PROBES]
    for heading in ("compile (ms", "mask per step", "support (byte vocabulary"):
        assert heading in printed, f"{heading!r} missing from the printed tables:\n{printed}"


def test_llguidance_figures_and_documents(bench: ModuleType, outcome) -> None:
    result, _, _ = outcome
    check_library(result, "llguidance", bench.SCHEMA)
    setup = [entry for entry in result["tokenizer_setup"] if entry["library"] == "llguidance"]
    assert setup and setup[0]["ms"] > 0, result["tokenizer_setup"]


def test_new_matchers_per_request_walk_the_same_path(outcome) -> None:
    result, _, _ = outcome
    rows = rows_of(result, "mask", "llguidance/new")
    assert {row["batch"] for row in rows} == {1, 4}, rows
    for row in rows:
        assert row["fill_median_us"] > 0 and row["valid_documents"] == row["documents"], row
        assert row["same_path"], f"a new LLMatcher and a deep copy allow the same tokens: {row}"


def test_xgrammar_figures_and_agreement(bench: ModuleType, outcome) -> None:
    pytest.importorskip("xgrammar")
    result, _, printed = outcome
    assert result["versions"]["xgrammar"], result["versions"]
    check_library(result, "xgrammar", bench.SCHEMA)
    for row in rows_of(result, "mask", "xgrammar"):
        assert row["same_path_as"] == "llguidance" and isinstance(row["same_path"], bool), row
    (agreement,) = result["agreement"]
    assert agreement["documents"] == 2 and agreement["steps"] > 0, agreement
    assert 0 <= agreement["steps_differing"] <= agreement["steps"], agreement
    assert "mask agreement, byte vocabulary" in printed


def test_without_xgrammar_only_llguidance_is_measured(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar now raises ImportError
    result, printed = run_main(bench, ["--vocab", "byte", "--batch", "2", "--steps", "6", "--warmup", "2",
                                       "--repeats", "1"])
    assert "xgrammar: not installed" in printed, printed
    assert result["versions"]["xgrammar"] is None and result["xgrammar"] == "not installed"
    assert result["agreement"] == []
    assert {row["library"] for row in result["compile"]} == {"llguidance"}
    assert {row["library"] for row in result["mask"]} == {"llguidance", "llguidance/new"}
    assert {row["xgrammar"] for row in result["support"]} == {"not installed"}


def test_without_llguidance_one_line_tells_how_to_install(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(SystemExit) as exit_info:
        run_main(bench, ["--vocab", "byte"])
    message = str(exit_info.value)
    assert "pip install -e .[serve]" in message and "\n" not in message, message
