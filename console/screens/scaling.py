"""Pane 4, Scaling: the planner's decisions and the latencies it decides on.

Current and wanted prefill/decode counts (the planner's last decision, and the instances
discovery sees), TTFT and TPOT as sparklines of p50 and p99 per 2 s window (from every
instance's :class:`MetricsSnapshot` histograms) against the targets, and the decisions with their
reasons, read back from the planner's JetStream stream and then as they come. ``s`` asks the
planner for other counts, after a confirmation.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from rich.text import Text
from textual import work
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import DataTable, Label, Sparkline, Static

from tandem.console.screens.base import PaneScreen
from tandem.console.screens.modals import ConfirmScreen, ScaleScreen
from tandem.console.state import ConsoleState, LatencySeries
from tandem.shared.protocol import subjects

SPARKS = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("tpot", "p99"))


def fmt_s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def latency_label(kind: str, quantile: str, series: LatencySeries) -> Text:
    points = getattr(series, quantile)
    last = points[-1] if points else None
    text = Text(f"{kind.upper()} {quantile} ", "bold").append(fmt_s(last))
    if series.target_s is not None:
        over = last is not None and last > series.target_s
        text.append(f"  target {fmt_s(series.target_s)}", "bold red" if over else "green")
    return text


def counts_text(state: ConsoleState) -> Text:
    decision = state.latest_decision()
    text = Text()
    for role in ("prefill", "decode"):
        seen = len(state.instances(role))
        text.append(f"{role:<8}", "bold").append(f"{seen} running")
        if decision is not None:
            current, wanted = getattr(decision, f"{role}_current"), getattr(decision, f"{role}_wanted")
            style = "bold yellow" if wanted != current else "green"
            text.append(f"   planner: {current} → ").append(str(wanted), style)
        text.append("\n")
    if decision is not None:
        text.append("last decision: ", "grey50").append(decision.reason)
    return text


class ScalingScreen(PaneScreen):
    CSS_PATH = "scaling.tcss"
    SUB_TITLE = "4 Scaling"
    BINDINGS = [Binding("s", "scale", "Scale request")]

    def compose_body(self) -> Iterable[Widget]:
        yield Static(id="counts")
        with Vertical(id="sparks"):
            for kind, quantile in SPARKS:
                with Horizontal(classes="spark-row"):
                    yield Label(id=f"label-{kind}-{quantile}", classes="spark-label")
                    yield Sparkline([], id=f"spark-{kind}-{quantile}", classes=f"spark {quantile}")
        yield Label("decisions (newest first)", classes="title")
        table = DataTable(id="decisions", cursor_type="row", zebra_stripes=True)
        table.add_columns("time (UTC)", "prefill", "decode", "reason")
        yield table

    def notice(self, state: ConsoleState) -> str:
        if not state.has("planner") and not state.decisions:
            where = "" if state.planner_stream else f"; stream {subjects.PLANNER_STREAM} not found"
            return f"no planner answered discovery (`tandem serve planner`){where}"
        if not any(s.p50 for s in state.latency.values()):
            return "no TTFT/TPOT histograms received yet (metrics on tandem.v1.metrics.>)"
        return ""

    def show(self, state: ConsoleState) -> None:
        self.query_one("#counts", Static).update(counts_text(state))
        for kind, quantile in SPARKS:
            series = state.latency[kind]
            self.query_one(f"#label-{kind}-{quantile}", Label).update(latency_label(kind, quantile, series))
            self.query_one(f"#spark-{kind}-{quantile}", Sparkline).data = list(getattr(series, quantile))
        table = self.query_one("#decisions", DataTable)
        table.clear()
        for d in reversed(state.decisions):
            if self.filter_text and self.filter_text.lower() not in d.reason.lower():
                continue
            when = datetime.fromtimestamp(d.time, UTC).strftime("%H:%M:%S")
            changed = (d.prefill_wanted, d.decode_wanted) != (d.prefill_current, d.decode_current)
            table.add_row(when, f"{d.prefill_current} → {d.prefill_wanted}", f"{d.decode_current} → {d.decode_wanted}",
                          Text(d.reason, "bold" if changed else ""))

    @work(exclusive=True)
    async def action_scale(self) -> None:
        state = self.state
        answer = await self.app.push_screen_wait(
            ScaleScreen(len(state.instances("prefill")), len(state.instances("decode"))))
        if answer is None:
            return
        prefill, decode, reason = answer
        question = f"Ask the planner for prefill={prefill} decode={decode}?"
        if not await self.app.push_screen_wait(ConfirmScreen(question)):
            self.notify("scale request cancelled")
            return
        self.notify(await self.app.source.scale(prefill, decode, reason), title="scale")
