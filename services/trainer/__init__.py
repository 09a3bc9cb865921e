"""The trainer: ``service.py`` (jobs over NATS, ``tandem serve trainer``) and ``reload.py`` (hot weight
reload in serving workers after a checkpoint). The training itself is in ``tandem.shared.train``."""
