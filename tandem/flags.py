"""Command-line flags made from the settings (:mod:`tandem.shared.infra.config`), never spelt by hand.

Each settings field is one flag, named as the config module's docstring says (``--num-blocks``,
``--kv-ring-mib``, ``--ttft-target-ms``), of the field's type (a bool: ``--x/--no-x``), with the
field's description, default and variable as its help. A command picks the fields it takes by
*spec*: a section (``"engine"``), or one field by its path (``"engine.torch_threads"``,
``"model"``). :data:`SERVICE_SETTINGS` says which each ``tandem serve <service>`` takes; ``tandem
up`` takes them all and hands the given ones on to each child in the child's service's terms.

A flag left out is ``None`` in the namespace, so :func:`settings_from` passes on only the given
ones and the precedence stays flags, then ``TANDEM_*`` variables, then defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from tandem.shared.infra.config import FIELDS, Knob, Settings, describe_errors, load_settings

PROCESS = ("model", "data_dir", "instance_id", "log_level")  # every service's own fields
CLIENT = ("bus.nats_url", "data_dir", "log_level")  # commands that talk to a running tandem
SERVICE_SETTINGS: dict[str, tuple[str, ...]] = {
    "router": (*PROCESS, "bus", "router", "metrics"),
    "prefill": (*PROCESS, "bus", "engine", "kv_ring", "metrics"),
    "decode": (*PROCESS, "bus", "engine", "kv_ring", "metrics"),
    "kvstore": (*PROCESS, "bus", "kvstore", "metrics"),
    "planner": (*PROCESS, "bus", "planner", "metrics"),
    "trainer": (*PROCESS, "bus", "engine.torch_threads", "metrics"),
    "frontend": (*PROCESS, "bus", "frontend", "metrics"),
}
UP_SETTINGS = ("model", "data_dir", "log_level", "bus", "supervisor", "engine", "kv_ring", "router", "metrics",
               "planner", "kvstore", "frontend")
REGISTERED = "settings_flags"  # namespace attribute: the flat names of the settings flags a parser has


def select(*specs: str) -> list[Knob]:
    """The fields ``specs`` name, in the config module's order."""
    wanted = set(specs)
    chosen = [k for k in FIELDS if k.section in wanted or k.path in wanted]
    unknown = wanted - {k.section for k in chosen} - {k.path for k in chosen}
    if unknown:
        raise ValueError(f"no such settings: {sorted(unknown)}")
    return chosen


def shown_default(knob: Knob) -> str:
    value = knob.default()
    if value is None:
        return "auto" if knob.kind is bool else "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value) if value != "" else "empty"


def help_text(knob: Knob) -> str:
    return f"{knob.description} (default: {shown_default(knob)}; {knob.env})".replace("%", "%%")


def metavar(knob: Knob) -> str:
    if knob.kind is int:
        return "N"
    if knob.kind is float:
        return "X"
    return knob.name.rsplit("_", 1)[-1].upper()


def add_settings(parser: argparse.ArgumentParser, *specs: str) -> None:
    """Add the flags of the fields ``specs`` select, one argument group per section."""
    groups: dict[str, Any] = {}
    added = []
    for knob in select(*specs):
        if knob.section not in groups:
            title = f"{knob.section} settings" if knob.section else "process settings"
            about = Settings.model_fields[knob.section].description if knob.section else None
            groups[knob.section] = parser.add_argument_group(title, about)
        kwargs: dict[str, Any] = dict(dest=knob.flat, default=None, help=help_text(knob))
        if knob.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=knob.kind if knob.kind in (int, float) else str, metavar=metavar(knob))
        groups[knob.section].add_argument(knob.flag, **kwargs)
        added.append(knob.flat)
    parser.set_defaults(**{REGISTERED: (*(parser.get_default(REGISTERED) or ()), *added)})


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags given on this command line: flat name -> value."""
    names = getattr(args, REGISTERED, ())
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    """Settings: the flags given, then ``TANDEM_*`` variables, then defaults; a bad value exits
    with the flag and the variable it came from."""
    try:
        return load_settings(**given(args), **extra)
    except ValidationError as exc:
        raise SystemExit(f"tandem: {describe_errors(exc)}") from None


def argv(values: dict[str, Any], *specs: str, skip: Iterable[str] = ()) -> list[str]:
    """``values`` (flat name -> value) of the fields ``specs`` select as flags, in the config's order."""
    skip = set(skip)
    out: list[str] = []
    for knob in select(*specs):
        value = values.get(knob.flat)
        if value is None or knob.flat in skip:
            continue
        if isinstance(value, bool):
            out.append(knob.flag if value else "--no-" + knob.flag.removeprefix("--"))
        else:
            out += [knob.flag, str(value)]
    return out
