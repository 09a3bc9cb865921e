"""A NATS connection for bulk bytes: a blocking socket driven by threads, payloads sent and received in place.

nats-py parses every incoming message on the event loop, in Python, 32 KiB at a time, and copies
each payload four times on the way in (socket read, stream buffer, parser buffer, ``bytes``) and
three on the way out (the frame, the PUB command, the transport's buffer): an 8 MiB KV frame costs
its receiver's whole core, and one connection moved under 200 MB/s on a 16-core host. KV frames
need none of that machinery, so this connection speaks the same NATS client protocol (INFO,
CONNECT, PUB, SUB, MSG/HMSG, PING/PONG) itself, over a plain blocking socket:

- :meth:`BulkConnection.publish` hands a message's parts (control line, frame header, the caller's
  memoryview of the KV bytes) to one ``sendmsg``: no join, no copy in user space;
- a reader thread per connection parses the control lines and hands each message to its
  subscription's handler with a :class:`PayloadReader`, which ``recv_into``\\ s the payload straight
  into wherever the handler wants it (the receiver's preallocated transfer buffer).

Both release the GIL for the kernel's copy, and so does ``zlib.crc32``, so several connections move
and check bytes on several cores at once. The identity is the service's own (the JWT and nonce
signature callbacks of :func:`tandem.shared.auth.credentials.connect_options`, user/password or a
token), TLS as the server asks. Deliberately small: no reconnect (a broken connection fails what it
carries, and :class:`tandem.shared.kvtransfer.bulklinks.BulkLinks` opens a new one), no JetStream, no
headers on publish. Used only through :mod:`tandem.shared.kvtransfer.bulklinks`.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger("tandem.bulkconn")

_CRLF = b"\r\n"
MAX_CONTROL_LINE = 4096  # nats-server's own limit on a protocol line
_READ_CHUNK = 64 * 1024  # control lines and small payloads are read through a buffer this size
_POLL_S = 0.5  # how often a blocked reader or writer checks whether its connection was closed
_TLS_PIECE = 1024 * 1024  # TLS writes at most this much per call, so reads interleave with a long write
# The identity and TLS options of nats.connect this connection understands (connect_options's and nats-py's own).
KNOWN_OPTIONS = frozenset({"tls", "tls_hostname", "user_jwt_cb", "signature_cb", "inbox_prefix", "user", "password",
                           "token", "name"})

Buffer = bytes | bytearray | memoryview


class BulkConnectionError(ConnectionError):
    """The connection could not be made, was refused, or broke; what it carried is lost."""


@dataclass(frozen=True)
class Delivery:
    """One message the server delivered to a subscription (its payload is read by the handler)."""

    subject: str
    reply: str
    size: int  # payload bytes, headers excluded
    status: str = ""  # a server status of a header message ("503": no responders), else ""


class PayloadReader:
    """The payload of one delivered message, read from the socket in place; at most ``remaining`` bytes."""

    def __init__(self, conn: BulkConnection, size: int) -> None:
        self._conn = conn
        self.remaining = size

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` (its length at most ``remaining``) with the next payload bytes."""
        if len(view) > self.remaining:
            raise ValueError(f"{len(view)} bytes asked of a payload with {self.remaining} left")
        self._conn._read_exact(view)
        self.remaining -= len(view)

    def read(self, n: int) -> bytes:
        out = bytearray(n)
        self.readinto(memoryview(out))
        return bytes(out)

    def skip(self) -> None:
        """Read and drop what is left."""
        scratch = memoryview(bytearray(min(self.remaining, 1 << 20) or 1))
        while self.remaining:
            self.readinto(scratch[: min(self.remaining, len(scratch))])


Handler = Callable[[Delivery, PayloadReader], None]


def _connect_fields(options: dict[str, Any], url_user: str | None, url_password: str | None,
                    info: dict[str, Any]) -> dict[str, Any]:
    """The identity part of CONNECT, as nats-py would send it for the same options."""
    fields: dict[str, Any] = {}
    sign, jwt = options.get("signature_cb"), options.get("user_jwt_cb")
    if sign is not None and "nonce" in info:
        fields["sig"] = _text(sign(info["nonce"]))
        if jwt is not None:
            fields["jwt"] = _text(jwt())
    elif options.get("user") is not None and options.get("password") is not None:
        fields["user"], fields["pass"] = options["user"], options["password"]
    elif options.get("token") is not None:
        fields["auth_token"] = options["token"]
    elif url_user is not None:
        if url_password is None:
            fields["auth_token"] = url_user
        else:
            fields["user"], fields["pass"] = url_user, url_password
    return fields


