"""The trainer service: training jobs taken over NATS, run one at a time in a worker thread.

``tandem serve trainer --nats-url URL``. Endpoints:

- ``tandem.v1.trainer.start`` (queue group: one trainer takes each job): :class:`TrainStart` ->
  :class:`TrainStatusReply` with the job queued;
- ``tandem.v1.trainer.stop`` and ``.status`` (every trainer hears them; the one that owns the job
  answers at once, the others answer "unknown job" only after ``NOT_MINE_DELAY_S``, so a requester
  gets the owner's reply whenever there is an owner).

While a job runs: :class:`TrainStepMetrics` after every step on ``tandem.v1.trainer.steps.<job>``,
a :class:`TrainTimeline` at most once a second on ``tandem.v1.trainer.timeline.<job>``, and a
:class:`WeightsUpdated` on ``tandem.v1.models.updated`` after every checkpoint (serving workers of
that model reload it). A stopped job saves a checkpoint first, so ``resume`` continues it; so does
the job running when the service is told to stop (SIGTERM, Ctrl-C, SIGHUP): it finishes its step
and saves, however long that takes, before the process exits (a second signal exits at once: the
job's folder then still holds its previous checkpoint, whole, shared/train/checkpoint.py).

What a job from the bus may touch (:func:`confine_job`, before it is queued): it writes only under
the data dir (``output_dir``, default ``<data_dir>/train/<job>``), and it reads its ``dataset`` and
its ``model`` directory only from the folders ``--trainer-read-dirs`` (``TANDEM_TRAINER_READ_DIRS``;
unset: the data dir) names, every file it would read below them included, so a link cannot lead out.
Relative paths count from the data dir (not the service's working directory); the job runs on
the absolute paths, so what was checked is what is read, and its ``WeightsUpdated`` events name
the resolved checkpoint folder. ``stdlib``, ``random`` and the model presets are no paths.
``tandem train`` (tandem/cli/train.py) runs the user's own job in the user's process and goes
through none of this.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tandem.services.common.paths import absolute_path, tree_under_roots, under_data_dir, under_roots
from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.shared.infra.config import BY_FLAT, Settings
from tandem.shared.model.config import ModelLoadError
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.training import (
    TimelineOp,
    TrainJob,
    TrainJobStatus,
    TrainStart,
    TrainStatusReply,
    TrainStatusRequest,
    TrainStop,
    TrainTimeline,
    WeightsUpdated,
)

NOT_MINE_DELAY_S = 0.5
TIMELINE_EVERY_S = 1.0
TEXT_DATASETS = ("stdlib", "random")  # dataset names that are no paths (as text; shared/train/data.py)
_READ_DIRS = BY_FLAT["trainer_read_dirs"]
READ_DIRS_SETTING = f"{_READ_DIRS.flag} / {_READ_DIRS.env}"


@dataclass
class JobRecord:
    job_id: str
    job: TrainJob
    state: str = "queued"
    step: int = 0
    loss: float | None = None
    message: str = ""
    stop: threading.Event = field(default_factory=threading.Event)

    def status(self) -> TrainJobStatus:
        return TrainJobStatus(job_id=self.job_id, state=self.state, step=self.step, steps=self.job.steps,
                              loss=self.loss, message=self.message)


def read_roots(settings: Settings) -> list[Path]:
    """The folders a job from the bus may read: ``trainer.read_dirs``, or the data dir when unset."""
    dirs = settings.trainer.read_dirs
    return list(dirs) if dirs is not None else [Path(settings.data_dir)]


def confine_job(job: TrainJob, job_id: str, settings: Settings) -> TrainJob:
    """``job`` with its paths made absolute (``output_dir`` and ``model`` resolved too, ``output_dir``
    given its default), when it writes only under the data dir and reads only from
    :func:`read_roots`; else :class:`ProtocolError` (``invalid_request``) naming the field and the
    setting to change. Reads the file system (it walks a model directory and a dataset folder)."""
    from tandem.shared.train.data import text_files
    from tandem.shared.train.finetune_data import records_kind
    from tandem.shared.train.presets import PRESETS

    data_dir = settings.data_dir
    output_dir = job.output_dir if job.output_dir is not None else Path(data_dir) / "train" / job_id
    changes: dict[str, str] = {"output_dir": str(under_data_dir(output_dir, data_dir, "job.output_dir"))}
    roots = read_roots(settings)
    # A name the data code reads as a name only as text: with a records format, "stdlib" is a file.
    if not (job.dataset in TEXT_DATASETS and records_kind(job.dataset, job.data_format) is None):
        dataset = under_roots(job.dataset, roots, data_dir, "job.dataset", READ_DIRS_SETTING)
        if dataset.is_dir():  # the files a text folder is read from, exactly (data.py's own listing)
            tree_under_roots(dataset, roots, "job.dataset", READ_DIRS_SETTING, text_files(dataset))
        # absolute, but under its own name: with format auto, a name ending in .jsonl is records
        # even where it links to a file of another name
        changes["dataset"] = str(absolute_path(job.dataset, data_dir))
    if job.model not in PRESETS:
        model = under_roots(job.model, roots, data_dir, "job.model", READ_DIRS_SETTING)
        if (model / "config.json").exists():  # a model directory (else validate_job refuses it): every
            # file of it, the loader's and those a checkpoint copies (tokenizer, chat templates)
            tree_under_roots(model, roots, "job.model", READ_DIRS_SETTING)
        changes["model"] = str(model)
    return job.model_copy(update=changes)


def validate_job(job: TrainJob) -> None:
    """Refuse, with a typed error, what would only fail later in the worker thread. Fine-tuning
    records are read and checked line by line here (not yet tokenized), so a bad line is the
    requester's ``invalid_request`` naming it, not a failed job."""
    from tandem.shared.train.finetune_data import read_records, records_kind
    from tandem.shared.train.loop import resolve_device
    from tandem.shared.train.presets import resolve_model

    resolve_device(job.device)
    try:
        resolve_model(job.model)
    except ModelLoadError as exc:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    if job.lora_rank is not None:
        from tandem.shared.lora.peft_format import AdapterError
        from tandem.shared.train.lora import check_targets

        try:
            check_targets(job.lora_targets)
        except AdapterError as exc:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, str(exc)) from None
    kind = records_kind(job.dataset, job.data_format)
    if kind is not None:
        read_records(Path(job.dataset), kind)
    elif job.dataset not in ("stdlib", "random") and not Path(job.dataset).exists():
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"dataset {job.dataset!r} does not exist")


