"""The synchronous engine core: continuous batching with chunked prefill over a paged KV cache.

- ``sequence``: ``EngineRequest``, ``RequestOutput``, ``Sequence``; the engine samples with the
  protocol's ``SamplingParams`` (:mod:`tandem.shared.protocol.serving`), the one definition.
- ``scheduler``: ``Scheduler`` (waiting/running queues, token budget, preemption by recompute,
  admission from the prefix cache).
- ``sampling``: batched greedy / temperature / top-k / top-p sampling with per-request seeds.
- ``detokenizer``: incremental detokenization and stop conditions.
- ``model_runner``: ``ModelRunner`` (KV cache, batch inputs, forward, logits, sampling, KV export/import).
- ``engine``: ``LLMEngine`` and ``EngineConfig``, the API the prefill and decode services use
  (``stats()`` with prefix-cache counters, ``drain_kv_events()`` for the KV plane).

Import from the module that defines each name; this package re-exports nothing.
"""
