"""The console's dialogs: key help, a yes/no confirmation before any action, the scale request form.

Every action that changes the system (drain a worker, ask the planner for other worker counts)
goes through :class:`ConfirmScreen` first; the pane runs it in a ``@work`` worker and awaits
``push_screen_wait``.
"""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

HELP = """\
[b]tandem console[/b] — read-only unless you confirm an action

[b]1[/b] Services   [b]2[/b] Block tables   [b]3[/b] Stream overlap   [b]4[/b] Scaling   [b]5[/b] Routing
[b]?[/b] this help   [b]p[/b] pause / resume updates   [b]/[/b] filter the pane's rows   [b]Esc[/b] clear it
[b]q[/b] quit

Services:  [b]d[/b] drain the selected worker   [b]Enter[/b] its block table
Blocks:    pick a worker (top left), then a sequence: its logical → physical blocks
Overlap:   [b]+[/b] / [b]-[/b] zoom   [b]←[/b] / [b]→[/b] pan   [b]0[/b] whole step
Scaling:   [b]s[/b] ask the planner for other worker counts

Data: $SRV.STATS discovery every 2 s; routing, scaling, KV transfer, trainer and metrics
messages as they are published; the chosen worker's block snapshot every second."""


class HelpScreen(ModalScreen[None]):
    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(HELP, id="help")
            yield Button("Close", id="close", variant="primary")

    @on(Button.Pressed, "#close")
    def close(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """Asks before an action: ``y`` / Confirm returns True, ``n`` / Escape / Cancel False."""

    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("y", "answer(True)", "Confirm"), Binding("n,escape", "answer(False)", "Cancel")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, id="question")
            with Horizontal(id="buttons"):
                yield Button("Confirm (y)", id="yes", variant="error")
                yield Button("Cancel (n)", id="no", variant="primary")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ScaleScreen(ModalScreen["tuple[int | None, int | None, str] | None"]):
    """Worker counts to ask the planner for; an empty box leaves that count to the planner."""

    CSS_PATH = "modals.tcss"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, prefill: int, decode: int) -> None:
        super().__init__()
        self.prefill, self.decode = prefill, decode

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Ask the planner for worker counts (its limits still hold)", id="question")
            yield Label("prefill workers")
            yield Input(str(self.prefill), type="integer", id="prefill")
            yield Label("decode workers")
            yield Input(str(self.decode), type="integer", id="decode")
            yield Label("reason")
            yield Input("", placeholder="why (goes into the planner's log)", id="reason")
            with Horizontal(id="buttons"):
                yield Button("Next", id="next", variant="warning")
                yield Button("Cancel", id="cancel", variant="primary")

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Input.Submitted)
    @on(Button.Pressed, "#next")
    def submit(self) -> None:
        def count(box: str) -> int | None:
            value = self.query_one(box, Input).value.strip()
            return max(0, int(value)) if value.lstrip("-").isdigit() else None

        self.dismiss((count("#prefill"), count("#decode"), self.query_one("#reason", Input).value.strip()))

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)
