"""README.md and docs/ checked against the repository they describe.

- every relative link (and its ``#anchor``, by GitHub's heading slugs) in README.md, docs/*.md and
  compose/**/*.md leads to a file of the repository; no page links outside it;
- README stays a page (under 260 lines) and opens with exactly the two set-up commands, the second of
  which is the test command ``.ci/run`` runs;
- every ``tandem ...`` / ``python3 -m tandem ...`` command in a shell code block of README or docs/
  parses with the real CLI parser, and every repository path they name (``benchmarks/X.py``,
  ``scripts/X``, ``shared/...``) exists, so a moved file or a renamed flag shows up here.

Shell code blocks are those fenced as ``sh``, ``bash`` or ``shell``; output is fenced as ``text``.
The Quick start's snippets themselves are run against a real ``tandem up`` by tests/e2e/test_readme.py.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]  # the pages whose commands and paths are checked
LINKED_PAGES = [*PAGES, *sorted((ROOT / "compose").rglob("*.md"))]  # the pages whose links are checked

README_MAX_LINES = 260
SETUP_COMMANDS = (
    'python3 -m pip install "torch==2.13.0" -e ".[all,test]" && python3 -m tandem up --demo',
    "python3 -m pytest -q --durations=15",
)
CI_SCRIPT = ROOT / ".ci" / "run"
SHELL_LANGUAGES = {"sh", "bash", "shell"}
# Top-level folders whose paths a page may name in code; a path under one of them must exist.
REPO_FOLDERS = ("shared", "services", "tandem", "console", "tests", "benchmarks", "scripts", "compose", "docs", ".ci")


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string, its first line's number in the file, its body."""

    language: str
    line: int
    body: str


@dataclass(frozen=True)
class Page:
    path: Path
    prose: str  # the text outside fenced code blocks, fences blanked so line numbers hold
    blocks: tuple[Block, ...]

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()


def read_page(path: Path) -> Page:
    prose: list[str] = []
    blocks: list[Block] = []
    fence: str | None = None
    language, start, body = "", 0, []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence, language, start, body = stripped[:3], stripped[3:].strip(), number + 1, []
            prose.append("")
        elif fence is not None and stripped.startswith(fence) and not stripped[3:].strip():
            blocks.append(Block(language, start, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, f"{path.relative_to(ROOT)}: a code block opened at line {start - 1} is never closed"
    return Page(path, "\n".join(prose), tuple(blocks))


def without_code_spans(text: str) -> str:
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def code_spans(text: str) -> list[str]:
    return [span for _, span in re.findall(r"(`+)((?:(?!\1).)+?)\1", text)]


# --- links ------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped but ``-`` and
    ``_``, each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", read_page(path).prose, flags=re.M):
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Page) -> list[tuple[int, str]]:
    """(line, target) of every link outside code."""
    found = []
    for number, line in enumerate(page.prose.splitlines(), start=1):
        text = without_code_spans(line)
        found += [(number, target) for target in LINK.findall(text)]
        found += [(number, target) for target in REFERENCE_LINK.findall(text)]
    return found


def link_problem(page: Page, target: str) -> str | None:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I) or target.startswith(("/", "//")):
        return "not a relative link to a file of the repository"
    path_part, _, anchor = target.partition("#")
    resolved = (page.path.parent / path_part).resolve() if path_part else page.path
    if not resolved.is_relative_to(ROOT):
        return "leads outside the repository"
    if not resolved.exists():
        return f"no such file: {resolved.relative_to(ROOT).as_posix()}"
    if anchor:
        if resolved.is_dir() or resolved.suffix != ".md":
            return "an anchor into something that is not a markdown page"
        if anchor not in anchors(resolved):
            return f"{resolved.relative_to(ROOT).as_posix()} has no heading whose anchor is #{anchor}"
    return None


