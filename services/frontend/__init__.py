"""The OpenAI-compatible HTTP front end: ``tandem serve frontend`` (see :mod:`.service`)."""
