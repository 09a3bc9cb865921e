"""Carrying out the planner's decisions where no ``tandem up`` does: the contract an actuator keeps.

Under ``tandem up`` the supervisor subscribes to the decisions and starts or drains children
itself (:mod:`tandem.cli.scaling`); the planner only publishes (actuator ``up``). Under docker compose
or Kubernetes nobody else would act, so the planner holds an :class:`Actuator` for where it runs
(``--planner-actuator``: ``docker`` scales the compose service through the Docker Engine API,
``kubernetes`` patches the Deployment's replicas; ``auto`` picks from the environment) and calls
:meth:`Actuator.scale` for every changed decision.

Scaling down drains first: the actuator picks which replicas go (by their host names, the
``Heartbeat.host`` their workers beat with: a container's or pod's hostname) and awaits
``drain(hosts)``, which sends those workers a :class:`DrainRequest` and returns once they left
(or its timeout passed); only then does it remove them, so no request in flight is cut.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

# Sends a DrainRequest to the workers on these hosts and returns the hosts whose workers left in time.
Drain = Callable[[list[str]], Awaitable[list[str]]]


class ActuatorError(Exception):
    """The platform refused or failed a scaling step; one line that names what to change."""


class Actuator(Protocol):
    where: str  # "docker" or "kubernetes": logged with every step

    async def replicas(self, service: str) -> int:
        """Replicas of ``service`` ("prefill" or "decode") that run now."""

    async def scale(self, service: str, wanted: int, drain: Drain) -> int:
        """Bring ``service`` to ``wanted`` replicas (draining the ones removed, see above) and return
        how many run after the step. Raises :class:`ActuatorError`."""

    async def close(self) -> None:
        """Let go of the platform's connection."""
