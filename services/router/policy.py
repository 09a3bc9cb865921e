"""Where a request goes: the router's scoring of decode and prefill workers.

The formula, in the manner of Dynamo's KV router: a worker's cost is the prefill work the request
would still need there plus the work already queued on it, both in blocks of tokens,

    cost = (prompt_blocks - cached_prefix_blocks) + load_weight * (running + waiting + just_placed)

and the cheapest worker wins (ties: more free KV blocks, then instance id). Counting the uncached
blocks rather than the cached ones makes a long shared prefix worth exactly what it saves; the
load term keeps a hot prefix from piling every request onto one worker once its queue costs more
than the recompute. llm-d's prefix-cache and load scorers weigh the same two signals;
``load_weight`` is configuration (``--router-load-weight``).

Conditional disaggregation: when the chosen decode worker would have to prefill at most
``local_prefill_max_tokens`` tokens, it prefills them itself instead of paying for a transfer.
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


def rank(prompt_blocks: int, workers: list[tuple[str, int, int, int]], load_weight: float) -> list[Candidate]:
    """``workers``: (instance id, cached prefix blocks, load, free blocks); cheapest first."""
    candidates = [
        Candidate(instance_id, cached, load, free, (prompt_blocks - cached) + load_weight * load)
        for instance_id, cached, load, free in workers
    ]
    return sorted(candidates, key=lambda c: (c.cost, -c.free_blocks, c.instance_id))


def prefill_locally(prompt_tokens: int, cached_tokens: int, local_prefill_max_tokens: int) -> bool:
    """Whether the decode worker should prefill the uncached part itself."""
    return prompt_tokens - cached_tokens <= local_prefill_max_tokens
