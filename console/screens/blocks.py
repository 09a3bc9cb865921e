"""Pane 2, Block tables: one worker's KV pool, its sequences' block tables, the KV-stores.

Top left, the prefill and decode workers found by discovery (pick one; its block snapshot comes
every second); below, its live sequences (a request's later outputs as ``request#i``; a structured
output's kind under "constrained"; the LoRA adapter it runs with under "adapter"). The
middle shows the pool, one cell per physical block coloured by state (free, in use, free but
cached, shared: a shared cell shows how many block tables hold it), how many blocks
copy-on-write has copied (forked samples and beams share blocks until one writes), the chosen
sequence's blocks in yellow, and that sequence's block table, logical → physical, each block
marked by where its K/V came from: this worker's prefix cache, an import (a hand-off on a decode
worker, a KV-store fetch on a prefill worker) or computed here, and ``×k`` where k tables share
it. On the right, every KV-store's tiers and hit rate.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual import on
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import DataTable, Label, OptionList, Static
from textual.widgets.option_list import Option

from tandem.console.screens.base import PaneScreen
from tandem.console.state import WORKER_SERVICES, ConsoleState
from tandem.console.widgets import BlockGrid, bar, human_bytes, ref_count
from tandem.shared.protocol.views import BlockSnapshot, SequenceBlocks

ORIGINS = (("prefix cache", "dodger_blue2"), ("imported", "yellow"), ("computed here", "green"))


def sequence_name(seq: SequenceBlocks) -> str:
    """A sequence's name in the pane, unique within a snapshot: its request id, and ``#i`` for the
    request's output i > 0 (the engine's own name for it)."""
    return seq.request_id if seq.sample_index == 0 else f"{seq.request_id}#{seq.sample_index}"


def block_table_text(seq: SequenceBlocks, snapshot: BlockSnapshot, service: str) -> Text:
    """``logical→physical`` for every block of ``seq``, coloured by where its K/V came from, with
    ``×k`` after a block k block tables share (a cached prefix, or a fork of samples or beams)."""
    imported = "hand-off" if service == "decode" else "KV-store"
    names = {"prefix cache": "prefix cache", "imported": imported, "computed here": "here"}
    counts = (seq.prefix_cached_blocks, seq.imported_blocks,
              max(0, len(seq.block_table) - seq.prefix_cached_blocks - seq.imported_blocks))
    refs = [ref_count(snapshot, b) if 0 <= b < snapshot.num_blocks else 1 for b in seq.block_table]
    shared = sum(r > 1 for r in refs)
    text = Text.assemble((sequence_name(seq), "bold"))
    if seq.adapter:
        text.append(" · adapter ").append(seq.adapter, "cyan")
    text.append(f" · {seq.num_tokens} tokens · {len(seq.block_table)} blocks of {snapshot.block_size}\n")
    for (origin, style), count in zip(ORIGINS, counts):
        text.append("■ ", style).append(f"{names[origin]} {count}   ")
    text.append("\n")
    if shared:
        text.append(f"{shared} shared", "magenta").append(" (×k: k block tables hold it)\n", "grey50")
    for logical, (physical, refs_here) in enumerate(zip(seq.block_table, refs)):
        origin = 0 if logical < seq.prefix_cached_blocks else 1 if logical < sum(counts[:2]) else 2
        cell = Text(f"{logical}→{physical}", ORIGINS[origin][1])
        if refs_here > 1:
            cell.append(f"×{refs_here}", "magenta")
        cell.pad_right(max(1, 11 - len(cell)))
        text.append_text(cell)
    return text


def kvstore_text(state: ConsoleState) -> Text:
    if not state.kvstores:
        return Text("no KV-store answered (tandem serve kvstore)", "italic grey50")
    text = Text()
    for instance, s in sorted(state.kvstores.items()):
        hits = s.get("hits_ram", 0) + s.get("hits_disk", 0)
        lookups = hits + s.get("misses", 0)
        text.append(f"{instance}\n", "bold")
        for tier in ("ram", "disk"):
            used, cap = s.get(f"{tier}_bytes", 0), s.get(f"{tier}_capacity", 0)
            text.append(f"{tier:<5}").append_text(bar(used / cap if cap else 0.0, 10, "dodger_blue2"))
            text.append(f" {used / cap:.0%} of {human_bytes(cap)}\n" if cap else " off\n")
        rate = f"{hits / lookups:.0%}" if lookups else "-"
        text.append("hit rate ").append(rate, "bold").append(f" of {lookups} blocks asked\n")
        text.append(f"hits ram {s.get('hits_ram', 0)}  disk {s.get('hits_disk', 0)}\n")
        text.append(f"puts {s.get('puts', 0)}  evicted {s.get('evictions_ram', 0)}+{s.get('evictions_disk', 0)}\n\n",
                    "grey50")
    return text


class BlocksScreen(PaneScreen):
    CSS_PATH = "blocks.tcss"
    SUB_TITLE = "2 Block tables"

    def __init__(self) -> None:
        super().__init__()
        self.worker_ids: list[str] = []
        self.sequence: str | None = None
        self.shown: BlockSnapshot | None = None
        self.shown_filter = ""

    def compose_body(self) -> Iterable[Widget]:
        with Horizontal(id="panes"):
            with Vertical(id="left"):
                yield Label("workers", classes="title")
                yield OptionList(id="workers")
                yield Label("sequences", classes="title")
                table = DataTable(id="sequences", cursor_type="row")
                table.add_columns("request", "blocks", "cached", "imported", "constrained", "adapter")
                yield table
            with Vertical(id="center"):
                yield Label("physical blocks", classes="title", id="pool-title")
                yield BlockGrid(id="grid")
                yield Static(id="table")
            with Vertical(id="right"):
                yield Label("KV-stores", classes="title")
                yield Static(id="kvstores")

    def notice(self, state: ConsoleState) -> str:
        if not state.instances(*WORKER_SERVICES):
            return "no prefill or decode worker answered $SRV discovery"
        return state.blocks_error

    def show(self, state: ConsoleState) -> None:
        workers = state.instances(*WORKER_SERVICES)
        if state.selected_worker is None and workers:
            state.selected_worker = next(((w.service, w.instance_id) for w in workers if w.service == "decode"),
                                         (workers[0].service, workers[0].instance_id))
        ids = [f"{w.service}/{w.instance_id}" for w in workers]
        options = self.query_one("#workers", OptionList)
        if ids != self.worker_ids:
            self.worker_ids = ids
            options.clear_options()
            options.add_options([Option(f"{w.service:<8}{w.instance_id}", id=i) for w, i in zip(workers, ids)])
        if state.selected_worker is not None:
            wanted = "/".join(state.selected_worker)
            if wanted in ids and options.highlighted != ids.index(wanted):
                options.highlighted = ids.index(wanted)
        snapshot = state.blocks.get(state.selected_worker[1]) if state.selected_worker else None
        if snapshot is not self.shown or self.filter_text != self.shown_filter:
            self.shown, self.shown_filter = snapshot, self.filter_text
            self.show_sequences(snapshot)
        self.query_one("#kvstores", Static).update(kvstore_text(state))

    def show_sequences(self, snapshot: BlockSnapshot | None) -> None:
        table = self.query_one("#sequences", DataTable)
        table.clear()
        shown = self.filter_text
        sequences = [s for s in snapshot.sequences if shown in sequence_name(s) or (shown and shown in s.adapter)
                     ] if snapshot else []
        for seq in sequences:
            table.add_row(sequence_name(seq)[:16], str(len(seq.block_table)), str(seq.prefix_cached_blocks),
                          str(seq.imported_blocks), seq.constrained or "-", seq.adapter[:24] or "-",
                          key=sequence_name(seq))
        keys = [sequence_name(s) for s in sequences]
        if self.sequence in keys:
            table.move_cursor(row=keys.index(self.sequence), animate=False)
        elif keys:
            self.sequence = keys[0]
        self.show_sequence(snapshot)
        title = self.query_one("#pool-title", Label)
        if snapshot is None:
            title.update("physical blocks")
        else:
            title.update(f"{snapshot.instance_id}: {snapshot.num_blocks} blocks × {snapshot.block_size} tokens")

    def show_sequence(self, snapshot: BlockSnapshot | None) -> None:
        grid = self.query_one("#grid", BlockGrid)
        grid.snapshot = snapshot
        seq = next((s for s in snapshot.sequences if sequence_name(s) == self.sequence), None) if snapshot else None
        grid.highlight = frozenset(seq.block_table) if seq else frozenset()
        service = self.state.selected_worker[0] if self.state.selected_worker else "decode"
        self.query_one("#table", Static).update(
            block_table_text(seq, snapshot, service) if seq else Text("no sequence chosen", "grey50"))

    @on(OptionList.OptionHighlighted, "#workers")
    def worker_chosen(self, event: OptionList.OptionHighlighted) -> None:
        service, instance = event.option.id.split("/", 1)
        if self.state.selected_worker != (service, instance):
            self.state.selected_worker = (service, instance)
            self.state.changed()
            if not self.app.paused:
                self.update_view()

    @on(DataTable.RowHighlighted, "#sequences")
    def sequence_chosen(self, event: DataTable.RowHighlighted) -> None:
        self.sequence = event.row_key.value
        self.show_sequence(self.shown)
