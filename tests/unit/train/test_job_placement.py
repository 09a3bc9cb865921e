"""A job's placement fields, as they arrive over the bus: ``device_update_layers`` and
``device_resident_layers`` of a :class:`TrainJob` become the plan's placement as given, and an
impossible pair is refused in one line before anything is allocated."""

from __future__ import annotations

import pytest

from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.training import TrainJob, TrainStart
from tandem.shared.train.loop import plan_job


def job(tmp_path, **placement) -> TrainJob:  # noqa: ANN001
    return TrainJob(model="tiny", dataset="random", steps=2, batch_size=2, seq_len=32, device="cpu",
                    output_dir=str(tmp_path / "out"), **placement)


@pytest.mark.parametrize(("fields", "expected"), [
    ({"device_resident_layers": 2}, (2, 2)),  # given alone: that many GPU-updated too
    ({"device_update_layers": 3, "device_resident_layers": 1}, (1, 3)),
    ({"device_update_layers": 3}, (0, 3)),  # given alone: none resident
    ({"device_update_layers": 2, "device_resident_layers": 0}, (0, 2)),
], ids=["resident-alone", "both", "updated-alone", "zero-resident"])
def test_the_jobs_placement_is_the_plans(tmp_path, fields: dict, expected: tuple[int, int]) -> None:
    sent = TrainStart(job_id="j", job=job(tmp_path, **fields))
    received = decode(encode(sent), TrainStart).job  # as the trainer service gets it
    placement = plan_job(received, tmp_path / "out").placement
    assert (placement.resident, placement.device_update) == expected, placement


def test_more_resident_than_updated_layers_is_refused_in_one_line(tmp_path) -> None:
    with pytest.raises(ProtocolError) as err:
        plan_job(job(tmp_path, device_update_layers=1, device_resident_layers=2), tmp_path / "out")
    assert err.value.code == ErrorCode.INVALID_REQUEST and "\n" not in err.value.message
    assert "--device-resident-layers" in err.value.message, err.value.message
