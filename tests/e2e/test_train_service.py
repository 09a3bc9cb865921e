"""The trainer service over a real nats-server: start, status, stop, per-step metrics, timelines,
weights-updated events, typed errors for bad input, and a job reading its dataset and model only
from the folders ``--trainer-read-dirs`` names (links that lead out refused).

Run: ``python -m pytest -q tests/e2e/test_train_service.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import msgpack
import nats
import pytest
from cli_support import launch, run_sync, service_env
from model_support import make_hf_checkpoint

from tandem.cli.supervisor import ping_services
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

SECRET = "root:$6$not-for-the-bus:19000:0:99999:7:::"
CHAT = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


class Trainer(NamedTuple):
    url: str
    out: Path  # where bus jobs write (under the data dir)
    data_dir: Path
    extra: Path  # the read root --trainer-read-dirs adds to the data dir
    outside: Path  # neither: what a job must not read


@pytest.fixture(scope="module")
def places(data_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    """``(inside, extra, outside)``: ``inside`` is a folder of the data dir holding links that lead to
    ``outside`` beside clean data and a model directory; ``extra`` is an allowed root of its own."""
    inside, extra, outside = data_dir / "trainer-in", tmp_path_factory.mktemp("extra-root"), tmp_path_factory.mktemp(
        "outside")
    (outside / "secret.txt").write_text(SECRET + "\n")
    (outside / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    (outside / "texts").mkdir()
    (outside / "texts" / "a.txt").write_text(SECRET)
    (extra / "notes.txt").write_text("def f(x):\n    return x + 1\n" * 20)
    (extra / "chat.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps({"prompt": "1+1=", "completion": "2"}))
    (inside / "clean").mkdir(parents=True)
    (inside / "clean" / "a.txt").write_text("print('hello')\n" * 20)
    (inside / "clean" / "b.md").write_text("# notes\n" * 20)
    (inside / "link-out.txt").symlink_to(outside / "secret.txt")
    (inside / "link-out-dir").symlink_to(outside / "texts", target_is_directory=True)
    (inside / "leaky").mkdir()
    (inside / "leaky" / "a.txt").write_text("print('hello')\n" * 20)
    (inside / "leaky" / "b.txt").symlink_to(outside / "secret.txt")
    make_hf_checkpoint("llama3", inside / "model")
    shutil.copytree(inside / "model", outside / "model")
    shutil.copytree(inside / "model", inside / "model-leaky")
    (inside / "model-leaky" / "chat_template.jinja").symlink_to(outside / "secret.txt")  # copied into checkpoints
    (inside / "model-link").symlink_to(outside / "model", target_is_directory=True)
    (data_dir / "stdlib").symlink_to(outside / "chat.jsonl")
    return inside, extra, outside


@pytest.fixture(scope="module")
def trainer(nats_server, data_dir, places, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("trainer-logs")
    _, extra, outside = places
    read_dirs = ["--trainer-read-dirs", f"{data_dir}{os.pathsep}{extra}"]
    proc = launch(nats_server.url, "trainer", "trainer-t0", logdir, service_env(data_dir), read_dirs)

    async def ready() -> None:
        nc = await nats.connect(nats_server.url)
        deadline = time.monotonic() + 60
        while (await ping_services(nc)).get("tandem-trainer", 0) < 1:
            assert proc.poll() is None, (logdir / "trainer-t0.log").read_text()
            assert time.monotonic() < deadline, "trainer did not answer $SRV.PING"
            await asyncio.sleep(0.2)
        await nc.close()

    run_sync(ready())
    # bus jobs write under the data dir only
    yield Trainer(nats_server.url, data_dir / "trainer-out", data_dir, extra, outside)
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
    url, out = trainer.url, trainer.out
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
    # events name the resolved checkpoint folder, under the data dir, where workers accept it
    assert {u.path for u in updates} == {str((out / "a").resolve())}
    loaded = load_model(updates[-1].path)
    assert loaded.config.num_layers == 4


async def test_stop_saves_a_checkpoint_that_resumes(trainer):
    url, out = trainer.url, trainer.out
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
    url, out = trainer.url, trainer.out
    nc = await nats.connect(url)
    cases = [
        (subjects.TRAINER_START, b"\xc1 not msgpack", ErrorCode.BAD_FRAME),
        (subjects.TRAINER_START, encode(TrainStop(job_id="x")), ErrorCode.BAD_SCHEMA),
        (subjects.TRAINER_START, encode(TrainStart(job_id="bad-model", job=small_job(out, model="nope"))),
         ErrorCode.INVALID_REQUEST),
        (subjects.TRAINER_START,
         encode(TrainStart(job_id="bad-data", job=small_job(out, dataset=str(out / "no-such")))),
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


async def test_fine_tuning_records_over_the_bus(trainer):
    """A JSONL job trains; a file with a bad line is refused at start, the reply naming the line."""
    url, out = trainer.url, trainer.out
    good, bad = trainer.extra / "good.jsonl", trainer.extra / "bad.jsonl"
    good.write_text(json.dumps(CHAT) + "\n" + json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    bad.write_text(json.dumps(CHAT) + "\n" + '{"messages": [\n')
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


# Jobs that would read outside the allowed folders: (id, the job's fields, the field refused).
# {inside}: a folder of the data dir; {outside}: neither the data dir nor the extra root.
REFUSED = [
    ("dataset-outside", dict(dataset="{outside}/secret.txt"), "job.dataset"),
    ("dataset-etc-shadow", dict(dataset="/etc/shadow"), "job.dataset"),
    ("dataset-relative-escape", dict(dataset="{outside_from_data}/secret.txt"), "job.dataset"),
    ("dataset-jsonl-outside", dict(dataset="{outside}/chat.jsonl"), "job.dataset"),
    ("dataset-folder-outside", dict(dataset="{outside}/texts"), "job.dataset"),
    ("dataset-link-in-data-dir", dict(dataset="{inside}/link-out.txt"), "job.dataset"),
    ("dataset-linked-folder", dict(dataset="{inside}/link-out-dir"), "job.dataset"),
    ("dataset-folder-with-link-out", dict(dataset="{inside}/leaky"), "job.dataset"),
    # as records, "stdlib" is no name but the file <data dir>/stdlib: here a link out
    ("dataset-stdlib-as-records", dict(dataset="stdlib", data_format="chat"), "job.dataset"),
    ("model-outside", dict(model="{outside}/model"), "job.model"),
    ("model-link-in-data-dir", dict(model="{inside}/model-link"), "job.model"),
    ("model-file-leads-out", dict(model="{inside}/model-leaky"), "job.model"),
]


def fill(fields: dict, trainer: Trainer) -> dict:
    where = dict(inside=str(trainer.data_dir / "trainer-in"), outside=str(trainer.outside),
                 outside_from_data=os.path.relpath(trainer.outside, trainer.data_dir))
    return {k: v.format(**where) if isinstance(v, str) else v for k, v in fields.items()}


@pytest.mark.parametrize(("case", "fields", "field"), REFUSED, ids=[row[0] for row in REFUSED])
async def test_a_job_reads_nothing_outside_the_allowed_folders(trainer, places, case, fields, field):
    """Refused before it is queued, in one typed line naming the field and the setting that allows
    more; nothing of the file comes back; the trainer takes the next good job."""
    nc = await nats.connect(trainer.url)
    job = small_job(trainer.out / case, **fill(fields, trainer))
    reply = await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id=f"read-{case}", job=job)))
    assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.INVALID_REQUEST, reply
    assert reply.param == field and reply.message.startswith(field), reply.message
    assert "--trainer-read-dirs / TANDEM_TRAINER_READ_DIRS" in reply.message, reply.message
    assert "not-for-the-bus" not in reply.message
    status = await request(nc, subjects.TRAINER_STATUS, encode(TrainStatusRequest(job_id=f"read-{case}")), 5)
    assert isinstance(status, ErrorReply), "a refused job is not queued"
    good = small_job(trainer.out / f"{case}-next", dataset=str(trainer.extra / "notes.txt"), steps=1)
    nxt = await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id=f"read-{case}-next", job=good)))
    await nc.close()
    assert isinstance(nxt, TrainStatusReply) and nxt.jobs[0].job_id == f"read-{case}-next", nxt
    assert not (trainer.out / case).exists()


# Jobs that read only from the allowed folders: (id, the job's fields).
ACCEPTED = [
    ("extra-root-text", dict(dataset="{extra}/notes.txt")),
    ("extra-root-records", dict(dataset="{extra}/chat.jsonl")),
    ("data-dir-folder-relative", dict(dataset="trainer-in/clean")),  # relative: from the data dir
    ("model-in-data-dir", dict(model="{inside}/model", dataset="{extra}/notes.txt")),
    # slow: the whole standard library read as the dataset, ~2.5 s on 2 cores; .ci/run runs it
    pytest.param("stdlib-and-a-preset", dict(model="tiny", dataset="stdlib"), marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("case", "fields"), ACCEPTED,
                         ids=[row.values[0] if hasattr(row, "values") else row[0] for row in ACCEPTED])
async def test_a_job_reading_from_the_allowed_folders_trains(trainer, places, case, fields):
    where = dict(inside=str(trainer.data_dir / "trainer-in"), extra=str(trainer.extra))
    job = small_job(trainer.out / case, steps=2, **{k: v.format(**where) for k, v in fields.items()})
    nc = await nats.connect(trainer.url)
    started = await request(nc, subjects.TRAINER_START, encode(TrainStart(job_id=f"ok-{case}", job=job)))
    assert isinstance(started, TrainStatusReply), started
    final = (await wait_state(nc, f"ok-{case}", {"finished", "failed"}, timeout_s=120)).jobs[0]
    await nc.close()
    assert final.state == "finished" and final.step == 2, final
    assert load_model(str(trainer.out / case)).config.num_layers == (2 if case == "model-in-data-dir" else 4)
