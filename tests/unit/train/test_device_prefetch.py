"""The streamed layers' state prefetch (device_update.py): the pieces the backward submits one at a
time cover each buffer set's master and moments exactly, for the first streamed layers only, and
what the backward leaves unsent is sent by ``issue``.

Run: ``python -m pytest -q tests/unit/train/test_device_prefetch.py``.
"""

from __future__ import annotations

import pytest
import torch

from tandem.shared.model.config import ModelConfig
from tandem.shared.train.device_update import STATE, DeviceUpdater
from tandem.shared.train.host_state import HostState
from tandem.shared.train.lanes import Lanes, StepTrace
from tandem.shared.train.optimizer import HostAdamW

CFG = ModelConfig.tiny().replace(num_layers=5, tie_word_embeddings=False)


def updater(work_dtype: torch.dtype, resident: int, layers: int, sets: int) -> DeviceUpdater:
    state = HostState.random(CFG, seed=3, work_dtype=work_dtype, pin=False)
    for unit in state.units:  # moments unlike the masters, so a piece copied into the wrong tensor shows
        unit.exp_avg.normal_(generator=torch.Generator().manual_seed(1))
        unit.exp_avg_sq.uniform_(generator=torch.Generator().manual_seed(2))
    opt = HostAdamW(state, lambda step: 1e-3, 0.0, 1.0)
    cpu = torch.device("cpu")
    return DeviceUpdater(state, opt, Lanes(cpu), cpu, layers, sets=sets, resident=resident)


@pytest.mark.parametrize("work_dtype,pieces_per_tensor", [(torch.bfloat16, 2), (torch.float32, 1)])
@pytest.mark.parametrize("resident,layers,sets", [(0, 3, 2), (1, 4, 2), (2, 3, 1)])
def test_prefetch_pieces_fill_each_set_with_its_layers_state(work_dtype, pieces_per_tensor, resident, layers, sets):
    up = updater(work_dtype, resident, layers, sets)
    used = min(sets, layers - resident)
    for buffers in up.sets:  # whatever a set held before must be overwritten
        for tensor in buffers[:3]:
            tensor.fill_(float("nan"))
    up.arm_prefetch()
    assert len(up.prefetch_queue) == used * len(STATE) * pieces_per_tensor, up.prefetch_queue
    trace = StepTrace(up.lanes, False)
    while up.prefetch_queue:
        up.prefetch(trace)
    assert sorted(up.prefetched) == list(range(resident, resident + used)), "one event per prefetched layer"
    for j in range(resident, resident + used):
        unit = up.state.units[j + 1]
        buffers = up.sets[(j - resident) % len(up.sets)]
        for index, name in enumerate(STATE):
            assert torch.equal(buffers[index], getattr(unit, name)), f"layer {j}'s {name} differs in its set"


def test_issue_sends_what_the_backward_left_and_consumes_the_prefetch():
    """A backward shorter than the queue (a model with few layers) leaves pieces; ``issue`` sends
    them before it updates, and the update then matches one made without any prefetch."""
    results = []
    for prefetch_some in (False, True):
        up = updater(torch.bfloat16, resident=0, layers=3, sets=2)
        sumsq = torch.zeros(len(up.state.units), dtype=torch.float64)
        for grads in up.grads:
            grads.copy_(torch.randn(grads.shape, generator=torch.Generator().manual_seed(4)))
        trace = StepTrace(up.lanes, False)
        if prefetch_some:
            up.arm_prefetch()
            for _ in range(3):
                up.prefetch(trace)
            assert up.prefetch_queue, "the test means to leave pieces for issue"
        up.issue(1, sumsq, None, trace)
        assert not up.prefetch_queue and not up.prefetched, "issue sends and uses every prefetched piece"
        results.append([getattr(up.state.units[j + 1], name).clone() for j in range(3) for name in (*STATE, "work")])
    assert all(torch.equal(a, b) for a, b in zip(*results)), "prefetching changed the update"
