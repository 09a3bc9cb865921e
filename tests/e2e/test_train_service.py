"""The trainer service over a real nats-server: start, status, stop, per-step metrics, timelines,
weights-updated events, and typed errors for bad input.

Run: ``python -m pytest -q tests/e2e/test_train_service.py``.
"""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import nats
import pytest
from cli_support import launch, run_sync, service_env

from tandem.shared.model.loader import load_model
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import SCHEMA_VERSION, ErrorCode, ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.training import (
    TrainJob,
    TrainStart,
    TrainStatusReply,
    TrainStatusRequest,
    TrainStepMetrics,
    TrainStop,
    TrainTimeline,
    WeightsUpdated,
)
from tandem.supervisor import ping_services


@pytest.fixture(scope="module")
def trainer(nats_server, data_dir, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("trainer-logs")
    proc = launch(nats_server.url, "trainer", "trainer-t0", logdir, service_env(data_dir), [])

    async def ready() -> None:
        nc = await nats.connect(nats_server.url)
        deadline = time.monotonic() + 60
        while (await ping_services(nc)).get("tandem-trainer", 0) < 1:
            assert proc.poll() is None, (logdir / "trainer-t0.log").read_text()
            assert time.monotonic() < deadline, "trainer did not answer $SRV.PING"
            await asyncio.sleep(0.2)
        await nc.close()

    run_sync(ready())
    yield nats_server.url, data_dir / "trainer-out"  # bus jobs write under the data dir only
    proc.terminate()
    proc.wait(30)


def small_job(out, **extra) -> TrainJob:  # noqa: ANN001
    fields = dict(model="tiny", dataset="random", steps=6, batch_size=2, seq_len=32, device="cpu", output_dir=str(out))
    return TrainJob(**(fields | extra))


def collect(into: list, kind=None):  # noqa: ANN001, ANN201
    """A subscription callback that decodes each message into ``into``."""
    async def cb(msg) -> None:  # noqa: ANN001
        into.append(decode(msg.data, kind))
    return cb


async def request(nc, subject: str, payload: bytes, timeout: float = 10.0):  # noqa: ANN001, ANN201
    reply = await nc.request(subject, payload, timeout=timeout)
    return decode(reply.data)


async def wait_state(nc, job_id: str, states: set[str], timeout_s: float = 60.0) -> TrainStatusReply:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while True:
        reply = await request(nc, subjects.TRAINER_STATUS, encode(TrainStatusRequest(job_id=job_id)))
        assert isinstance(reply, TrainStatusReply), reply
        if reply.jobs[0].state in states:
            return reply
        assert time.monotonic() < deadline, f"job {job_id} stuck in {reply.jobs[0]}"
        await asyncio.sleep(0.1)


async def test_job_streams_metrics_timeline_and_checkpoints(trainer):
    url, out = trainer
    nc = await nats.connect(url)
    steps, timelines, updates = [], [], []
    await nc.subscribe(subjects.trainer_steps("svc-a"), cb=collect(steps, TrainStepMetrics))
    await nc.subscribe(subjects.trainer_timeline("svc-a"), cb=collect(timelines, TrainTimeline))
    await nc.subscribe(subjects.WEIGHTS_UPDATED, cb=collect(updates, WeightsUpdated))
    job = small_job(out / "a", checkpoint_every=3)
    reply = await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id="svc-a", job=job)))
    assert isinstance(reply, TrainStatusReply) and reply.trainer == "trainer-t0"
    assert reply.jobs[0].job_id == "svc-a" and reply.jobs[0].state in ("queued", "running")
    final = await wait_state(nc, "svc-a", {"finished", "failed"})
    await asyncio.sleep(0.3)  # the last events are published just before the state flips
    await nc.close()
    assert final.jobs[0].state == "finished" and final.jobs[0].step == 6, final.jobs[0]
    assert [m.step for m in steps] == [1, 2, 3, 4, 5, 6]
    assert all(m.loss > 0 and m.tokens_per_s > 0 and m.model_tflops > 0 for m in steps)
    assert timelines, "at least one timeline (the first step's) is published"
    lanes = {op.lane for op in timelines[0].ops}
    assert lanes == {"h2d", "compute", "d2h", "optimizer"} and 0.0 <= timelines[0].hidden_fraction <= 1.0
    assert [(u.model, u.step) for u in updates] == [("tiny", 3), ("tiny", 6)]
    assert updates[0].version != updates[1].version
    loaded = load_model(updates[-1].path)
    assert loaded.config.num_layers == 4


