"""How every tandem process runs its asyncio work and formats its log lines, services and commands alike.

Kept apart from :mod:`tandem.services.common.runtime` (the service base class, which loads the
bus runtime and its auth) so that the commands talking to a running tandem (``tandem generate``,
``tandem services``, ``tandem bench serve`` ...) use the same event loop without loading any of
that: a client-only install has none of the engine's packages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)-5s %(name)s %(message)s"


def setup_logging(level: str) -> None:
    """The root logger at ``level`` (a name such as ``"INFO"``; an unknown one means INFO), one format."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on uvloop where it is installed, else on asyncio's own loop; return its result."""
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build: the base install leaves it out there
        return asyncio.run(coro)
    return uvloop.run(coro)