class TrainerService(ServiceRuntime):
    name = "trainer"
    description = "trains models larger than GPU memory by streaming layers from host RAM"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        if settings.engine.torch_threads:
            import torch

            torch.set_num_threads(settings.engine.torch_threads)
        self.jobs: dict[str, JobRecord] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._work, name="trainer", daemon=True)

    async def setup(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.add_endpoint("start", subjects.TRAINER_START, self._on_start, queue_group="trainer")
        # Plain subscriptions (no queue group): every trainer must hear stop and status.
        await self.add_endpoint("stop", subjects.TRAINER_STOP, self._on_stop, bulk=True)
        await self.add_endpoint("status", subjects.TRAINER_STATUS, self._on_status, bulk=True)
        self._worker.start()

    async def teardown(self) -> None:
        for record in self.jobs.values():
            if record.state == "running":
                record.state = "stopping"
                self.log.info("job %s: stopping with the service: finishing its step, then saving a checkpoint",
                              record.job_id)
            record.stop.set()
        self._queue.put(None)
        # No time limit: a cut-short save would lose the step's work (a large model's checkpoint
        # takes minutes to write); the operator's second signal still exits at once.
        await asyncio.get_running_loop().run_in_executor(None, self._worker.join)

    def metrics(self) -> dict:
        states = [r.state for r in self.jobs.values()]
        return {"jobs": len(states), **{s: states.count(s) for s in set(states)}}

    def _reply(self, records: list[JobRecord]) -> bytes:
        return encode(TrainStatusReply(trainer=self.instance_id, jobs=[r.status() for r in records]))

    # -- endpoints ----------------------------------------------------------------------------------
    async def _on_start(self, request) -> None:  # noqa: ANN001
        msg = decode(request.data, TrainStart)
        if msg.job_id in self.jobs:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"job id {msg.job_id!r} is already in use")
        job = await asyncio.to_thread(confine_job, msg.job, msg.job_id, self.settings)
        await asyncio.to_thread(validate_job, job)
        if msg.job_id in self.jobs:  # taken while this one was being checked
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"job id {msg.job_id!r} is already in use")
        record = self.jobs[msg.job_id] = JobRecord(msg.job_id, job)
        self._queue.put(record)
        self.log.info("job %s queued: %s, %d steps", msg.job_id, job.model, job.steps)
        await request.respond(self._reply([record]))

    async def _on_stop(self, request) -> None:  # noqa: ANN001
        msg = decode(request.data, TrainStop)
        record = self.jobs.get(msg.job_id)
        if record is None:
            self.spawn(self._late_unknown(request, msg.job_id), "unknown-job reply")
            return
        if record.state == "queued":
            record.state = "stopped"
        elif record.state == "running":
            record.state = "stopping"
        record.stop.set()
        self.log.info("job %s: stop requested (%s)", msg.job_id, record.state)
        await request.respond(self._reply([record]))

    async def _on_status(self, request) -> None:  # noqa: ANN001
        msg = decode(request.data, TrainStatusRequest)
        if msg.job_id is None:
            await request.respond(self._reply(list(self.jobs.values())))
        elif msg.job_id in self.jobs:
            await request.respond(self._reply([self.jobs[msg.job_id]]))
        else:
            self.spawn(self._late_unknown(request, msg.job_id), "unknown-job reply")

    async def _late_unknown(self, request, job_id: str) -> None:  # noqa: ANN001
        await asyncio.sleep(NOT_MINE_DELAY_S)
        from tandem.shared.protocol.codec import error_reply

        await request.respond(encode(error_reply(ProtocolError(ErrorCode.INVALID_REQUEST,
                                                               f"no trainer has job {job_id!r}"))))

    # -- the worker thread ---------------------------------------------------------------------------
    def _publish(self, subject: str, payload: bytes) -> None:
        asyncio.run_coroutine_threadsafe(self.nc.publish(subject, payload), self.loop)

    def _publish_adapter(self, name: str, path: Path, version: str) -> None:
        """From the training thread: a copy of the adapter checkpoint in ``path`` published through the
        routers as version ``version`` of adapter ``name`` (the job goes on whatever they answer)."""
        from tandem.client import Client, TandemError
        from tandem.shared.lora.peft_format import snapshot_adapter

        snapshot = under_data_dir(snapshot_adapter(path, version), self.settings.data_dir, "adapter path")
        done = asyncio.run_coroutine_threadsafe(
            Client(self.nc).load_adapter(name, snapshot, version, source="trainer"), self.loop)
        try:
            record = done.result()
        except (TandemError, OSError) as exc:
            self.log.warning("publishing adapter %s version %s failed: %s", name, version, exc)
            return
        self.log.info("published adapter %s version %s from %s", record.name, record.version, record.path)

    def _work(self) -> None:
        while (record := self._queue.get()) is not None:
            if record.stop.is_set():
                record.state = "stopped"
                continue
            record.state = "running"
            try:
                self._run(record)
            except ProtocolError as exc:  # refused as asked (a record the tokenizer or template rejects, a plan)
                self.log.warning("job %s refused: %s", record.job_id, exc.message)
                record.state, record.message = "failed", exc.message
            except Exception as exc:  # a failed job never takes the service down
                self.log.exception("job %s failed", record.job_id)
                record.state, record.message = "failed", f"{type(exc).__name__}: {exc}"

    def _run(self, record: JobRecord) -> None:
        from tandem.shared.train.loop import TrainLoop

        runner = TrainLoop(record.job, record.job_id, self.settings.data_dir)
        job_id = record.job_id

        def on_step(metrics) -> None:  # noqa: ANN001
            record.step, record.loss = metrics.step, metrics.loss
            self._publish(subjects.trainer_steps(job_id), encode(metrics))

        def on_trace(step: int, ops: list[TimelineOp], hidden: float) -> None:
            msg = TrainTimeline(job_id=job_id, step=step, ops=ops, hidden_fraction=hidden)
            self._publish(subjects.trainer_timeline(job_id), encode(msg))

        def on_checkpoint(path: Path, step: int) -> None:
            if record.job.lora_rank is not None:  # an adapter, not a model for the workers to reload ...
                if record.job.publish_adapter is not None:  # ... but one to serve, if asked
                    self._publish_adapter(record.job.publish_adapter, path, f"{job_id}.{step}")
                return
            # under the data dir by confine_job; checked again, so no event ever names another folder
            path = under_data_dir(path, self.settings.data_dir, "checkpoint path")
            msg = WeightsUpdated(model=runner.model_name, path=str(path), step=step, version=f"{job_id}.{step}")
            self._publish(subjects.WEIGHTS_UPDATED, encode(msg))

        summary = runner.run(on_step=on_step, on_trace=on_trace, on_checkpoint=on_checkpoint,
                             should_stop=record.stop.is_set, trace_every_s=TIMELINE_EVERY_S)
        record.state, record.step = summary.state, summary.step
        record.message = f"checkpoint {summary.checkpoint}" if summary.checkpoint else ""
        self.log.info("job %s %s at step %d (%.1fs)", job_id, summary.state, summary.step, summary.wall_s)


def main(settings: Settings) -> None:
    run_service(TrainerService(settings))