async def test_stop_saves_a_checkpoint_that_resumes(trainer):
    url, out = trainer
    nc = await nats.connect(url)
    steps = []
    await nc.subscribe(subjects.trainer_steps("svc-long"), cb=collect(steps))
    job = small_job(out / "long", steps=100000)
    await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id="svc-long", job=job)))
    deadline = time.monotonic() + 60
    while len(steps) < 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    reply = await request(nc, subjects.TRAINER_STOP, encode(TrainStop(job_id="svc-long")))
    assert reply.jobs[0].state in ("stopping", "stopped")
    stopped = (await wait_state(nc, "svc-long", {"stopped", "failed"})).jobs[0]
    assert stopped.state == "stopped" and stopped.step >= 2
    resumed = small_job(out / "long", steps=stopped.step + 2, resume=True)
    await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id="svc-long-2", job=resumed)))
    done = (await wait_state(nc, "svc-long-2", {"finished", "failed"})).jobs[0]
    await nc.close()
    assert done.state == "finished" and done.step == stopped.step + 2, done


async def test_bad_input_gets_typed_errors_and_the_trainer_lives_on(trainer):
    url, out = trainer
    nc = await nats.connect(url)
    cases = [
        (subjects.TRAINER_START, b"\xc1 not msgpack", ErrorCode.BAD_FRAME),
        (subjects.TRAINER_START, encode(TrainStop(job_id="x")), ErrorCode.BAD_SCHEMA),
        (subjects.TRAINER_START, encode(TrainStart(job_id="bad-model", job=small_job(out, model="nope"))),
         ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_START, encode(TrainStart(job_id="bad-data", job=small_job(out, dataset="/no/such/dir"))),
         ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_START, encode(TrainStart(job_id="escape", job=small_job(out / ".." / ".." / "etc-tandem"))),
         ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_START, encode(TrainStart(job_id="abs", job=small_job("/tmp/anywhere"))),
         ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_START, msgpack.packb({"v": SCHEMA_VERSION, "kind": "train_start", "job_id": "zero",
                                                "job": {"steps": 0}}), ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_START, msgpack.packb({"v": SCHEMA_VERSION, "kind": "train_start", "job_id": "a b"}),
         ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_STOP, msgpack.packb({"v": SCHEMA_VERSION, "kind": "train_stop"}), ErrorCode.BAD_SCHEMA),
        (subjects.TRAINER_STATUS, encode(TrainStatusRequest(job_id="never-started")), ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_STOP, encode(TrainStop(job_id="never-started")), ErrorCode.INVALID_REQUEST),
    ]
    for subject, payload, code in cases:
        reply = await request(nc, subject, payload)
        assert isinstance(reply, ErrorReply) and reply.code == code, (subject, payload[:40], reply)
    await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id="dup", job=small_job(out / "dup", steps=1))))
    reply = await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id="dup", job=small_job(out / "dup"))))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INVALID_REQUEST and "in use" in reply.message
    everything = await request(nc, subjects.TRAINER_STATUS, encode(TrainStatusRequest()))
    await nc.close()
    assert isinstance(everything, TrainStatusReply) and "dup" in {j.job_id for j in everything.jobs}


async def test_fine_tuning_records_over_the_bus(trainer, tmp_path):
    """A JSONL job trains; a file with a bad line is refused at start, the reply naming the line."""
    url, out = trainer
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    good.write_text(json.dumps(chat) + "\n" + json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    bad.write_text(json.dumps(chat) + "\n" + '{"messages": [\n')
    nc = await nats.connect(url)
    refused = await request(nc, subjects.TRAINER_START,
                            encode(TrainStart(job_id="ft-bad", job=small_job(out / "ft-bad", dataset=str(bad)))))
    assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.INVALID_REQUEST, refused
    assert "bad.jsonl line 2: is not JSON" in refused.message, refused.message
    job = small_job(out / "ft-good", dataset=str(good), steps=2)
    started = await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id="ft-good", job=job)))
    assert isinstance(started, TrainStatusReply), started
    final = await wait_state(nc, "ft-good", {"finished", "failed"})
    await nc.close()
    assert final.jobs[0].state == "finished" and final.jobs[0].step == 2, final.jobs[0]
