"""Whether a service instance's process is still on the bus: its alive subject (``subjects.alive``)
has a responder. nats-server drops a connection's subscriptions the moment the connection closes,
so a killed process shows as "no responders" at once, while its heartbeats only go stale. A slow or
failed answer proves nothing (the instance may be busy, or the asker's own connection in trouble),
so only no responders counts as gone."""

from __future__ import annotations

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from tandem.shared.protocol import subjects


async def on_bus(nc: nats.NATS, service: str, instance_id: str, timeout_s: float) -> bool:
    """False only when the instance's alive subject has no responders."""
    try:
        await nc.request(subjects.alive(service, instance_id), b"", timeout=timeout_s)
    except NoRespondersError:
        return False
    except NatsError:
        return True
    return True
