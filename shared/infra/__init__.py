"""Process and bus infrastructure: ``config`` (settings), ``natsserver`` (the embedded server),
``metrics`` (Prometheus and bus snapshots), ``streams`` and ``kvevents`` (JetStream), ``shmring`` (the
pinned shared-memory KV ring) and ``devcopy`` (device copies that must not wait for the engine's stream)."""
