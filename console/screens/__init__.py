"""The console's screens: one pane per module, each with its own ``.tcss``, and the modal dialogs."""
