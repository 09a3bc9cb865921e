"""The synchronous engine core: continuous batching with chunked prefill over a paged KV cache.

- ``sequence``: ``SamplingParams``, ``EngineRequest``, ``RequestOutput``, ``Sequence``.
- ``scheduler``: ``Scheduler`` (waiting/running queues, token budget, preemption by recompute,
  admission from the prefix cache).
- ``sampling``: batched greedy / temperature / top-k / top-p sampling with per-request seeds.
- ``detokenizer``: incremental detokenization and stop conditions.
- ``model_runner``: ``ModelRunner`` (KV cache, batch inputs, forward, logits, sampling, KV export/import).
- ``engine``: ``LLMEngine`` and ``EngineConfig``, the API the prefill and decode services use
  (``stats()`` with prefix-cache counters, ``drain_kv_events()`` for the KV plane).
"""

from tandem.shared.engine.detokenizer import IncrementalDetokenizer, check_stop
from tandem.shared.engine.engine import EngineConfig, LLMEngine
from tandem.shared.engine.model_runner import ModelRunner
from tandem.shared.engine.sampling import mix_seed, sample
from tandem.shared.engine.scheduler import ScheduledBatch, ScheduledSequence, Scheduler
from tandem.shared.engine.sequence import (
    EngineRequest,
    RequestOutput,
    SamplingParams,
    Sequence,
    SequenceStatus,
)

__all__ = [
    "EngineConfig",
    "EngineRequest",
    "IncrementalDetokenizer",
    "LLMEngine",
    "ModelRunner",
    "RequestOutput",
    "SamplingParams",
    "ScheduledBatch",
    "ScheduledSequence",
    "Scheduler",
    "Sequence",
    "SequenceStatus",
    "check_stop",
    "mix_seed",
    "sample",
]
