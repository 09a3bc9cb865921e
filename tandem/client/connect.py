"""Connecting a :class:`Client`: to a URL, to ``TANDEM_NATS_URL``, or to the running ``tandem up``."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from tandem.client.access import BusConnectError, bus_options, connect_command
from tandem.client.errors import TandemError
from tandem.client.runstate import find_running_url
from tandem.client.session import Client
from tandem.client.stream import RECONNECT_WAIT_S
from tandem.shared.auth.credentials import CredentialsError
from tandem.shared.infra.config import EnvSettingsError, from_env

log = logging.getLogger("tandem.client")



def resolve_url(url: str | None) -> str:
    """``url``, else ``TANDEM_NATS_URL``, else the running ``tandem up``'s (its state file in the data
    dir, ``TANDEM_DATA_DIR`` or the default); :class:`TandemError` when there is none."""
    try:
        found = url or from_env("bus").nats_url or find_running_url()
    except EnvSettingsError as exc:
        raise TandemError(str(exc)) from None
    if not found:
        raise TandemError("no running tandem found: start one with `tandem up`, or pass its NATS URL to connect()")
    return found


@asynccontextmanager
async def connect(url: str | None = None, *, request_timeout_s: float = 30.0, worker_timeout_s: float = 3.0,
                  max_migrations: int = 3, reconnect_s: float = 10.0, creds: str | None = None,
                  data_dir: str | None = None,
                  tls_ca: str | None = None, tls_cert: str | None = None,
                  tls_key: str | None = None) -> AsyncIterator[Client]:
    """Connect to the NATS server of a tandem deployment (``url`` unset: see :func:`resolve_url`)
    as a client: with ``creds`` (a role key or NATS user credentials file; else
    ``TANDEM_NATS_CREDS``, else the client key of the ``tandem up`` serving that URL from
    ``data_dir`` or the default one, see :mod:`tandem.client.access`) and the TLS files given.
    ``max_migrations``: how many times a request is placed again after its worker died (0: never).
    ``reconnect_s``: how long a dropped connection may take to come back (a nats-server restarted
    by ``tandem up``); streams wait it out, then go on where they were.
    nats-py's own error reports go to the ``tandem.client`` logger at DEBUG, not as tracebacks."""
    url = resolve_url(url)
    try:
        options = bus_options("client", "tandem-client", url, creds=creds, data_dir=data_dir, tls_ca=tls_ca,
                              tls_cert=tls_cert, tls_key=tls_key)
    except (CredentialsError, EnvSettingsError) as exc:
        raise TandemError(str(exc)) from None
    holder: list[Client] = []

    async def on_error(exc: Exception) -> None:
        log.debug("nats: %s: %s", type(exc).__name__, exc)

    async def on_disconnect() -> None:
        for client in holder:
            client.connection_lost()

    async def on_reconnect() -> None:
        for client in holder:
            client.connection_back()

    try:
        nc = await connect_command(url, options, on_error=on_error, name="tandem-client", max_reconnect_attempts=3,
                                   allow_reconnect=True, reconnect_time_wait=RECONNECT_WAIT_S,
                                   disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                                   closed_cb=on_disconnect)
        # nats-py counts the first connection's tries against the same limit: a server that is not
        # there fails in about a second, and only a connection once made waits ``reconnect_s``.
        nc.options["max_reconnect_attempts"] = max(1, math.ceil(reconnect_s / RECONNECT_WAIT_S))
    except BusConnectError as exc:
        raise TandemError(str(exc)) from None
    client = Client(nc, request_timeout_s, worker_timeout_s, url, max_migrations, reconnect_s)
    holder.append(client)
    try:
        yield client
    finally:
        await client.close()
