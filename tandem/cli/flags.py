"""Command-line flags made from the settings (:mod:`tandem.shared.infra.config`), never spelt by hand.

Each settings field is one flag, named as the config module's docstring says (``--num-blocks``,
``--kv-ring-mib``, ``--ttft-target-ms``), of the field's type (a bool: ``--x/--no-x``), with the
field's description, default and variable as its help. A command picks the fields it takes by
*spec*: a section (``"engine"``), or one field by its path (``"engine.torch_threads"``,
``"model"``). :data:`SERVICE_SETTINGS` says which each ``tandem serve <service>`` takes; ``tandem
up`` takes them all and hands the given ones on to each child in the child's service's terms. The
sections of :data:`~tandem.shared.infra.config.ENV_ONLY_SECTIONS` (read by library code from their
variables wherever it runs) are no command's flags.

A flag left out is ``None`` in the namespace, so :func:`settings_from` passes on only the given
ones and the precedence stays flags, then ``TANDEM_*`` variables, then defaults.

Every ``tandem`` parser is a :class:`Parser` (no abbreviated flags, errors in one line), every
option's help ends with its default (:func:`show_defaults`), and a value a pydantic model refuses is
reported as the flag and the bound the model declares (:func:`invalid_value`; a settings value:
:func:`settings_problem`, naming the flag or the ``TANDEM_*`` variable it came from). Every such
refusal is a usage error: exit status 2, as argparse's own.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, NoReturn

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from tandem.shared.infra.config import ENV_ONLY_SECTIONS, FIELDS, Knob, Settings, knob_at, load_settings

PROCESS = ("model", "data_dir", "instance_id", "log_level")  # every service's own fields
# commands that talk to a running tandem: where, and who they are there (credentials, TLS)
CLIENT = ("bus.nats_url", "bus.nats_creds", "bus.tls_ca", "bus.tls_cert", "bus.tls_key", "data_dir", "log_level")
SERVICE_SETTINGS: dict[str, tuple[str, ...]] = {
    "router": (*PROCESS, "bus", "router", "metrics"),
    "prefill": (*PROCESS, "bus", "engine", "kv_ring", "metrics"),
    "decode": (*PROCESS, "bus", "engine", "kv_ring", "metrics"),
    "kvstore": (*PROCESS, "bus", "kvstore", "metrics"),
    "planner": (*PROCESS, "bus", "planner", "metrics", "supervisor.drain_timeout_s"),
    "trainer": (*PROCESS, "bus", "engine.torch_threads", "trainer", "metrics"),
    "frontend": (*PROCESS, "bus", "frontend", "metrics"),
}
UP_SETTINGS = ("model", "data_dir", "log_level", "bus", "supervisor", "engine", "kv_ring", "router", "metrics",
               "planner", "kvstore", "frontend")
REGISTERED = "settings_flags"  # namespace attribute: the flat names of the settings flags a parser has
# pydantic's error types for a value past a numeric bound (field_bounds then says the bound)
BOUND_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"})


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
    knobs = select(*specs)
    env_only = sorted({k.section for k in knobs if k.section in ENV_ONLY_SECTIONS})
    if env_only:  # a flag the library never reads would be a lie
        raise ValueError(f"settings {env_only} are read from their variables only, not from flags")
    for knob in knobs:
        if knob.section not in groups:
            title = f"{knob.section} settings" if knob.section else "process settings"
            about = Settings.model_fields[knob.section].description if knob.section else None
            groups[knob.section] = parser.add_argument_group(title, about)
        kwargs: dict[str, Any] = dict(dest=knob.flat, default=None, help=help_text(knob))
        if knob.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=knob.kind if knob.kind in (int, float) else str, metavar=metavar(knob))
            if nargs(knob):
                kwargs["nargs"] = nargs(knob)
        groups[knob.section].add_argument(knob.flag, **kwargs)
        added.append(knob.flat)
    parser.set_defaults(**{REGISTERED: (*(parser.get_default(REGISTERED) or ()), *added)})


def nargs(knob: Knob) -> str | None:
    """A field given as several words on a command line (``--lora-modules a=/x b=/y``): one string in
    the settings, its words separated by spaces."""
    extra = knob.info.json_schema_extra
    return extra.get("nargs") if isinstance(extra, dict) else None


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings flags given on this command line: flat name -> value."""
    names = getattr(args, REGISTERED, ())
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


