"""What the services share and no service owns: the runtime every service runs in (``runtime``), the
engine worker base of prefill and decode (``worker``, ``engine_thread``, ``drain``, ``reload``), their
metrics, KV-event publishing, block snapshots for the console, and the KV-store client."""
