"""A process's channel for KV bytes over NATS: credited frames out, frames landed in, bulk connections under both.

Every process that moves KV blocks (prefill, decode, the KV-store, a KV-store client) does it through
one :class:`KVChannel`: it sends a blob of blocks to a subject as credited frames
(:func:`tandem.shared.kvtransfer.frames.send_kv`) and returns the :class:`KVTransfer` that describes
them, and it lands the frames sent to one of its subjects in a :class:`KVReceiver`. Opened with
``--kv-connections`` > 0 on a real NATS connection, it owns the process's bulk connections
(:class:`tandem.shared.kvtransfer.bulklinks.BulkLinks`): frames go out and come in on their threads,
off the event loop. Without them (or when none is open) frames travel on the service's own nats-py
connection; the wire is the same either way::

    channel = await KVChannel.open(nc, settings.bus, options=bus_options, name="tandem-decode-0")
    await channel.serve("kv", subject, receiver)             # land frames sent to ``subject``
    transfer = await channel.send(subject, blob, num_blocks=n, block_bytes=b)
    ...
    await channel.close()

Torch-free: the KV-store's service side uses it and must not load the compute layer.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from nats.aio.client import Client as NatsClient

from tandem.shared.infra.config import BusSettings
from tandem.shared.kvtransfer.bulklinks import BulkLinks
from tandem.shared.kvtransfer.frames import Buffer, KVReceiver, send_kv
from tandem.shared.protocol.base import ProtocolError
from tandem.shared.protocol.kv import KVTransfer

log = logging.getLogger("tandem.kvchannel")

MIB = 1 << 20
# A subscription of this channel's own over nats-py: room for several transfers' windows of frames
# (a subscription over its limit drops messages).
PENDING_BYTES = 256 * MIB

Handler = Callable[[Any], Awaitable[None]]
# ``(name, subject, handler)``: the owning service's way to serve a subject with a plain subscription
# whose handler's refusals become typed error replies (ServiceRuntime.add_endpoint with ``bulk``).
AddEndpoint = Callable[[str, str, Handler], Awaitable[None]]


class Subscription(Protocol):
    async def unsubscribe(self) -> None: ...


class KVChannel:
    """KV frames to and from ``nc``'s server, over ``links`` (bulk connections) when they are open."""

    def __init__(self, nc, *, window: int = BusSettings().kv_window, timeout_s: float = 30.0,
                 links: BulkLinks | None = None, add_endpoint: AddEndpoint | None = None,
                 log: logging.Logger = log) -> None:
        self.nc, self.window, self.timeout_s = nc, window, timeout_s
        self.links = links
        self._add_endpoint = add_endpoint
        self.log = log

    @classmethod
    async def open(cls, nc, bus: BusSettings, *, options: dict[str, Any], name: str,
                   add_endpoint: AddEndpoint | None = None, log: logging.Logger = log) -> KVChannel:
        """The channel of a service connected as ``nc`` with ``options`` (nats.connect's identity and TLS
        keywords): ``bus.kv_connections`` bulk connections to the server ``nc`` is on, with its identity
        (none on an in-process test bus). ``add_endpoint`` serves a subject when no bulk connection can;
        ``log``: the service's logger."""
        links = None
        if bus.kv_connections and isinstance(nc, NatsClient):
            links = await BulkLinks(lambda: nc.connected_url.geturl(), options=options, name=name,
                                    size=bus.kv_connections, check_threads=bus.kv_check_threads,
                                    timeout_s=bus.request_timeout_s).start()
        return cls(nc, window=bus.kv_window, timeout_s=bus.request_timeout_s, links=links, add_endpoint=add_endpoint,
                   log=log)

    async def close(self) -> None:
        if self.links is not None:
            await self.links.close()

    # -- sending ------------------------------------------------------------------------------------
    async def send(self, subject: str, blob: Buffer, *, num_blocks: int, block_bytes: int,
                   transfer_id: str | None = None, timeout_s: float | None = None) -> KVTransfer:
        """Send ``num_blocks`` blocks of ``block_bytes`` laid end to end in ``blob`` as frames to ``subject``;
        returns once the receiver has credited every byte, with the transfer to name in the message that
        follows (its checksums computed as the frames went out). Raises as :func:`send_kv` does."""
        transfer_id = transfer_id or uuid.uuid4().hex
        checksums = await send_kv(self.nc, subject, transfer_id, blob, window=self.window,
                                  timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                                  block_bytes=block_bytes, links=self.links)
        return KVTransfer(transfer_id=transfer_id, num_blocks=num_blocks, block_bytes=block_bytes,
                          checksums=checksums)

    # -- receiving ----------------------------------------------------------------------------------
    async def serve(self, name: str, subject: str, receiver: KVReceiver) -> None:
        """Land the KV frames sent to ``subject`` in ``receiver`` for the life of the process: from the
        bulk connections' reader threads when they are open, else on the event loop through the
        injected ``add_endpoint`` (``name`` names it there; without one, a plain subscription). Either
        way each frame's reply (a credit, or a typed error) goes to its reply subject."""
        if self.links is not None and self.links.usable:
            try:
                await self.links.serve_kv(subject, receiver)
                return
            except ProtocolError as exc:  # none could subscribe: the loop takes the frames instead
                self.log.warning("%s: %s; KV frames land on the event loop", name, exc.message)
        if self._add_endpoint is None:
            await self._subscribe(subject, receiver)
            return

        async def on_frame(request) -> None:
            reply = receiver.on_frame(request.data)  # a refusal raises: the endpoint replies the typed error
            if reply is not None and request.reply:
                await request.respond(reply)

        await self._add_endpoint(name, subject, on_frame)

    async def listen(self, subject: str, receiver: KVReceiver) -> Subscription:
        """Land the KV frames sent to ``subject`` (an inbox of this connection's identity, which its bulk
        connections may read) in ``receiver`` until the returned subscription is unsubscribed. Raises
        :class:`ProtocolError` when the bulk connections are open but none could subscribe."""
        if self.links is not None and self.links.usable:
            return await self.links.serve_kv(subject, receiver)
        return await self._subscribe(subject, receiver)

    async def _subscribe(self, subject: str, receiver: KVReceiver) -> Subscription:
        """A plain nats-py subscription landing frames on the loop; a refused frame is answered with its error."""

        async def on_frame(msg) -> None:
            reply = receiver.answer(msg.data)
            if reply is not None and msg.reply:
                await self.nc.publish(msg.reply, reply)

        return await self.nc.subscribe(subject, cb=on_frame, pending_bytes_limit=PENDING_BYTES)
