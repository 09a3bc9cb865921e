"""tandem's ops console: a Textual app over NATS (``tandem console [--nats-url URL]``).

:mod:`tandem.console.app` is the app, :mod:`tandem.console.source` reads the system over NATS into
a :class:`tandem.console.state.ConsoleState`, :mod:`tandem.console.screens` draws it, one pane per
module, and :mod:`tandem.console.demo` is a fixed state for snapshot tests and screenshots.
"""
