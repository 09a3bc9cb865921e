"""Creating a JetStream stream idempotently, for every stream tandem keeps (KV events, planner decisions).

Whoever needs a stream first creates it; the others find it. Several processes may race to create
it: the loser's "name already in use" is not an error. An existing stream is left as configured.

    await ensure_stream(nc.jetstream(), StreamConfig(name="TANDEM_X", subjects=["tandem.v1.x"]))
"""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

_NAME_IN_USE = 10058  # JetStream: stream name already in use with a different configuration


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream ``config`` names unless it exists."""
    try:
        await js.stream_info(config.name)
        return
    except NotFoundError:
        pass
    try:
        await js.add_stream(config)
    except BadRequestError as exc:  # another process created it first, maybe with other limits
        if exc.err_code != _NAME_IN_USE:
            raise
