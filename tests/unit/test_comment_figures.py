"""Library comments and docstrings name no GPU model, issue number or date.

A comment that says "fastest on an H100 (issue 19, 2026-12-06)" is true of one machine on one day
and goes stale the moment the code or the hardware moves on; the reason behind the choice is what
a reader needs, with the benchmark script that measures it where that helps. Every ``.py`` of the
library (shared/, services/, console/, and tandem/ itself: client/, cli/ and its top-level modules;
tandem/'s symlinks to the other three are not followed, so nothing is read twice) is read with
``tokenize``: its COMMENT tokens, and the string tokens that ``ast`` finds standing alone as a
statement (module, class and function docstrings and the attribute docstrings beside them).

Figures with units (GB/s, ms) are not banned here: a why-comment legitimately says "12 bytes a
parameter" or "a few KiB". The machine, the issue and the date are what never belong.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY_ROOTS = ("shared", "services", "console", "tandem")

RULES = {
    "GPU model": re.compile(r"\b(?:H100|H200|A100|A10G|L4)\b|\bRTX\b"),
    "issue number": re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    "date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
}

# Matches that are values, not citations: (file, the matched text) -> why it stays. The test fails
# when one no longer matches, so the list cannot go stale.
ALLOWED = {
    ("console/demo.py", "2026-01-01"): "the demo clock's fixed epoch seconds, spelled out as a date",
    ("tandem/cli/bundle.py", "1980-01-01"): "zip's earliest timestamp, the fallback date of a bundle",
}


@dataclass(frozen=True)
class Hit:
    path: Path
    line: int
    rule: str
    text: str
    matched: str

    @property
    def key(self) -> tuple[str, str]:
        return self.path.relative_to(REPO).as_posix(), self.matched

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}: {self.rule}: {self.text.strip()}"


def library_files(root: Path) -> Iterator[Path]:
    """The ``.py`` files under ``root``, not following symlinked directories (tandem/shared and the like)."""
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = Path(folder) / name
            if name.endswith(".py") and not path.is_symlink():
                yield path


def docstring_starts(tree: ast.AST) -> set[int]:
    """Start lines of every string literal that stands alone as a statement."""
    return {node.value.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}


def prose(source: str) -> Iterator[tuple[int, str]]:
    """``(line, text)`` of each comment and each line of each docstring in ``source``."""
    starts = docstring_starts(ast.parse(source))
    previous = None  # a docstring is the first token of its statement: after a newline or an indent
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif (token.type == tokenize.STRING and token.start[0] in starts
              and previous in (None, tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)):
            for offset, line in enumerate(token.string.splitlines()):
                yield token.start[0] + offset, line
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type


def hits_in(path: Path) -> list[Hit]:
    found = []
    for line, text in prose(path.read_text(encoding="utf-8")):
        for rule, pattern in RULES.items():
            found.extend(Hit(path, line, rule, text, match.group()) for match in pattern.finditer(text))
    return found


@pytest.mark.parametrize("root", LIBRARY_ROOTS)
def test_library_prose_names_no_gpu_issue_or_date(root: str) -> None:
    files = list(library_files(REPO / root))
    assert files, f"no .py files under {root}/"
    hits = [hit for path in files for hit in hits_in(path) if hit.key not in ALLOWED]
    assert not hits, (
        "comments and docstrings should say why, not on which GPU, in which issue or on which date "
        "(point at the benchmark script instead):\n" + "\n".join(str(hit) for hit in hits))


@pytest.mark.parametrize(("path", "matched"), sorted(ALLOWED))
def test_allowed_matches_still_exist(path: str, matched: str) -> None:
    keys = {hit.key for hit in hits_in(REPO / path)}
    assert (path, matched) in keys, f"{path} no longer says {matched!r}: drop it from ALLOWED"


def test_tandem_walk_skips_the_symlinked_packages() -> None:
    walked = {path.relative_to(REPO / "tandem").parts[0] for path in library_files(REPO / "tandem")}
    assert not walked & {"shared", "services", "console"}, f"tandem/ walk followed a symlink: {sorted(walked)}"
    assert {"client", "cli"} <= walked, f"tandem/ walk missed a package: {sorted(walked)}"


SAMPLE = '''"""Module doc: tuned on an H100."""
x = 1  # issue 19 says so
s = "H200 in a plain string is data, not prose"


def f() -> None:
    """Measured 2026-12-06.

    Second line on an A100."""
    return None


class C:
    value = 3
    """Attribute doc: no figures here."""
'''


def test_prose_finds_comments_and_docstrings_but_not_strings(tmp_path: Path) -> None:
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    found = {(hit.line, hit.rule) for hit in hits_in(path)}
    assert found == {(1, "GPU model"), (2, "issue number"), (7, "date"), (9, "GPU model")}, found


@pytest.mark.parametrize(("text", "rule"), [
    ("# fastest on an H100", "GPU model"),
    ("# an RTX 4090 too", "GPU model"),
    ("# see Issue #20", "issue number"),
    ("# issues 19 and 20", "issue number"),
    ("# 2026-11-30", "date"),
])
def test_rules_match(text: str, rule: str) -> None:
    assert RULES[rule].search(text), f"{rule} rule misses {text!r}"


@pytest.mark.parametrize("text", [
    "# the L40S is not named here; H1000 neither",
    "# layer L4x and h100 as a kind name (nvidia-h100-x1)",
    "# this issue is known",
    "# version 2026-13-40 is no date",
    "# 12 bytes a parameter at 55 GB/s",
])
def test_rules_leave_alone(text: str) -> None:
    matched = [rule for rule, pattern in RULES.items() if pattern.search(text)]
    assert not matched, f"{text!r} matched {matched}"
