"""``tandem console``: the ops console, a Textual app with five panes (Textual modes).

    tandem console                         # the `tandem up` running on this machine, across its restarts
    tandem console --nats-url nats://localhost:4222   # e.g. a compose deployment

Keys: ``1``-``5`` switch panes (Services, Block tables, Stream overlap, Scaling, Routing), ``?``
help, ``p`` pause, ``/`` filter, ``q`` quit; pane keys are in the footer. The app owns a
:class:`ConsoleState` that a :class:`Source` fills (:class:`NatsSource` for a live system, the
plain :class:`Source` for a fixed state); twice a second the front pane redraws if it changed.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import App
from textual.binding import Binding

from tandem.console.screens.base import PaneScreen
from tandem.console.screens.blocks import BlocksScreen
from tandem.console.screens.modals import HelpScreen
from tandem.console.screens.overlap import OverlapScreen
from tandem.console.screens.routing import RoutingScreen
from tandem.console.screens.scaling import ScalingScreen
from tandem.console.screens.services import ServicesScreen
from tandem.console.source import NatsSource, Source
from tandem.console.state import ConsoleState
from tandem.shared.infra.config import Settings

PANES = ("services", "blocks", "overlap", "scaling", "routing")
REFRESH_S = 0.5


class ConsoleApp(App):
    """The console; ``source`` decides where the data comes from."""

    TITLE = "tandem console"
    CSS_PATH = "app.tcss"
    MODES = {"services": ServicesScreen, "blocks": BlocksScreen, "overlap": OverlapScreen,
             "scaling": ScalingScreen, "routing": RoutingScreen}
    DEFAULT_MODE = "services"
    BINDINGS = [
        Binding("1", "pane('services')", "Services"),
        Binding("2", "pane('blocks')", "Blocks"),
        Binding("3", "pane('overlap')", "Overlap"),
        Binding("4", "pane('scaling')", "Scaling"),
        Binding("5", "pane('routing')", "Routing"),
        Binding("question_mark", "help", "Help"),
        Binding("p", "pause", "Pause"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, source: Source | None = None, state: ConsoleState | None = None,
                 refresh_s: float = REFRESH_S) -> None:
        super().__init__()
        self.source = source if source is not None else Source()
        self.state = state if state is not None else ConsoleState()
        self.paused = False
        self.refresh_s = refresh_s
        self.draw_error = ""

    async def on_mount(self) -> None:
        await self.source.start(self.state)
        self.set_interval(self.refresh_s, self.tick)

    def tick(self) -> None:
        """Redraw the front pane when the state changed, unless paused."""
        screen = self.screen
        if not isinstance(screen, PaneScreen):
            return
        try:
            if self.paused:
                screen.update_status()
            elif screen.seen_version != self.state.version:
                screen.update_view()
        except Exception as exc:  # data no pane expected: say so once, keep running
            screen.seen_version = self.state.version
            message = f"could not draw {screen.SUB_TITLE}: {type(exc).__name__}: {exc}"
            if message != self.draw_error:
                self.draw_error = message
                self.notify(message, severity="error", timeout=10)

    async def action_pane(self, mode: str) -> None:
        await self.switch_mode(mode)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_pause(self) -> None:
        self.paused = not self.paused
        if isinstance(self.screen, PaneScreen):
            if self.paused:
                self.screen.update_status()
            else:
                self.screen.update_view()

    async def action_quit(self) -> None:
        await self.source.stop()
        self.exit()


def run_console(url: str | None, data_dir: Path | str | None = None, settings: Settings | None = None) -> int:
    """Run the console against ``url`` (an explicit --nats-url: that server only), else against the
    ``tandem up`` running on ``data_dir``, following it across restarts (neither: say so on screen).
    It connects as the operator (``settings``' --creds and TLS flags, else up's key)."""
    from tandem.client.access import operator_options

    settings = settings or Settings()
    try:
        ConsoleApp(NatsSource(url, follow=data_dir,
                              options=lambda at: operator_options(settings, "tandem-console", at))).run()
    except KeyboardInterrupt:  # a SIGINT from outside (in the app, Ctrl+C is a key)
        return 130
    return 0
