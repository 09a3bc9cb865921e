"""The console's own widgets: a KV block grid and a stream timeline, plus the text helpers they share.

Each widget holds plain data (a :class:`BlockSnapshot`, timeline ops) and draws it with Rich text
sized to the space it has; the drawing functions are pure, so the same data always gives the same
picture (the snapshot tests rely on that).
"""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tandem.shared.protocol.training import TimelineOp
from tandem.shared.protocol.views import BlockSnapshot, KVTransferEvent

# state byte -> (glyph, style, label); see BlockSnapshot
SHARED = 3
BLOCK_STYLES = {0: ("·", "grey42", "free"), 1: ("█", "green", "in use"), 2: ("▒", "dodger_blue2", "cached"),
                SHARED: ("█", "magenta", "shared")}
SELECTED = ("█", "bold yellow", "selected sequence")
PRIORITY = (3, 1, 2, 0)  # which state a cell standing for several blocks shows
LANE_STYLES = {"compute": "green", "h2d": "dodger_blue2", "d2h": "red", "optimizer": "magenta",
               "ring": "yellow", "nats": "cyan", "store": "dodger_blue2"}
PHASE_GLYPHS = {"fwd": "█", "bwd": "▓", "recompute": "▒", "opt": "░"}
LABEL = 10


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def bar(fraction: float, width: int = 20, style: str = "green") -> Text:
    """A horizontal gauge, ``fraction`` in 0..1."""
    filled = max(0, min(width, round(fraction * width)))
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "grey30"))


def ref_glyph(ref_count: int) -> str:
    """A shared block's cell: how many block tables hold it, 2-9, or + for more."""
    return str(ref_count) if ref_count < 10 else "+"


def ref_count(snapshot: BlockSnapshot, block: int) -> int:
    """``block``'s ref count as the worker sent it; 2 (shared) or 1 from a worker that sends none."""
    if len(snapshot.ref_counts) > block:
        return snapshot.ref_counts[block]
    return 2 if snapshot.states[block] == SHARED else int(snapshot.states[block] == 1)


