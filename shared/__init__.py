"""The shared library, in layers; each imports only from the layers above it in this list.

- ``protocol``: the wire (messages, subjects, KV frames, block hashes). Imports neither torch nor the engine.
- ``text``: tokenizers. No torch.
- ``infra``: process and bus infrastructure (settings, nats-server, metrics, JetStream streams, the
  shared-memory ring and device copies).
- compute: ``model``, ``kvcache``, ``engine``, ``train`` (torch).
"""
