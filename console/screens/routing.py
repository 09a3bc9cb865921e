"""Pane 5, Routing: the router's latest decision and the ones before it.

Each :class:`RoutingDecision` (subject ``tandem.v1.router.decisions``) lists the candidate decode
workers with their cached prefix blocks, load and cost, the choice and why; the table below keeps
the last hundred, newest first (``/`` filters by request, worker or reason).
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.widget import Widget
from textual.widgets import DataTable, Label, Static

from tandem.console.screens.base import PaneScreen
from tandem.console.state import ConsoleState
from tandem.shared.protocol.fleet import RoutingDecision


def decision_text(d: RoutingDecision) -> Text:
    return Text.assemble(
        ("request ", "grey50"), (d.request_id, "bold"), ("  prompt ", "grey50"),
        f"{d.prompt_tokens} tokens / {d.prompt_blocks} blocks", ("  decode ", "grey50"),
        (d.decode_worker, "bold green"),
        ("  prefill ", "grey50"), (d.prefill_worker or "local (decode prefills)", "bold"), "\n",
        ("reason ", "grey50"), d.reason,
    )


def matches(d: RoutingDecision, text: str) -> bool:
    text = text.lower()
    return any(text in v.lower() for v in (d.request_id, d.decode_worker, d.prefill_worker or "", d.reason))


class RoutingScreen(PaneScreen):
    CSS_PATH = "routing.tcss"
    SUB_TITLE = "5 Routing"

    def compose_body(self) -> Iterable[Widget]:
        yield Label("latest decision", classes="title")
        yield Static(id="latest")
        candidates = DataTable(id="candidates", cursor_type="none")
        candidates.add_columns("candidate", "cached blocks", "load", "cost", "chosen")
        yield candidates
        yield Label("recent decisions (newest first)", classes="title")
        recent = DataTable(id="recent", cursor_type="row", zebra_stripes=True)
        recent.add_columns("request", "tokens", "decode", "prefill", "reason")
        yield recent

    def notice(self, state: ConsoleState) -> str:
        if not state.routing and not state.has("router"):
            return "no router answered discovery: routing decisions appear when one runs (`tandem serve router`)"
        if not state.routing:
            return "no routing decision yet: send a request (`tandem generate ...`)"
        return ""

    def show(self, state: ConsoleState) -> None:
        latest = state.latest_routing()
        self.query_one("#latest", Static).update(decision_text(latest) if latest else Text("none yet", "grey50"))
        candidates = self.query_one("#candidates", DataTable)
        candidates.clear()
        if latest is not None:
            for c in sorted(latest.candidates, key=lambda c: c.cost):
                chosen = c.instance_id == latest.decode_worker
                candidates.add_row(Text(c.instance_id, "bold green" if chosen else ""), str(c.cached_blocks),
                                   str(c.load), f"{c.cost:.1f}", "✔" if chosen else "")
        recent = self.query_one("#recent", DataTable)
        recent.clear()
        for d in reversed(state.routing):
            if self.filter_text and not matches(d, self.filter_text):
                continue
            recent.add_row(d.request_id, str(d.prompt_tokens), d.decode_worker, d.prefill_worker or "local", d.reason)