class SettingsError(SystemExit):
    """A settings value that cannot work: a usage error, so the process exits with status 2.
    ``str()`` is one line naming the flag or variable to change; ``tandem``'s ``main`` prints it
    as the command's error (``tandem serve decode: --num-blocks must be >= 0, not -5``)."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def settings_from(args: argparse.Namespace, **extra: Any) -> Settings:
    """Settings: the flags given, then ``TANDEM_*`` variables, then defaults; a bad value raises
    :class:`SettingsError` naming the flag or the variable it came from."""
    flags = given(args)
    try:
        return load_settings(**flags, **extra)
    except ValidationError as exc:
        raise SettingsError(settings_problem(exc, flags)) from None


def settings_problem(exc: ValidationError, from_flags: Collection[str]) -> str:
    """``exc`` in one line, each finding named where its value came from: the flag when it was given
    as one (``from_flags``: flat names), else its ``TANDEM_*`` variable. A bounded field says its
    bound (``--num-blocks must be >= 0, not -5``); a field's own check keeps its words, which say
    what to change (``--quantization fp8: ... change --dtype, or use --quantization none``)."""
    found = []
    for err in exc.errors():
        loc = err["loc"]
        msg = err["msg"].removeprefix("Value error, ")
        knob = knob_at(loc) if loc else None
        if knob is None or len(loc) != (2 if knob.section else 1):  # a section's own check, or inside a value
            found.append(f"{'.'.join(map(str, loc)) or 'settings'}: {msg}")
            continue
        from_flag = knob.flat in from_flags
        where = knob.flag if from_flag else knob.env
        value = err.get("input")
        shown = str(value) if from_flag else repr(value)
        bounds = field_bounds(knob.info)
        if bounds and err["type"] in BOUND_ERRORS:
            found.append(f"{where} must be {bounds}, not {shown}")
        elif err["type"] == "value_error":
            found.append(f"{where} {shown}: {msg}")
        else:
            found.append(f"{must(where, msg)}, not {shown}")
    return "; ".join(found)


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
        elif nargs(knob):
            words = value.replace(",", " ").split() if isinstance(value, str) else [str(v) for v in value]
            if words:
                out += [knob.flag, *words]
        else:
            out += [knob.flag, str(value)]
    return out


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum``; anything else is the flag's one-line
    usage error (``argument --decode: must be >= 0, not -1``), exit status 2."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, not {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, not {value}")
        return value

    return parse


class Parser(argparse.ArgumentParser):
    """tandem's argument parser: no abbreviated flags and one-line errors.

    argparse takes ``--nat`` for any one flag it begins (``--nats-url``) unless abbreviations are off;
    here they are always off, so a mistyped flag is an error and adding a flag never changes what
    an old command line means. ``add_subparsers`` makes its parsers of the parent's class, so every
    subcommand's parser (those ``tandem/cli/up.py`` and ``tandem/cli/train.py`` add too) is one of these.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage first; one line naming the problem is what a user reads.
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _walk(parser: argparse.ArgumentParser) -> Iterable[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser below it, each once (aliases share one)."""
    yield parser
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if id(sub) not in seen:
                    seen.add(id(sub))
                    yield from _walk(sub)


def parsers(root: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``root`` and every parser below it (``tandem``, ``tandem serve``, ``tandem serve router``, ...)."""
    return list(_walk(root))


def shown_action_default(action: argparse.Action) -> str:
    """An option's default as its help shows it: ``off``/``on`` for a switch, ``unset`` for None."""
    value = action.default
    if action.nargs == 0:  # store_true and its kind: the flag given or not
        return "on" if value else "off"
    if value is None:
        # An optional value with a const (``--demo [PROMPT]``): not given means the feature is off.
        return "off" if action.nargs == argparse.OPTIONAL and action.const is not None else "unset"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value)) if value else "none"
    return str(value) if value != "" else "empty"


def show_defaults(root: argparse.ArgumentParser) -> None:
    """End the help of every option of ``root`` and its subcommands with ``(default: X)``, unless
    the help already says its default (the settings flags do, and some defaults need words:
    ``default: the router's``)."""
    for parser in _walk(root):
        for action in parser._actions:
            if (not action.option_strings or action.help == argparse.SUPPRESS
                    or isinstance(action, argparse._HelpAction | argparse._VersionAction)):
                continue
            text = action.help or ""
            if "default" not in text:
                shown = shown_action_default(action).replace("%", "%%")  # help is a %-format string
                action.help = f"{text} (default: {shown})".lstrip()


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def field_bounds(info: FieldInfo) -> str | None:
    """A field's numeric bounds as a user reads them (``in (0, 1]``, ``>= 1``, ``< 100``); None when
    it has none. Read from the field's own constraints, so the message cannot drift from the check."""
    lo = hi = None
    for item in info.metadata:  # annotated_types' Gt, Ge, Lt, Le: one attribute each, named as the bound
        if getattr(item, "gt", None) is not None:
            lo = ("(", item.gt)
        elif getattr(item, "ge", None) is not None:
            lo = ("[", item.ge)
        elif getattr(item, "lt", None) is not None:
            hi = (")", item.lt)
        elif getattr(item, "le", None) is not None:
            hi = ("]", item.le)
    if lo and hi:
        return f"in {lo[0]}{_number(lo[1])}, {_number(hi[1])}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {_number(lo[1])}"
    if hi:
        return f"{'<' if hi[0] == ')' else '<='} {_number(hi[1])}"
    return None


def invalid_value(exc: ValidationError, model: type[BaseModel], flags: Mapping[str, str]) -> str:
    """``exc``'s first finding in terms of the flag that gave the value: ``--top-p must be in (0, 1]``
    for a bounded field (whatever was wrong with the value, NaN included), otherwise the flag and
    pydantic's words; a check across fields keeps its words with every field named as its flag
    (``--best-of (2) must be at least --n (3)``). ``flags``: field name -> flag."""
    err = exc.errors()[0]
    if not err["loc"]:  # a check across fields (``best_of (2) must be at least n (3)``): say each field as its flag
        msg = err["msg"].removeprefix("Value error, ")
        named = {name: flag for name, flag in flags.items() if name in model.model_fields}
        return re.sub(r"\b[a-z_]+\b", lambda word: named.get(word.group(), word.group()), msg)
    field = str(err["loc"][0])
    flag = flags.get(field) or (f"--{field.replace('_', '-')}" if field else "a value")
    info = model.model_fields.get(field)
    bounds = field_bounds(info) if info is not None and len(err["loc"]) == 1 else None
    if bounds:
        return f"{flag} must be {bounds}"
    return must(flag, err["msg"])


def must(name: str, msg: str) -> str:
    """pydantic's ``Input should be ...`` about ``name`` as ``NAME must be ...``; other words as ``NAME: msg``."""
    msg = msg.replace(" after validation", "")
    for lead in ("Input should ", "String should ", "List should ", "Value should "):
        if msg.startswith(lead):
            return f"{name} must {msg.removeprefix(lead)}"
    return f"{name}: {msg}"
