"""Constrained decoding: outputs that a JSON schema, a regex, a grammar or a list of choices admits.

A request's :class:`~tandem.shared.protocol.serving.StructuredOutput` becomes an llguidance grammar
(``grammars``), compiled once per worker and cached by its hash (``compiler``) over the worker's
vocabulary (``vocabulary``); each sequence follows it with its own matcher (``output_grammar``),
forked with the sequence and rebuilt from the tokens a hand-off or a migration brings along. Each
step the engine fills the constrained rows' token bitmasks on host threads while the device runs the
forward, and the sampler masks the logits on the device (``bitmask``).

Why llguidance: see ``docs/serving.md`` (structured outputs) and ``benchmarks/grammar_engines.py``.
"""
