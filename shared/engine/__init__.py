"""The synchronous engine core: continuous batching with chunked prefill over a paged KV cache.

- ``sequence``: ``EngineRequest``, ``RequestOutput``, ``Sequence``; the engine samples with the
  protocol's ``SamplingParams`` (:mod:`tandem.shared.protocol.serving`), the one definition.
- ``scheduler``: ``Scheduler`` (waiting/running queues, token budget, preemption by recompute,
  admission from the prefix cache).
- ``scheduler_output``: ``ScheduledBatch`` / ``ScheduledSequence``, what the scheduler hands the
  model runner each step (rows, imports, copy-on-write copies, swaps).
- ``sampling``: batched greedy / temperature / top-k / top-p sampling with per-request seeds.
- ``detokenizer``: incremental detokenization and stop conditions.
- ``model_runner``: ``ModelRunner`` (KV cache, batch inputs, forward, logits, sampling, KV export/import).
- ``engine``: ``LLMEngine`` and ``EngineConfig``, the API the prefill and decode services use
  (``stats()`` with prefix-cache counters, ``drain_kv_events()`` for the KV plane).
- ``engine_view``: ``EngineView``, all a service may use of an engine (with the ``EngineStats``,
  ``SequenceView`` and ``KVPoolView`` it returns); the scheduler, block manager and runner stay inside.
- ``tp_model_runner`` and ``tp_ranks``: a tensor-parallel worker's runner (rank 0 leads, the other
  ranks follow) and the follower processes; ``shared/parallel`` has the group and the sharding below.

Import from the module that defines each name; this package re-exports nothing.
"""
