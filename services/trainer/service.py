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
that model reload it). A stopped job saves a checkpoint first, so ``resume`` continues it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tandem.services.common.paths import under_data_dir
from tandem.services.common.runtime import ServiceRuntime, run_service
from tandem.shared.infra.config import Settings
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


def validate_job(job: TrainJob) -> None:
    """Refuse, with a typed error, what would only fail later in the worker thread. Fine-tuning
    records are read and checked line by line here (not yet tokenized), so a bad line is the
    requester's ``invalid_request`` naming it, not a failed job."""
    from tandem.shared.train.finetune_data import read_records, records_kind
    from tandem.shared.train.presets import resolve_model
    from tandem.shared.train.runner import resolve_device

    resolve_device(job.device)
    try:
        resolve_model(job.model)
    except ModelLoadError as exc:
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
            record.stop.set()
        self._queue.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._worker.join, 60)

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
        if msg.job.output_dir is not None:
            under_data_dir(msg.job.output_dir, self.settings.data_dir, "job.output_dir")
        await asyncio.to_thread(validate_job, msg.job)
        record = self.jobs[msg.job_id] = JobRecord(msg.job_id, msg.job)
        self._queue.put(record)
        self.log.info("job %s queued: %s, %d steps", msg.job_id, msg.job.model, msg.job.steps)
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
        from tandem.shared.train.runner import TrainRunner

        runner = TrainRunner(record.job, record.job_id, self.settings.data_dir)
        job_id = record.job_id

        def on_step(metrics) -> None:  # noqa: ANN001
            record.step, record.loss = metrics.step, metrics.loss
            self._publish(subjects.trainer_steps(job_id), encode(metrics))

        def on_trace(step: int, ops: list[TimelineOp], hidden: float) -> None:
            msg = TrainTimeline(job_id=job_id, step=step, ops=ops, hidden_fraction=hidden)
            self._publish(subjects.trainer_timeline(job_id), encode(msg))

        def on_checkpoint(path: Path, step: int) -> None:
            msg = WeightsUpdated(model=runner.model_name, path=str(path), step=step, version=f"{job_id}.{step}")
            self._publish(subjects.WEIGHTS_UPDATED, encode(msg))

        summary = runner.run(on_step=on_step, on_trace=on_trace, on_checkpoint=on_checkpoint,
                             should_stop=record.stop.is_set, trace_every_s=TIMELINE_EVERY_S)
        record.state, record.step = summary.state, summary.step
        record.message = f"checkpoint {summary.checkpoint}" if summary.checkpoint else ""
        self.log.info("job %s %s at step %d (%.1fs)", job_id, summary.state, summary.step, summary.wall_s)


def main(settings: Settings) -> None:
    run_service(TrainerService(settings))
