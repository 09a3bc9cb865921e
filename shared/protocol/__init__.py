"""The wire protocol: what crosses the bus, and nothing that computes.

``base`` (schema version, error codes), ``serving`` (requests and token streams), ``kv`` (KV hand-offs,
KV events, the KV-store), ``fleet`` (heartbeats, metrics, routing and scaling decisions), ``training``,
``views`` (what the console is shown), ``codec`` (encode/decode), ``subjects``, ``frames`` (binary KV
frames), ``block_hashes``. This layer imports neither torch nor the engine (a test checks it), so the
router, the KV-store's service side and ``tandem.client`` run without torch.
"""
