"""Where a request goes: the router's scoring of decode and prefill workers.

The formula, in the manner of Dynamo's KV router: a worker's cost is the prefill work the request
would still need there plus the work already queued on it, both in blocks of tokens,

    cost = (prompt_blocks - cached_prefix_blocks) + load_weight * (running + waiting + just_placed) + extra

(``extra``: what else the worker would have to do first, such as loading the request's LoRA adapter:
see ``adapters.py``)

and the cheapest worker wins (ties: more free KV blocks, then instance id). Counting the uncached
blocks rather than the cached ones makes a long shared prefix worth exactly what it saves; the
load term keeps a hot prefix from piling every request onto one worker once its queue costs more
than the recompute. llm-d's prefix-cache and load scorers weigh the same two signals;
``load_weight`` is configuration (``--router-load-weight``).

Conditional disaggregation (:func:`remote_prefill_workers`): a prefill worker takes the prompt only
where that pays. Not when the chosen decode worker would have to prefill at most
``local_prefill_max_tokens`` tokens (the transfer would cost more than the work), and not on a prefill
worker computing on the decode worker's own device (the heartbeats' ``device``): two processes on one
GPU time-slice it, so the prefill's kernels stall the decode batch's steps just as a chunk mixed into
them would, and the hand-off and a second set of weights come on top: both TPOT and throughput come
out worse than the engine alone (``benchmarks/serving_system.py --placements auto disaggregated``
compares the two on one GPU). There the decode worker prefills by itself, chunked
into its decode steps (``max_num_batched_tokens`` bounds what one step adds), unless the operator
asked for prefill on the shared device (``--router-prefill-on-shared-device``: to exercise the
hand-off, or to measure exactly this). Workers that say no device (CPU, or an older worker) are never
taken for sharing one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    instance_id: str
    cached_blocks: int
    load: int
    free_blocks: int
    cost: float


def rank(prompt_blocks: int, workers: list[tuple[str, int, int, int] | tuple[str, int, int, int, float]],
         load_weight: float) -> list[Candidate]:
    """``workers``: (instance id, cached prefix blocks, load, free blocks[, extra cost]); cheapest first."""
    candidates = [
        Candidate(row[0], row[1], row[2], row[3], (prompt_blocks - row[1]) + load_weight * row[2]
                  + (row[4] if len(row) > 4 else 0.0))
        for row in workers
    ]
    return sorted(candidates, key=lambda c: (c.cost, -c.free_blocks, c.instance_id))


def prefill_locally(prompt_tokens: int, cached_tokens: int, local_prefill_max_tokens: int) -> bool:
    """Whether the decode worker should prefill the uncached part itself."""
    return prompt_tokens - cached_tokens <= local_prefill_max_tokens


def shares_device(a: str, b: str) -> bool:
    """Whether two workers' heartbeat ``device`` ids name the same accelerator (empty: unknown, never)."""
    return bool(a) and a == b


def remote_prefill_workers(uncached_tokens: int, local_prefill_max_tokens: int, decode_device: str,
                           prefill_workers: list[tuple[str, str]],
                           on_shared_device: bool = False) -> tuple[list[str], str]:
    """The prefill workers worth handing this prompt to, in the order given, and when there are none
    why the decode worker prefills it itself. ``prefill_workers``: (instance id, device) of the live
    ones; ``decode_device``: the chosen decode worker's device."""
    if uncached_tokens <= local_prefill_max_tokens:
        return [], (f"{uncached_tokens} uncached tokens (at most --local-prefill-max-tokens "
                    f"{local_prefill_max_tokens}): decode prefills locally")
    if not prefill_workers:
        return [], "no prefill worker is alive: decode prefills locally"
    apart = [i for i, device in prefill_workers if on_shared_device or not shares_device(device, decode_device)]
    if not apart:
        return [], (f"every prefill worker shares the decode worker's device ({decode_device}): decode prefills "
                    "locally, chunked into its decode steps (a separate process would only time-slice the device)")
    return apart, ""