@pytest.mark.parametrize("path", LINKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves_inside_the_repository(path):
    page = read_page(path)
    broken = [f"{page.name}:{line}: ({target}) {problem}" for line, target in links(page)
              if (problem := link_problem(page, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_slug_rule_is_githubs():
    assert github_slug("Admission: overload refused early") == "admission-overload-refused-early"
    assert github_slug("Several outputs per request (n, best_of, beam search)") == \
        "several-outputs-per-request-n-best_of-beam-search"
    assert github_slug("`tandem up` and the [bus](x.md)") == "tandem-up-and-the-bus"


# --- README's shape ---------------------------------------------------------------------------------

def test_readme_is_a_page():
    lines = len(README.read_text().splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_opens_with_the_two_setup_commands():
    page = read_page(README)
    assert README.read_text().splitlines()[0] == "# tandem", "README.md's first line must be '# tandem'"
    assert page.blocks, "README.md has no code block; it must open with the set-up commands' block"
    first = page.blocks[0]
    between = page.prose.splitlines()[1:first.line - 2]
    assert not any(line.strip() for line in between), \
        f"README.md: text before the set-up commands' block: {[line for line in between if line.strip()]}"
    assert tuple(first.body.splitlines()) == SETUP_COMMANDS, \
        "README.md's first code block must be exactly these two lines:\n" + "\n".join(SETUP_COMMANDS)


def test_ci_runs_the_readme_test_command():
    lines = [line.strip() for line in CI_SCRIPT.read_text().splitlines()]
    assert SETUP_COMMANDS[1] in lines, f".ci/run does not run README's test command `{SETUP_COMMANDS[1]}`"


# --- commands in shell blocks ------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str  # as shown
    argv: tuple[str, ...]  # the words after `tandem` / `python3 -m tandem`

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """Each logical line of a shell block (continuations joined) with its line number."""
    joined: list[tuple[int, str]] = []
    pending, start = "", block.line
    for offset, line in enumerate(block.body.splitlines()):
        if not pending:
            start = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append((start, pending + line))
        pending = ""
    if pending:
        joined.append((start, pending))
    return joined


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of a shell line (split at && || ; |, comments dropped,
    redirections and leading VAR=value assignments left out)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    words = iter(list(lexer))
    for word in words:
        if word in ("&&", "||", ";", "|", "&", "(", ")"):
            commands.append([])
        elif word in (">", ">>", "<", "2>", "&>"):
            next(words, None)
        elif not commands[-1] and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
            continue
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def tandem_argv(words: list[str]) -> tuple[str, ...] | None:
    if words[:1] == ["tandem"]:
        return tuple(words[1:])
    if len(words) >= 3 and re.fullmatch(r"python3?", words[0]) and words[1:3] == ["-m", "tandem"]:
        return tuple(words[3:])
    return None


def shown_commands() -> list[Command]:
    found = []
    for path in PAGES:
        page = read_page(path)
        for block in page.blocks:
            if block.language not in SHELL_LANGUAGES:
                continue
            for number, line in shell_lines(block):
                for words in simple_commands(line):
                    if (argv := tandem_argv(words)) is not None:
                        found.append(Command(page.name, number, shlex.join(words), argv))
    return found


COMMANDS = shown_commands()


def test_the_pages_show_tandem_commands():
    """The parse check below sees the commands (an empty list would pass it vacuously)."""
    assert any(c.page == "README.md" for c in COMMANDS), "no tandem command found in README.md's shell blocks"


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_shown_tandem_command_parses(command, capsys):
    from tandem.cli.main import parser  # here, so a CLI that fails to import fails only these tests

    try:
        parser().parse_args(list(command.argv))
    except SystemExit as exit_:
        if exit_.code not in (0, None):  # 0: --help or --version, which parse
            said = capsys.readouterr().err.strip()
            pytest.fail(f"{command} does not parse with tandem's CLI: {said}")


# --- repository paths --------------------------------------------------------------------------------

FOLDER_NAMES = "|".join(re.escape(folder) for folder in REPO_FOLDERS)
PATH_WORD = re.compile(rf"(?<![\w./-])((?:{FOLDER_NAMES})/[\w./*-]*)")


def named_paths(page: Page) -> list[tuple[str, str]]:
    """(where, path) for each repository path named in a code span or a code block."""
    found = []
    for number, line in enumerate(page.prose.splitlines(), start=1):
        for span in code_spans(line):
            found += [(f"{page.name}:{number}", p) for p in PATH_WORD.findall(span)]
    for block in page.blocks:
        for offset, line in enumerate(block.body.splitlines()):
            found += [(f"{page.name}:{block.line + offset}", p) for p in PATH_WORD.findall(line)]
    return [(where, path.rstrip(".:,")) for where, path in found]


def path_exists(path: str) -> bool:
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_named_repository_paths_exist(path):
    """benchmarks/X.py, scripts/X and every other path a page names in code: a moved file shows here."""
    page = read_page(path)
    missing = sorted({f"{where}: {p}" for where, p in named_paths(page) if not path_exists(p)})
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)