def _check_subject(subject: str) -> None:
    """A subject with whitespace in it would be read as more fields of the protocol line."""
    if not subject or any(c.isspace() for c in subject):
        raise ValueError(f"not a NATS subject: {subject[:80]!r}")


def _text(value: str | bytes | Callable[[], str | bytes]) -> str:
    value = value() if callable(value) else value
    return value.decode() if isinstance(value, bytes) else value


class BulkConnection:
    """One NATS client connection for bulk messages; thread-safe. Opening it blocks (call it from a thread)."""

    @staticmethod
    def unsupported(url: str, options: dict[str, Any] | None) -> str:
        """Why a bulk connection cannot be made to ``url`` with ``options``; "" when it can."""
        unknown = set(options or {}) - KNOWN_OPTIONS
        if unknown:  # an identity it cannot present would connect as nobody, or fail: say so instead
            return f"bulk connections do not support the connect options {sorted(unknown)}"
        scheme = urlparse(url if "://" in url else f"nats://{url}").scheme
        if scheme not in ("nats", "tls"):
            return f"bulk connections speak nats:// and tls://, not {scheme}://"
        return ""

    def __init__(self, url: str, *, options: dict[str, Any] | None = None, name: str = "tandem-bulk",
                 timeout_s: float = 10.0) -> None:
        options = dict(options or {})
        reason = self.unsupported(url, options)
        if reason:
            raise BulkConnectionError(reason)
        parsed = urlparse(url if "://" in url else f"nats://{url}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        self.url = f"{parsed.scheme}://{host}:{port}"
        self.max_payload = 1024 * 1024
        self._buf = bytearray(_READ_CHUNK)
        self._lo = self._hi = 0
        self._wlock = threading.Lock()
        self._state = threading.Condition()
        self._pings = self._pongs = 0
        self._errors: deque[str] = deque(maxlen=16)  # the newest -ERR lines the server sent
        self._error_count = 0  # all of them
        self._subs: dict[int, Handler] = {}
        self._next_sid = 1
        self._closed = False
        self._tls_lock: threading.Lock | None = None  # set on a TLS connection
        self.error: str = ""  # why it closed, if it broke
        deadline = time.monotonic() + timeout_s
        self._read_deadline: float | None = deadline  # the handshake's; reads wait forever after it
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise BulkConnectionError(f"cannot reach {self.url}: {exc}") from None
        try:
            # Socket buffers stay the kernel's to size: setting them turns off its autotuning, and
            # net.core.rmem_max (often 208 KiB) would cap them below what a frame wants.
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            info = self._read_info()
            tls = options.get("tls")
            if parsed.scheme == "tls" or tls is not None or info.get("tls_required"):
                context = tls if isinstance(tls, ssl.SSLContext) else ssl.create_default_context()
                self._sock = context.wrap_socket(self._sock, server_hostname=options.get("tls_hostname") or host)
                # OpenSSL allows no concurrent use of one connection: every TLS read and write
                # goes through ``_tls_lock``, non-blocking, and waits for the socket outside it.
                self._tls_lock = threading.Lock()
                self._sock.setblocking(False)
            else:
                self._sock.settimeout(_POLL_S)
            self.max_payload = int(info.get("max_payload", self.max_payload))
            connect = {"verbose": False, "pedantic": False, "protocol": 1, "lang": "python3-tandem-bulk",
                       "version": "1", "headers": True, "no_responders": True, "name": name,
                       **_connect_fields(options, parsed.username, parsed.password, info)}
            self._send([b"CONNECT " + json.dumps(connect, sort_keys=True).encode() + _CRLF + b"PING" + _CRLF],
                       timeout_s)
            self._await_first_pong(deadline)
            self._read_deadline = None
        except (OSError, ValueError, BulkConnectionError) as exc:
            self._sock.close()
            if isinstance(exc, BulkConnectionError):
                raise
            raise BulkConnectionError(f"connecting to {self.url}: {exc}") from None
        self._reader = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
        self._reader.start()

    # -- public -------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, subject: str, parts: Sequence[Buffer], reply: str = "", timeout_s: float = 60.0) -> None:
        """Send one message whose payload is ``parts`` laid end to end; blocks until the kernel has it all.
        Raises :class:`BulkConnectionError` (and closes the connection) when it cannot."""
        _check_subject(subject)
        if reply:
            _check_subject(reply)
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.max_payload:
            raise ValueError(f"message of {size} bytes exceeds the server's max_payload of {self.max_payload}")
        control = f"PUB {subject} {reply} {size}\r\n".encode() if reply else f"PUB {subject} {size}\r\n".encode()
        self._send([control, *parts, _CRLF], timeout_s)

    def subscribe(self, subject: str, handler: Handler, queue: str = "", timeout_s: float = 10.0) -> int:
        """Deliver ``subject``'s messages to ``handler`` on this connection's reader thread; returns
        once the server has the subscription. Raises :class:`BulkConnectionError` if it refused it."""
        _check_subject(subject)
        if queue:
            _check_subject(queue)
        with self._state:
            sid = self._next_sid
            self._next_sid += 1
            self._subs[sid] = handler
            errors = self._error_count  # before the SUB: its refusal may come back before the PING goes out
        line = f"SUB {subject} {queue} {sid}\r\n" if queue else f"SUB {subject} {sid}\r\n"
        self._send([line.encode()], timeout_s)
        try:
            self.flush(timeout_s, errors_since=errors)
        except BulkConnectionError:
            self._subs.pop(sid, None)
            raise
        return sid

    def unsubscribe(self, sid: int) -> None:
        if self._subs.pop(sid, None) is not None and not self._closed:
            try:
                self._send([f"UNSUB {sid}\r\n".encode()], 5.0)
            except BulkConnectionError:
                pass

    def flush(self, timeout_s: float = 10.0, errors_since: int | None = None) -> None:
        """A PING/PONG round trip: everything sent before it has reached the server. Raises
        :class:`BulkConnectionError` if the server reported a permissions violation meanwhile (or
        since it had reported ``errors_since`` errors)."""
        with self._state:
            errors = self._error_count if errors_since is None else errors_since
            self._pings += 1
            want = self._pings
        self._send([b"PING\r\n"], timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._state:
            while self._pongs < want and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BulkConnectionError(f"{self.url} did not answer a PING within {timeout_s:.0f}s")
                self._state.wait(left)
            if self._pongs < want:
                raise BulkConnectionError(f"connection to {self.url} closed: {self.error}")
            news = list(self._errors)[-min(self._error_count - errors, len(self._errors)):] if (
                self._error_count > errors) else []
            refused = [e for e in news if "violation" in e.lower()]
        if refused:
            raise BulkConnectionError(f"{self.url} refused: {refused[-1]}")

    def close(self, reason: str = "") -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            self.error = self.error or reason
            self._state.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    # -- writing ------------------------------------------------------------------------------------
    def _send(self, parts: list[Buffer], timeout_s: float) -> None:
        if self._closed:
            raise BulkConnectionError(f"connection to {self.url} is closed: {self.error}")
        deadline = time.monotonic() + timeout_s
        views = [memoryview(p).cast("B") for p in parts]
        with self._wlock:
            try:
                if self._tls_lock is not None:  # no sendmsg on TLS: part by part
                    for view in views:
                        self._send_tls(view, deadline)
                else:
                    self._sendmsg_all(views, deadline)
            except OSError as exc:
                # Part of a message may be out: the byte stream can no longer be trusted.
                self.close(f"write failed: {exc}")
                raise BulkConnectionError(f"writing to {self.url}: {exc}") from None

    def _sendmsg_all(self, views: list[memoryview], deadline: float) -> None:
        while views:
            try:
                sent = self._sock.sendmsg(views[:512])  # IOV_MAX is 1024 on Linux
            except TimeoutError:  # nothing went out: the server reads slowly, or the connection closed
                self._check_alive(deadline)
                continue
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
            while views and not len(views[0]):
                views.pop(0)

    def _send_tls(self, view: memoryview, deadline: float) -> None:
        while len(view):
            piece = view[:_TLS_PIECE]  # an unfinished write is retried with the same piece, as OpenSSL asks
            with self._tls_lock:
                try:
                    sent = self._sock.send(piece)
                except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    sent = 0
            if sent:
                view = view[sent:]
                continue
            self._check_alive(deadline)
            select.select([], [self._sock], [], _POLL_S)

    def _check_alive(self, deadline: float) -> None:
        if self._closed:
            raise OSError(f"connection closed: {self.error}")
        if time.monotonic() > deadline:
            raise OSError("the server took no bytes before the timeout")

    # -- reading ------------------------------------------------------------------------------------
    def _recv_some(self, into: memoryview) -> int:
        """Bytes read into ``into`` (at least one); raises OSError when the connection ended."""
        while True:
            if self._closed:
                raise OSError(f"connection closed: {self.error}")
            if self._tls_lock is not None:
                with self._tls_lock:
                    try:
                        n = self._sock.recv_into(into)
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        n = -1
                if n < 0:  # no whole record yet: wait for the socket without holding the lock
                    select.select([self._sock], [], [], _POLL_S)
                    self._check_read_deadline()
                    continue
            else:
                try:
                    n = self._sock.recv_into(into)
                except TimeoutError:  # idle: look whether the connection was closed meanwhile
                    self._check_read_deadline()
                    continue
            if n == 0:
                raise OSError("the server closed the connection")
            return n

    def _check_read_deadline(self) -> None:
        if self._read_deadline is not None and time.monotonic() > self._read_deadline:
            raise OSError("the server did not answer in time")

    def _read_exact(self, view: memoryview) -> None:
        """Fill ``view``: first from what the line buffer holds, then from the socket straight into it."""
        have = min(self._hi - self._lo, len(view))
        if have:
            view[:have] = self._buf[self._lo : self._lo + have]
            self._lo += have
        pos = have
        while pos < len(view):
            pos += self._recv_some(view[pos:])

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(_CRLF, self._lo, self._hi)
            if end >= 0:
                line = bytes(self._buf[self._lo : end])
                self._lo = end + 2
                return line
            if self._hi - self._lo > MAX_CONTROL_LINE:
                raise OSError("protocol line longer than the server's limit")
            if self._lo == self._hi:
                self._lo = self._hi = 0
            elif self._hi == len(self._buf):  # move the partial line to the front
                rest = self._hi - self._lo
                self._buf[:rest] = self._buf[self._lo : self._hi]
                self._lo, self._hi = 0, rest
            self._hi += self._recv_some(memoryview(self._buf)[self._hi :])

    def _read_info(self) -> dict[str, Any]:
        line = self._line()
        if not line.startswith(b"INFO "):
            raise BulkConnectionError(f"{self.url} is not a NATS server (it said {line[:60]!r})")
        return json.loads(line[5:])

    def _await_first_pong(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            line = self._line()
            if line.startswith(b"PONG"):
                return
            if line.startswith(b"-ERR"):
                raise BulkConnectionError(f"{self.url} refused the connection: {line[5:].decode(errors='replace')}")
            if line.startswith(b"PING"):
                self._send([b"PONG\r\n"], 10.0)
            # INFO (connect_info) and +OK need nothing
        raise BulkConnectionError(f"{self.url} did not finish the handshake in time")

    def _read_loop(self) -> None:
        try:
            while not self._closed:
                line = self._line()
                if line.startswith((b"MSG ", b"HMSG ")):
                    self._deliver(line)
                elif line.startswith(b"PING"):
                    self._send([b"PONG\r\n"], 60.0)
                elif line.startswith(b"PONG"):
                    with self._state:
                        self._pongs += 1
                        self._state.notify_all()
                elif line.startswith(b"-ERR"):
                    text = line[5:].decode(errors="replace").strip(" '")
                    log.warning("bulk connection to %s: server error: %s", self.url, text)
                    with self._state:
                        self._errors.append(text)
                        self._error_count += 1
                elif line.startswith(b"INFO "):
                    self.max_payload = int(json.loads(line[5:]).get("max_payload", self.max_payload))
                # +OK and empty lines need nothing
        except (OSError, ValueError, BulkConnectionError) as exc:
            if not self._closed:
                log.warning("bulk connection to %s broke: %s", self.url, exc)
            self.close(str(exc))

    def _deliver(self, line: bytes) -> None:
        parts = line.split()
        try:
            if parts[0] == b"MSG":  # MSG <subject> <sid> [reply] <size>
                subject, sid, size, header_size = parts[1], int(parts[2]), int(parts[-1]), 0
                reply = parts[3] if len(parts) == 5 else b""
            else:  # HMSG <subject> <sid> [reply] <header size> <total size>
                subject, sid, header_size, size = parts[1], int(parts[2]), int(parts[-2]), int(parts[-1])
                reply = parts[3] if len(parts) == 6 else b""
        except (IndexError, ValueError):
            raise OSError(f"malformed message line {line[:80]!r}") from None
        status = ""
        if header_size:
            head = PayloadReader(self, header_size).read(header_size)
            first = head.split(_CRLF, 1)[0].split()  # NATS/1.0 [status [description]]
            status = first[1].decode(errors="replace") if len(first) > 1 else ""
        reader = PayloadReader(self, size - header_size)
        handler = self._subs.get(sid)
        if handler is not None:
            try:
                handler(Delivery(subject.decode(), reply.decode(), size - header_size, status), reader)
            except (OSError, BulkConnectionError):
                raise  # the socket itself failed
            except Exception:  # a handler's bug must not desynchronise the stream: skip its payload
                log.exception("bulk connection to %s: handler for %s failed", self.url, subject.decode())
        reader.skip()
        end = bytearray(2)
        self._read_exact(memoryview(end))
        if end != _CRLF:
            raise OSError("message payload not followed by CRLF")
