"""The trainer service: jobs over NATS (``tandem serve trainer``). The training itself is in
``tandem.shared.train``; serving workers' hot reload of its checkpoints is ``services/common/reload.py``."""
