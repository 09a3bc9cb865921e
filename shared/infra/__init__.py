"""Process and bus infrastructure: ``config`` (settings), ``natsserver`` (the embedded server),
``metrics`` (Prometheus and bus snapshots), ``jetstream`` and ``kvevents`` (JetStream), ``liveness``
(heartbeats, who is still on the bus), ``log_limit`` (log lines input cannot multiply), ``process``
(event loop and logging of every process), ``version``, ``triton_runtime`` and ``device_timing``.
How KV blocks move between processes (the shared-memory ring, KV frames, bulk connections, device
copies) lives in :mod:`tandem.shared.kvtransfer`."""
