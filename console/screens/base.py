"""What every pane shares: header, status line (connection, pause, filter), a notice line for
absent services, the body, a filter box that ``/`` opens, and the footer with the keys.

A pane subclasses :class:`PaneScreen`, yields its widgets from :meth:`compose_body`, draws the
state in :meth:`show` and says in :meth:`notice` what it misses. The app calls
:meth:`update_view` when the state changed (unless paused) and when the pane comes to the front.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Header, Input, Static

from tandem.console.state import ConsoleState


def status_text(state: ConsoleState, paused: bool, filter_text: str) -> Text:
    """The status line: where the console is connected (or why not), paused, filtered."""
    text = Text()
    if state.connection == "connected":
        text.append("● connected ", "bold green").append(state.url or "")
        if state.discovered:
            text.append(f"  ·  {len(state.services)} services")
    elif state.connection == "no-url" and state.follow:
        text.append(f"✖ no `tandem up` running on data dir {state.follow}: waiting for one (or pass --nats-url)",
                    "bold red")
    elif state.connection == "no-url":
        text.append("✖ no running `tandem up` found and no --nats-url given: start one, or pass the URL",
                    "bold red")
    elif state.connection == "unreachable":
        text.append(f"✖ NATS unreachable at {state.url}", "bold red")
        text.append(f" ({state.connection_error}); retrying every 2 s" if state.connection_error else "; retrying")
        if state.follow:
            text.append(", and following the `tandem up` state file")
    else:
        text.append(f"… connecting to {state.url}", "yellow")
    if paused:
        text.append("  ·  ", "").append("⏸ PAUSED (p resumes)", "bold black on yellow")
    if filter_text:
        text.append("  ·  filter: ").append(repr(filter_text), "bold")
    return text


def uptime(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class PaneScreen(Screen):
    """Base of the five panes."""

    BINDINGS = [
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.filter_text = ""
        self.seen_version = -1
        self.ready = False  # composed and mounted: the app's timer may fire while a pane is still mounting

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static(id="status")
        yield Static(id="notice")
        yield from self.compose_body()
        box = Input(placeholder="filter (Enter keeps it, Escape clears it)", id="filter", disabled=True)
        box.display = False  # and disabled, so that it never takes the focus while hidden
        yield box
        yield Footer()

    # -- for subclasses ---------------------------------------------------------------------------
    def compose_body(self) -> Iterable[Widget]:
        return ()

    def show(self, state: ConsoleState) -> None:
        """Draw ``state`` into the body's widgets."""

    def notice(self, state: ConsoleState) -> str:
        """What this pane misses (an absent service, nothing received yet); empty when all is there."""
        return ""

    # -- drawing ----------------------------------------------------------------------------------
    @property
    def state(self) -> ConsoleState:
        return self.app.state

    def update_status(self) -> None:
        if self.ready:
            self.query_one("#status", Static).update(status_text(self.state, self.app.paused, self.filter_text))

    def update_view(self) -> None:
        if not self.ready:
            return
        state = self.state
        self.seen_version = state.version
        self.update_status()
        if state.connection != "connected":
            message = "no data: not connected to NATS (see the status line)"
        elif not state.discovered:
            message = "discovering services ($SRV.STATS)…"
        else:
            message = self.notice(state)
        notice = self.query_one("#notice", Static)
        notice.update(Text(message, "bold yellow"))
        notice.display = bool(message)
        self.show(state)

    def on_mount(self) -> None:
        self.ready = True
        self.update_view()

    def on_screen_resume(self) -> None:
        self.update_view()

    # -- filter -----------------------------------------------------------------------------------
    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display, box.disabled = True, False
        box.focus()

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = ""
        box.display, box.disabled = False, True
        self.filter_text = ""
        self.update_view()

    @on(Input.Changed, "#filter")
    def filter_changed(self, event: Input.Changed) -> None:
        self.filter_text = event.value.strip()
        self.update_view()

    @on(Input.Submitted, "#filter")
    def filter_kept(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = bool(self.filter_text)
        box.disabled = True  # Escape clears a kept filter; / edits it again
        self.focus_next()
