"""``tandem up`` stops on its signal even when the signal's KeyboardInterrupt is lost.

Python drops an exception raised in a signal handler when the signal lands inside a weakref
callback or a ``__del__`` ("Exception ignored in ..."): a CI run saw SIGINT swallowed that way and
``up`` serving on. The handler also sets ``Supervisor.stop_requested``, which every loop checks.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.cli.scaling import Scaler
from tandem.cli.supervisor import Supervisor
from tandem.shared.infra.config import Settings


def test_waiting_for_readiness_ends_on_the_flag():
    sup = Supervisor(Settings(), gpus=[])
    sup.check_children()  # no flag, no children: nothing to say
    sup.stop_requested = True
    with pytest.raises(KeyboardInterrupt):
        sup.check_children()


async def test_supervising_ends_on_the_flag(nats_server):
    sup = Supervisor(Settings(), gpus=[])
    sup.url = nats_server.url
    asyncio.get_running_loop().call_later(0.5, setattr, sup, "stop_requested", True)
    await asyncio.wait_for(Scaler(sup).run(), 5)  # returns by itself once the flag is up
