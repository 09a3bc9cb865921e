"""A tensor-parallel group for a test module: rank 0 in the test process, the others followers
(``from tensor_parallel_support import sharded_model``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tandem.shared.engine.tp_ranks import RankJob, dismiss, lead
from tandem.shared.model.loader import LoadedModel, load_model
from tandem.shared.parallel.sharding import sharder


@contextmanager
def sharded_model(model: str, size: int, data_dir: str, device: str = "cpu",
                  dtype: str = "float32") -> Iterator[LoadedModel]:
    """Rank 0's share of ``model`` with ranks 1..``size``-1 following; every engine built over it
    builds the followers' runners too. One group per process at a time (torch.distributed's
    default group), so one per module. Checks at the end that every follower left cleanly."""
    job = RankJob(model=model, data_dir=data_dir, dtype=dtype, quantization="none", torch_threads=1,
                  engine={"num_blocks": 64})
    group, followers = lead(job, size, torch.device(device))
    try:
        loaded = load_model(model, device=device, dtype=getattr(torch, dtype), data_dir=data_dir,
                            shard=sharder(group))
        assert group.min_over_ranks(64) == 64
        yield loaded
    finally:
        dismiss(group, followers)
    assert all(p.returncode == 0 for p in followers.processes), "a follower rank ended with an error"
