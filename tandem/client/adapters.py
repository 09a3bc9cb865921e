"""LoRA adapters from the client: load and unload them through the routers, list the fleet's.

``Client.load_adapter(name, path)`` sends a :class:`LoadAdapter` to ``tandem.v1.router.adapters``
(one router of the queue group takes it; it checks the PEFT directory against the served model,
then publishes the adapter's :class:`AdapterRecord` to the registry stream) and returns that record;
``unload_adapter(name)`` the same with :class:`UnloadAdapter` (the record returned says
``removed``). A router's refusal is its typed error (``invalid_request``: a bad directory, the base
model's name; ``unknown_model``: no such adapter to unload). ``path`` is read on the routers' and
workers' hosts, as given.

``Client.adapters()`` reads the registry itself: the ``TANDEM_ADAPTERS`` stream keeps the last
record per name, so replaying it once lists what is served now, freshly on every call (an adapter
just loaded is there). Then ``client.complete(prompt, model="<adapter name>")`` runs with it.

Who may: the bus's roles (``shared/auth/roles.py``) let the operator, the front end and the trainer
load and unload, and only routers and front ends read the stream. A client key is refused by the
server itself; that is said at once, as an :class:`InvalidRequestError`, not after a timeout:
connect with an operator's credentials (``connect(creds=...)``) to manage adapters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

from tandem.client.errors import (
    InvalidRequestError,
    NoWorkersError,
    RequestTimeoutError,
    TandemError,
    WorkerFailureError,
    error_from_reply,
)
from tandem.shared.protocol import subjects
from tandem.shared.protocol.adapters import AdapterRecord, LoadAdapter, UnloadAdapter
from tandem.shared.protocol.base import ErrorReply, ProtocolError
from tandem.shared.protocol.codec import decode, encode

if TYPE_CHECKING:
    from tandem.client.session import Client

log = logging.getLogger("tandem.client")
DENIAL_CHECK_S = 0.1  # how often a wait for a router looks whether the server refused what was sent
REGISTRY_TIMEOUT_S = 5.0  # a JetStream API answer longer than this will not come


def denied(client: Client, before: BaseException | None, subject: str) -> bool:
    """Whether the server refused this connection a publish to ``subject`` since ``before`` was its
    last error: nats-server answers a permissions violation with an error, never with a reply."""
    error = client.nc.last_error
    text = str(error).lower()  # as the server words it: its case differs between versions
    return error is not before and "permissions violation" in text and subject.lower() in text


async def unless_denied(client: Client, before: BaseException | None, subject: str, what: str,
                        answer: asyncio.Future, timeout_s: float) -> Any:
    """``answer``'s result, or at once :class:`InvalidRequestError` when the server refused what was
    sent to ``subject`` (a refused publish would otherwise only show as a timeout)."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            done, _ = await asyncio.wait({answer}, timeout=min(DENIAL_CHECK_S, max(0.0, deadline - time.monotonic())))
            if done:
                return answer.result()
            if denied(client, before, subject):
                raise InvalidRequestError(f"the bus does not let this connection {what}: its key's role may not (a "
                                          "client's; connect with an operator's credentials, connect(creds=...))")
            if time.monotonic() >= deadline:
                raise RequestTimeoutError(f"could not {what}: no answer in {timeout_s:.0f}s")
    finally:
        answer.cancel()  # done: nothing; else the wait for it ends here


async def ask_routers(client: Client, message: LoadAdapter | UnloadAdapter, timeout_s: float) -> AdapterRecord:
    """Send ``message`` to one router and return the record it published, or raise its typed error."""
    await client._until_connected(None)
    replies: asyncio.Queue = asyncio.Queue()

    async def on_reply(msg) -> None:
        replies.put_nowait(msg)

    before = client.nc.last_error
    try:
        sub = await client.nc.subscribe(client.nc.new_inbox(), cb=on_reply, max_msgs=1)
        await client.nc.publish(subjects.ADAPTERS_CONTROL, encode(message), reply=sub.subject)
    except NatsError as exc:
        raise client._lost(exc, None) from None
    what = f"{'load' if isinstance(message, LoadAdapter) else 'unload'} adapters"
    try:
        msg = await unless_denied(client, before, subjects.ADAPTERS_CONTROL, what,
                                  asyncio.ensure_future(replies.get()), timeout_s)
    finally:
        try:
            await sub.unsubscribe()
        except NatsError:
            pass
    if msg.headers and msg.headers.get("Status") == "503":
        raise NoWorkersError("no router is running")
    try:
        reply = decode(msg.data, (AdapterRecord, ErrorReply))
    except ProtocolError as exc:
        raise WorkerFailureError(f"bad reply from router: {exc}") from None
    if isinstance(reply, ErrorReply):
        raise error_from_reply(reply)
    return reply


async def list_adapters(client: Client, model: str | None = None) -> list[AdapterRecord]:
    """The adapters served now (of ``model``, the base model's name, if given), by name: the
    registry stream replayed once to its end."""
    await client._until_connected(None)
    js = client.nc.jetstream(timeout=REGISTRY_TIMEOUT_S)
    before = client.nc.last_error
    try:
        info = asyncio.ensure_future(js.stream_info(subjects.ADAPTERS_STREAM))
        state = (await unless_denied(client, before, subjects.ADAPTERS_STREAM, "read the adapter registry", info,
                                     REGISTRY_TIMEOUT_S + 1)).state
    except NotFoundError:
        return []  # no router has ever served adapters on this bus
    except ServiceUnavailableError:
        raise InvalidRequestError("the bus has no JetStream, so it serves no LoRA adapters "
                                  "(start nats-server with -js)") from None
    except (NatsError, TimeoutError) as exc:
        raise TandemError(f"could not read the adapter registry: {type(exc).__name__} {exc}") from None
    records: dict[str, AdapterRecord] = {}
    if state.messages:
        try:
            await replay(js, state.last_seq, records)
        except NatsError as exc:
            raise TandemError(f"could not read the adapter registry: {type(exc).__name__} {exc}") from None
    return sorted((r for r in records.values() if not r.removed and (model is None or r.base_model == model)),
                  key=lambda r: r.name)


async def replay(js: JetStreamContext, last_seq: int, into: dict[str, AdapterRecord]) -> None:
    """Read the registry stream from its start to ``last_seq`` (its end as of the caller's look) into
    ``into``, by name, through an ordered consumer removed afterwards."""
    sub = await js.subscribe(subjects.ADAPTERS_ALL, stream=subjects.ADAPTERS_STREAM, ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=REGISTRY_TIMEOUT_S)
            except TimeoutError:
                raise RequestTimeoutError("the adapter registry stopped answering mid-way") from None
            try:
                record = decode(msg.data, AdapterRecord)
                into[record.name] = record
            except ProtocolError as exc:  # one bad record hides no other
                log.warning("ignored a bad adapter record: %s", exc)
            if msg.metadata.num_pending == 0 or msg.metadata.sequence.stream >= last_seq:
                return
    finally:
        try:
            await sub.unsubscribe()
        except NatsError:
            pass