def block_grid(snapshot: BlockSnapshot, width: int, height: int, highlight: frozenset[int] = frozenset()) -> Text:
    """The pool as rows of cells; when it does not fit, one cell stands for several blocks and
    shows the most telling state among them (shared, in use, cached, free). A shared cell shows
    its ref count (the highest among its blocks), so a block every sample of a request shares
    stands out from one two prompts share."""
    width, rows = max(1, width), max(1, height)
    per_cell = max(1, -(-snapshot.num_blocks // (width * rows)))
    text = Text(no_wrap=True)
    cells = -(-snapshot.num_blocks // per_cell)
    for cell in range(cells):
        group = range(cell * per_cell, min(snapshot.num_blocks, (cell + 1) * per_cell))
        if any(b in highlight for b in group):
            glyph, style, _ = SELECTED
        else:
            state = min((snapshot.states[b] for b in group), key=PRIORITY.index)
            glyph, style, _ = BLOCK_STYLES.get(state, ("?", "red", "?"))
            if state == SHARED and snapshot.ref_counts:
                glyph = ref_glyph(max(ref_count(snapshot, b) for b in group if snapshot.states[b] == SHARED))
        text.append(glyph, style)
        if (cell + 1) % width == 0 and cell + 1 < cells:
            text.append("\n")
    return text


def packed(entries: list[Text], width: int, gap: str = "  ") -> Text:
    """``entries`` on as few lines of ``width`` as they fit, never one split across two."""
    text, used = Text(), 0
    for entry in entries:
        if used and used + len(gap) + len(entry) > width:
            text.append("\n")
            used = 0
        elif used:
            text.append(gap)
            used += len(gap)
        text.append_text(entry)
        used += len(entry)
    return text


def block_legend(snapshot: BlockSnapshot, width: int, height: int) -> Text:
    counts = {s: snapshot.states.count(s) for s in BLOCK_STYLES}
    entries = []
    for state, (glyph, style, label) in BLOCK_STYLES.items():
        if state == SHARED and snapshot.ref_counts:
            glyph = ref_glyph(2)
        entries.append(Text.assemble((glyph, style), f" {label} {counts[state]}"))
        if state == SHARED and snapshot.ref_counts:
            entries.append(Text("(digit: tables holding it)", "grey50"))
    entries.append(Text.assemble((SELECTED[0], SELECTED[1]), " selected"))
    entries.append(Text(f"copied on write {snapshot.cow_copies}"))
    per_cell = max(1, -(-snapshot.num_blocks // (max(1, width) * max(1, height))))
    if per_cell > 1:
        entries.append(Text(f"(1 cell = {per_cell} blocks)"))
    return packed(entries, width)


class BlockGrid(Widget):
    """One cell per physical KV block, coloured by state; the chosen sequence's blocks in yellow."""

    snapshot: reactive[BlockSnapshot | None] = reactive(None)
    highlight: reactive[frozenset[int]] = reactive(frozenset())

    def render(self) -> Text:
        if self.snapshot is None:
            return Text("no block snapshot yet", style="italic grey50")
        width, height = self.size.width, self.size.height
        # The legend takes the lines it needs below a blank one; the grid the rest.
        legend_lines = len(block_legend(self.snapshot, width, max(1, height - 2)).plain.splitlines())
        rows = max(1, height - 1 - legend_lines)
        grid = block_grid(self.snapshot, width, rows, self.highlight)
        return Text("\n").join([grid, Text(""), block_legend(self.snapshot, width, rows)])


def hidden_fraction(ops: list[TimelineOp]) -> float | None:
    """Of the host<->device transfer time, the part that overlaps some compute."""
    compute = sorted((o.start_s, o.end_s) for o in ops if o.lane == "compute")
    moves = [o for o in ops if o.lane in ("h2d", "d2h")]
    total = sum(o.end_s - o.start_s for o in moves)
    if total <= 0:
        return None
    hidden = sum(max(0.0, min(o.end_s, c1) - max(o.start_s, c0)) for o in moves for c0, c1 in compute)
    return min(1.0, hidden / total)


def lanes(spans: dict[str, list[tuple[float, float, str]]], t0: float, t1: float, width: int, unit: str) -> Text:
    """One row per lane: a cell is drawn when a span overlaps its slice of ``[t0, t1]``; a ruler below."""
    track = max(10, width - LABEL)
    step = (t1 - t0) / track if t1 > t0 else 1.0
    text = Text(no_wrap=True)
    for lane, items in spans.items():
        text.append(f"{lane:<{LABEL - 1}} ", "bold")
        row = [" "] * track
        for start, end, glyph in items:
            first, last = int((start - t0) / step), int((end - t0) / step - 1e-9)
            for cell in range(max(0, first), min(track - 1, last) + 1):
                row[cell] = glyph
        text.append("".join(row), LANE_STYLES.get(lane, "white")).append("\n")
    left, right = _fmt_time(t0, unit), _fmt_time(t1, unit)
    text.append(" " * LABEL + left + right.rjust(track - len(left)), "grey50")
    return text


def _fmt_time(seconds: float, unit: str) -> str:
    return f"{seconds * 1e3:.1f} ms" if unit == "ms" else f"{seconds:+.2f} s"


class Timeline(Widget):
    """Lanes of a training step (compute, h2d, d2h, optimizer) and of KV transfers (ring, nats,
    store), zoomed in ``zoom`` times and panned to ``offset`` (0..1 of the time range)."""

    ops: reactive[list[TimelineOp]] = reactive(list, always_update=True)
    transfers: reactive[list[KVTransferEvent]] = reactive(list, always_update=True)
    zoom: reactive[float] = reactive(1.0)
    offset: reactive[float] = reactive(0.0)

    def view(self, t0: float, t1: float) -> tuple[float, float]:
        span = (t1 - t0) / self.zoom
        start = t0 + min(self.offset, 1 - 1 / self.zoom) * (t1 - t0)
        return start, start + span

    def render(self) -> Text:
        text = Text(no_wrap=True)
        width = self.size.width
        if self.ops:
            spans: dict[str, list] = {lane: [] for lane in ("compute", "h2d", "d2h", "optimizer")}
            for op in self.ops:
                spans.setdefault(op.lane, []).append((op.start_s, op.end_s, PHASE_GLYPHS.get(op.phase, "█")))
            t0, t1 = self.view(0.0, max(op.end_s for op in self.ops))
            text.append("training step ", "bold underline").append(
                "█ fwd  ▓ bwd  ▒ recompute  ░ optimizer\n", "grey50")
            text.append_text(lanes(spans, t0, t1, width, "ms"))
        else:
            text.append("no trainer timeline yet (subject tandem.v1.trainer.timeline.>)", "italic grey50")
        text.append("\n\n")
        if self.transfers:
            base = min(e.start for e in self.transfers)
            spans = {"ring": [], "nats": [], "store": []}
            for e in self.transfers:
                spans[e.path].append((e.start - base, e.end - base, "█"))
            t0, t1 = self.view(0.0, max(e.end for e in self.transfers) - base)
            text.append(f"KV transfers (last {len(self.transfers)}) ", "bold underline").append(
                "ring: same-host shared memory  nats: frames  store: KV-store\n", "grey50")
            text.append_text(lanes(spans, t0, t1, width, "s"))
        else:
            text.append("no KV transfer yet (subject tandem.v1.kv.transfers)", "italic grey50")
        return text
