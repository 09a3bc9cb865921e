"""A process's bulk NATS connections: KV frames striped across them, sent and landed from their threads.

One :class:`tandem.shared.kvtransfer.bulkconn.BulkConnection` is one socket and, on each side of it,
one core's worth of copying at most; :class:`BulkLinks` holds ``size`` of them to the server the
service's own nats-py connection uses, with its identity, and is what
:func:`tandem.shared.kvtransfer.frames.send_kv` takes as ``links``:

- :meth:`BulkLinks.publish` sends each frame on the next connection in turn, from that
  connection's own writer thread (the frame's checksums are computed there once it is out, while
  the receiver lands it);
- :meth:`BulkLinks.serve_kv` subscribes every connection to a subject in one queue group, so each
  frame goes to one of them, and lands it from that connection's reader thread straight into the
  :class:`tandem.shared.kvtransfer.frames.KVReceiver`'s buffer, its blocks checksummed on a pool of
  ``check_threads`` while the reader reads on, replying (credit or typed error) on the same
  connection.

A connection that breaks fails the frames it was carrying (the transfer's sender gets a typed
error); a keeper task opens a new one within a second or so and subscribes it again, so a restarted
server is rejoined as nats-py rejoins it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tandem.shared.infra.log_limit import LimitedLog
from tandem.shared.kvtransfer.bulkconn import (
    Buffer,
    BulkConnection,
    BulkConnectionError,
    Delivery,
    Handler,
    PayloadReader,
)
from tandem.shared.kvtransfer.frames import KVReceiver, error_payload
from tandem.shared.protocol.base import ErrorCode, ProtocolError

log = logging.getLogger("tandem.bulklinks")
limited = LimitedLog(log)  # a sender's frames can repeat a refusal's line

REOPEN_S = 1.0  # how often the keeper looks for broken connections


@dataclass
class _Slot:
    index: int
    writer: ThreadPoolExecutor  # one thread: this connection's publishes, in order
    conn: BulkConnection | None = None
    sids: dict[int, int] = field(default_factory=dict)  # subscription key -> this connection's sid


@dataclass
class _Subscription:
    subject: str
    queue: str
    make_handler: Callable[[BulkConnection], Handler]


class BulkSubscription:
    """What :meth:`BulkLinks.serve_kv` returns; :meth:`unsubscribe` ends it on every connection."""

    def __init__(self, links: BulkLinks, key: int) -> None:
        self._links, self._key = links, key

    async def unsubscribe(self) -> None:
        await self._links._unsubscribe(self._key)


class BulkLinks:
    """``size`` bulk connections to ``url()`` (called at each (re)connect: the server the service's
    own connection is on now), presenting ``options`` (nats.connect's identity and TLS keywords)."""

    def __init__(self, url: Callable[[], str], *, options: dict[str, Any] | None = None, name: str = "tandem",
                 size: int = 4, check_threads: int = 4, timeout_s: float = 10.0) -> None:
        self._url, self._options, self._name, self._timeout_s = url, dict(options or {}), name, timeout_s
        # Landed blocks are checksummed here while the reader threads read on (0: by the readers).
        self._checker = ThreadPoolExecutor(check_threads, thread_name_prefix=f"{name}-check") if check_threads else None
        self._slots = [_Slot(i, ThreadPoolExecutor(1, thread_name_prefix=f"{name}-bulk{i}")) for i in range(size)]
        self._subs: dict[int, _Subscription] = {}
        self._keys = itertools.count(1)
        self._turn = itertools.count()
        self._keeper: asyncio.Task | None = None
        self._closed = False
        self._queue = f"kv{os.getpid()}"  # one group per process: a same-named successor gets every frame too

    # -- state --------------------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return any(s.conn is not None and not s.conn.closed for s in self._slots)

    @property
    def max_payload(self) -> int:
        sizes = [s.conn.max_payload for s in self._slots if s.conn is not None and not s.conn.closed]
        return min(sizes) if sizes else 1024 * 1024

    @property
    def open_connections(self) -> int:
        return sum(s.conn is not None and not s.conn.closed for s in self._slots)

    async def start(self) -> BulkLinks:
        """Open every connection (a failure is logged and retried by the keeper). Options or a URL
        scheme a bulk connection cannot present leave it with none open, not retried."""
        reason = BulkConnection.unsupported(self._url(), self._options)
        if reason:
            log.warning("no bulk NATS connections: %s; KV frames use the service's own connection", reason)
            return self
        await asyncio.gather(*(self._open(slot) for slot in self._slots))
        self._keeper = asyncio.get_running_loop().create_task(self._keep())
        return self

    async def close(self) -> None:
        self._closed = True
        if self._keeper is not None:
            self._keeper.cancel()
        for slot in self._slots:
            if slot.conn is not None:
                slot.conn.close("closed by its owner")
            slot.writer.shutdown(wait=False, cancel_futures=True)
        if self._checker is not None:
            self._checker.shutdown(wait=False, cancel_futures=True)

    # -- sending ------------------------------------------------------------------------------------
    async def publish(self, subject: str, parts: Sequence[Buffer], reply: str,
                      then: Callable[[], None] | None = None) -> None:
        """Publish ``parts`` as one message, then run ``then``, on the next open connection's thread."""
        live = [s for s in self._slots if s.conn is not None and not s.conn.closed]
        if not live:
            raise ProtocolError(ErrorCode.WORKER_FAILURE, "no bulk NATS connection is open")
        slot = live[next(self._turn) % len(live)]
        conn = slot.conn

        def job() -> None:
            conn.publish(subject, parts, reply, timeout_s=self._timeout_s)
            if then is not None:
                then()

        try:
            await asyncio.get_running_loop().run_in_executor(slot.writer, job)
        except BulkConnectionError as exc:
            raise ProtocolError(ErrorCode.WORKER_FAILURE, f"bulk NATS connection failed: {exc}") from None

    # -- receiving ----------------------------------------------------------------------------------
    async def serve_kv(self, subject: str, receiver: KVReceiver) -> BulkSubscription:
        """Land KV frames sent to ``subject`` in ``receiver``, from the connections' reader threads.
        Raises :class:`ProtocolError` when no connection could subscribe (none open, or refused)."""

        def make_handler(conn: BulkConnection) -> Handler:
            def on_frame(delivery: Delivery, reader: PayloadReader) -> None:
                def answer(reply: bytes) -> None:  # from a check thread, once the frame's blocks are checked
                    if delivery.reply:
                        conn.publish(delivery.reply, [reply])

                try:
                    reply = receiver.on_stream(delivery.size, reader, self._checker, answer)
                except ProtocolError as exc:
                    limited.warning("refused KV frames", "KV frame on %s refused: %s", delivery.subject, exc)
                    reply = error_payload(exc)
                except (OSError, BulkConnectionError):
                    raise  # the connection broke mid-frame: nothing can be answered on it
                except Exception as exc:  # a bug, not the frame's fault: the sender still gets a typed answer
                    log.exception("KV frame on %s", delivery.subject)
                    reply = error_payload(ProtocolError(ErrorCode.WORKER_FAILURE, f"{type(exc).__name__}: {exc}"))
                if reply is not None and delivery.reply:
                    conn.publish(delivery.reply, [reply])
            return on_frame

        key = next(self._keys)
        self._subs[key] = _Subscription(subject, self._queue, make_handler)
        done = await asyncio.gather(*(self._subscribe(slot, key) for slot in self._slots))
        if not any(done):
            self._subs.pop(key, None)
            raise ProtocolError(ErrorCode.WORKER_FAILURE, f"no bulk NATS connection could subscribe to {subject}")
        return BulkSubscription(self, key)

    async def _subscribe(self, slot: _Slot, key: int) -> bool:
        conn, sub = slot.conn, self._subs.get(key)
        if conn is None or conn.closed or sub is None:
            return False
        try:
            sid = await asyncio.get_running_loop().run_in_executor(
                slot.writer, conn.subscribe, sub.subject, sub.make_handler(conn), sub.queue, self._timeout_s)
        except BulkConnectionError as exc:
            log.warning("bulk connection %d could not subscribe to %s: %s", slot.index, sub.subject, exc)
            return False
        slot.sids[key] = sid
        return True

    async def _unsubscribe(self, key: int) -> None:
        self._subs.pop(key, None)
        loop = asyncio.get_running_loop()
        for slot in self._slots:
            sid = slot.sids.pop(key, None)
            if sid is not None and slot.conn is not None:
                await loop.run_in_executor(slot.writer, slot.conn.unsubscribe, sid)

    # -- keeping them open --------------------------------------------------------------------------
    async def _open(self, slot: _Slot) -> None:
        try:
            url = self._url()
            slot.conn = await asyncio.get_running_loop().run_in_executor(
                slot.writer, lambda: BulkConnection(url, options=self._options, name=f"{self._name}-bulk{slot.index}",
                                                    timeout_s=self._timeout_s))
        except Exception as exc:  # unreachable, refused, or no URL while the main connection reconnects
            log.warning("bulk NATS connection %d: %s", slot.index, exc)
            return
        slot.sids.clear()
        for key in list(self._subs):
            await self._subscribe(slot, key)

    async def _keep(self) -> None:
        while not self._closed:
            await asyncio.sleep(REOPEN_S)
            for slot in self._slots:
                if slot.conn is None or slot.conn.closed:
                    await self._open(slot)
