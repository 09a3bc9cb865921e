"""LoRA adapters on the bus: which adapter a request runs with, the fleet's registry of adapters,
and loading or unloading one at run time.

A request names an adapter through its ``model``; the router resolves the name against the registry
(:class:`AdapterRecord`, kept in the ``TANDEM_ADAPTERS`` stream: the last record per name) and hands
the workers an :class:`AdapterRef` inside the request, so a worker that lacks the adapter loads it
from ``path`` before admitting. Loads and unloads go to the routers (:class:`LoadAdapter`,
:class:`UnloadAdapter`; operator, front end and trainer only), which check the adapter against the
served model before publishing its record.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.shared.protocol.base import WireMessage

MAX_ADAPTER_PATH_CHARS = 4096
# A name is a subject token of the registry stream (no dots, spaces or wildcards) and an OpenAI model id.
AdapterName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_\-:/@+=]+$")]
AdapterVersion = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-.:+]+$")]


class AdapterRef(BaseModel):
    """The adapter a request runs with: name, version (new with every publish of the name) and where
    the workers read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: AdapterName
    version: AdapterVersion
    path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)

    @property
    def key(self) -> str:
        """Unique per adapter version: what caches and slots are keyed by."""
        return f"{self.name}@{self.version}"


def adapter_hash_root(adapter: AdapterRef | None) -> int | None:
    """The root of a request's block-hash chain: None without an adapter (the base model's chains),
    else a hash of the adapter's name and version, so no prefix cache or KV-store ever hands K/V
    computed with one adapter (or none) to a request of another."""
    if adapter is None:
        return None
    return int.from_bytes(hashlib.blake2b(adapter.key.encode(), digest_size=8).digest(), "little")


class AdapterRecord(WireMessage):
    """One adapter the fleet serves (``removed``: no longer): the registry stream's last message per name."""

    kind: Literal["adapter_record"] = "adapter_record"
    name: AdapterName
    version: AdapterVersion
    path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)
    base_model: str  # the served model it applies to (its bus name)
    rank: int = Field(ge=1)
    targets: list[str] = Field(default_factory=list)
    source: Literal["lora-modules", "api", "trainer"] = "api"
    published_at: float = 0.0  # unix time
    removed: bool = False

    def ref(self) -> AdapterRef:
        return AdapterRef(name=self.name, version=self.version, path=self.path)


class LoadAdapter(WireMessage):
    """To the routers: serve the PEFT adapter at ``path`` as ``name`` (a new version replaces an older
    one of the name; requests already running keep theirs). ``version`` empty: a hash of its files."""

    kind: Literal["load_adapter"] = "load_adapter"
    name: AdapterName
    path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)
    version: str = Field("", max_length=64, pattern=r"^[A-Za-z0-9_\-.:+]*$")
    source: Literal["lora-modules", "api", "trainer"] = "api"


class UnloadAdapter(WireMessage):
    """To the routers: stop serving ``name`` (requests already running finish with it)."""

    kind: Literal["unload_adapter"] = "unload_adapter"
    name: AdapterName
