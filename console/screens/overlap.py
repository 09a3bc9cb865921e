"""Pane 3, Stream overlap: how much of the trainer's host<->device traffic hides under compute.

The last :class:`TrainTimeline` a trainer published (one lane each for compute, host→device,
device→host and the optimizer) and the recent :class:`KVTransferEvent` s (one lane per path:
shared-memory ring, NATS frames, KV-store), zoomable with ``+``/``-`` and panned with ←/→. Above
them, the last step's figures and the hidden fraction: the trainer's number and the one
recomputed here from the ops.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.binding import Binding
from textual.widget import Widget
from textual.widgets import Static

from tandem.console.screens.base import PaneScreen
from tandem.console.state import ConsoleState
from tandem.console.widgets import Timeline, hidden_fraction, human_bytes

MAX_ZOOM = 64.0


def summary_text(state: ConsoleState) -> Text:
    text = Text()
    timeline, step = state.timeline, state.train_step
    if timeline is not None:
        text.append("hidden under compute ", "bold").append(f"{timeline.hidden_fraction:.0%}", "bold green")
        mine = hidden_fraction(timeline.ops)
        text.append(f"  (from the ops: {mine:.0%})" if mine is not None else "", "grey50")
        moved = sum(op.bytes for op in timeline.ops)
        text.append(f"   job {timeline.job_id} step {timeline.step}, {len(timeline.ops)} ops, "
                    f"{human_bytes(moved)} moved")
    if step is not None:
        text.append(f"\nstep {step.step}: loss {step.loss:.3f}  {step.tokens_per_s:,.0f} tok/s  "
                    f"{step.model_tflops:.1f} TFLOP/s  {step.step_time_s * 1e3:.0f} ms/step  "
                    f"grad norm {step.grad_norm:.2f}")
    if state.transfers:
        kv = list(state.transfers)
        busy = sum(e.end - e.start for e in kv)
        rate = sum(e.bytes for e in kv) / busy if busy > 0 else 0.0
        text.append(f"\nKV transfers: {len(kv)} recent, {sum(e.blocks for e in kv)} blocks, "
                    f"{human_bytes(sum(e.bytes for e in kv))} at {human_bytes(rate)}/s while moving")
    return text


class OverlapScreen(PaneScreen):
    CSS_PATH = "overlap.tcss"
    SUB_TITLE = "3 Stream overlap"
    BINDINGS = [
        Binding("plus,equals_sign", "zoom(2)", "Zoom in"),
        Binding("minus", "zoom(0.5)", "Zoom out"),
        Binding("left", "pan(-0.25)", "Pan", show=False),
        Binding("right", "pan(0.25)", "Pan", show=False),
        Binding("0", "reset", "Whole step", show=False),
    ]

    def compose_body(self) -> Iterable[Widget]:
        yield Static(id="summary")
        yield Timeline(id="timeline")
        yield Static(id="zoom")

    def notice(self, state: ConsoleState) -> str:
        if state.timeline is None and not state.has("trainer"):
            return "no trainer found: start one (`tandem serve trainer`, compose profile `train`) and a job"
        if state.timeline is None:
            return "the trainer has published no step timeline yet (is a job running?)"
        return ""

    def show(self, state: ConsoleState) -> None:
        self.query_one("#summary", Static).update(summary_text(state))
        timeline = self.query_one("#timeline", Timeline)
        timeline.ops = list(state.timeline.ops) if state.timeline else []
        timeline.transfers = list(state.transfers)
        self.show_zoom()

    def show_zoom(self) -> None:
        timeline = self.query_one("#timeline", Timeline)
        self.query_one("#zoom", Static).update(
            Text(f"zoom ×{timeline.zoom:g} from {timeline.offset:.0%} of the range   + / - zoom   ← / → pan   0 all",
                 "grey50"))

    def action_zoom(self, factor: float) -> None:
        timeline = self.query_one("#timeline", Timeline)
        timeline.zoom = min(MAX_ZOOM, max(1.0, timeline.zoom * factor))
        timeline.offset = min(timeline.offset, 1 - 1 / timeline.zoom)
        self.show_zoom()

    def action_pan(self, by: float) -> None:
        timeline = self.query_one("#timeline", Timeline)
        timeline.offset = min(max(0.0, timeline.offset + by / timeline.zoom), 1 - 1 / timeline.zoom)
        self.show_zoom()

    def action_reset(self) -> None:
        timeline = self.query_one("#timeline", Timeline)
        timeline.zoom, timeline.offset = 1.0, 0.0
        self.show_zoom()
