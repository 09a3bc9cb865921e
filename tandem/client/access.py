"""Which credentials a tandem command connects to the bus with.

In order: the credentials file named by ``--creds`` or ``TANDEM_NATS_CREDS``; else, when the URL is
that of the ``tandem up`` running on this data dir (or no URL is given), the role key for the
command's role from up's state file (0600, so only the user who started it can read it); else none
(an anonymous connection, refused by a server that requires identities). A client command
(``generate``, ``bench``, the library's ``connect()``) takes the ``client`` role, an admin command
(the console, ``services``, ``train``, ``up``'s own connections) the ``operator`` role. TLS files
come from ``--tls-ca/--tls-cert/--tls-key`` or their ``TANDEM_TLS_*`` variables. No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats

from tandem.client.runstate import find_running
from tandem.shared.auth.credentials import Credentials, RoleKey, connect_options, load_credentials, tls_context
from tandem.shared.infra.config import Settings, from_env


def credentials_for(role: str, url: str | None, creds_file: str | None = None,
                    data_dir: Path | str | None = None) -> Credentials | None:
    """The credentials a command of ``role`` presents to ``url`` (see the module's order);
    ``data_dir``: where to look for the running up (default: ``TANDEM_DATA_DIR``, else the default)."""
    path = creds_file or from_env("bus").nats_creds
    if path:
        return load_credentials(path)
    state = find_running(data_dir)
    if state is None or (url and same_server(url) != same_server(state.nats_url)) or role not in state.keys:
        return None
    return RoleKey.from_dict(state.keys[role])


def same_server(url: str) -> tuple[str, int]:
    """What two URLs of one server share: ``nats://localhost:4222``, ``127.0.0.1:4222`` and
    ``tls://127.0.0.1`` all name the server at 127.0.0.1 port 4222."""
    parsed = urlsplit(url if "://" in url else f"nats://{url}")
    host = (parsed.hostname or "127.0.0.1").lower()
    return ("127.0.0.1" if host in ("localhost", "::1") else host), parsed.port or 4222


def bus_options(role: str, name: str, url: str | None, *, creds: str | None = None,
                data_dir: Path | str | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None) -> dict[str, Any]:
    """``nats.connect`` keyword arguments for a command of ``role`` (``client`` or ``operator``)
    connecting to ``url`` as ``name``; raises ``CredentialsError`` (one line) for a bad file."""
    bus = from_env("bus")  # what the arguments leave unset
    tls = tls_context(tls_ca or bus.tls_ca, tls_cert or bus.tls_cert, tls_key or bus.tls_key)
    return connect_options(credentials_for(role, url, creds, data_dir), name, tls=tls)


def command_auth(settings: Settings) -> dict[str, Any]:
    """``tandem.client.connect``'s identity arguments from a command's settings (its --creds, TLS
    flags and data dir)."""
    bus = settings.bus
    return {"creds": bus.nats_creds, "data_dir": settings.data_dir, "tls_ca": bus.tls_ca, "tls_cert": bus.tls_cert,
            "tls_key": bus.tls_key}


def operator_options(settings: Settings, name: str, url: str | None) -> dict[str, Any]:
    """``nats.connect`` options for an admin command (the console, ``services``, ``train``)."""
    return bus_options("operator", name, url, **command_auth(settings))


class BusConnectError(Exception):
    """A command could not connect; ``str()`` is one line saying why (refused, unreachable, TLS)."""


async def connect_command(url: str, options: dict[str, Any], *, timeout_s: float | None = None,
                          on_error: Callable[[Exception], Awaitable[None]] | None = None,
                          **kwargs: Any) -> nats.NATS:
    """``nats.connect`` for a command (a few tries, then :class:`BusConnectError` in one line), given
    up after ``timeout_s`` (default: every try's ``connect_timeout`` and wait, and a second): nats-py
    retries a failed TLS handshake forever otherwise."""
    seen: list[Exception] = []

    async def record(exc: Exception) -> None:
        if len(seen) < 8:
            seen.append(exc)
        if on_error is not None:
            await on_error(exc)

    settings = {"connect_timeout": 5, "max_reconnect_attempts": 2, "reconnect_time_wait": 0.3} | kwargs
    tries = max(0, settings["max_reconnect_attempts"]) + 1
    if timeout_s is None:
        timeout_s = tries * (settings["connect_timeout"] + settings["reconnect_time_wait"]) + 1
    try:
        return await asyncio.wait_for(nats.connect(url, error_cb=record, **settings, **options), timeout_s)
    except Exception as exc:  # nats-py raises several kinds for a server it cannot reach
        last = seen[-1] if seen else exc
        reason = f"{type(last).__name__}: {last}" if str(last) else type(last).__name__
        raise BusConnectError(refusal(url, options, exc, *seen) or f"cannot reach NATS at {url}: {reason}") from None


def refusal(url: str, options: dict[str, Any], *errors: BaseException) -> str | None:
    """One line for a server that refused the connection's identity, if one of ``errors`` (what
    ``nats.connect`` raised and what its error callback saw) says so; None for any other failure."""
    if not any("authorization violation" in str(exc).lower() for exc in errors):
        return None
    who = "the credentials given" if options.get("user_jwt_cb") else "an anonymous connection"
    return (f"NATS at {url} requires an identity and refused {who}: pass --creds FILE (or TANDEM_NATS_CREDS), "
            "or run this as the user whose tandem up serves that URL (its state file holds the keys)")
