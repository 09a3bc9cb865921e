"""Hot weight reload for serving workers: the worker side of the trainer's ``WeightsUpdated`` events.

A prefill or decode worker calls :func:`subscribe_weight_updates` in its setup. When an event names
the model it serves, the new checkpoint is loaded off the event loop (a worker thread), checked
against the served architecture, and handed to the engine thread with ``call_when_idle``: requests
in flight finish on the old weights, requests that arrive meanwhile wait and then run on the new
ones. The engine forgets its prefix cache (K/V of the old weights) and the worker's KV namespace
gains the weights version, so KV-stores and the router never mix blocks of two versions.
"""

from __future__ import annotations

import asyncio
import time

from tandem.services.common.paths import under_data_dir
from tandem.shared.kvcache.cache import kv_namespace
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.loader import load_model
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.codec import decode
from tandem.shared.protocol.training import WeightsUpdated

_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "tie_word_embeddings", "attention_bias", "o_proj_bias", "qk_norm")


def same_shapes(a: ModelConfig, b: ModelConfig) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _SHAPE_FIELDS)


async def subscribe_weight_updates(worker) -> None:  # noqa: ANN001 - an EngineWorker
    """Reload ``worker``'s weights whenever a ``WeightsUpdated`` names its model."""
    lock = asyncio.Lock()

    async def on_update(msg) -> None:  # noqa: ANN001
        try:
            update = decode(msg.data, WeightsUpdated)
        except ProtocolError as exc:
            worker.limited.warning("ignored weights-updated events", "ignored bad weights-updated event: %s", exc)
            return
        if update.model != worker.model_name:
            return
        try:
            under_data_dir(update.path, worker.settings.data_dir, "path")
        except ProtocolError as exc:
            worker.limited.warning("ignored weights-updated events", "ignored weights-updated event %s: %s",
                                   update.version, exc.message)
            return
        worker.spawn(reload_weights(worker, update, lock), f"weights reload {update.version}")

    await worker.nc.subscribe(subjects.WEIGHTS_UPDATED, cb=on_update)


async def reload_weights(worker, update: WeightsUpdated, lock: asyncio.Lock) -> bool:  # noqa: ANN001
    """Load ``update.path`` and swap it in between requests; False (logged) when it does not fit."""
    async with lock:
        started = time.perf_counter()
        try:
            # Staged in host memory: a second copy of the weights on the GPU could exhaust it.
            loaded = await asyncio.to_thread(load_model, update.path, "cpu", worker.dtype)
        except Exception as exc:
            worker.log.error("weights %s from %s not loaded: %s", update.version, update.path, exc)
            return False
        cfg = worker.loaded.config
        if not same_shapes(cfg, loaded.config):
            worker.log.error("weights %s from %s do not fit the served %s; not loaded", update.version, update.path,
                             worker.model_name)
            return False
        state = loaded.model.state_dict()
        await worker.thread.call_when_idle(lambda engine: engine.load_weights(state))
        # A quantized worker's KV differs from a float one's on the same weights: keep it apart.
        quantized = "" if worker.settings.engine.quantization == "none" else f"+{worker.settings.engine.quantization}"
        worker.kv_namespace = kv_namespace(f"{worker.model_name}@{update.version}{quantized}", worker.dtype,
                                           cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                           worker.settings.engine.block_size)
        worker.weights_version = update.version
        worker.log.info("weights %s (step %d) loaded from %s in %.2fs; KV namespace %s", update.version, update.step,
                        update.path, time.perf_counter() - started, worker.kv_namespace)
        return True
