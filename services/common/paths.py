"""Paths that arrive over the bus stay where the operator allows.

A training job's ``output_dir`` and a ``WeightsUpdated`` event's ``path`` come from whoever can
publish on those subjects. Unchecked, a job could write its checkpoint anywhere the trainer may
write, and an event could make every serving worker load weights from any folder. Both must lie
under the data dir (:func:`under_data_dir`). A job's ``dataset`` and ``model`` directory come from
the same publishers and are *read*: unchecked, ``/etc/shadow`` as a dataset comes back out through
the model's samples and losses. They must lie under the folders the operator lets the trainer read
(:func:`under_roots`), and so must every file below such a folder, so a link inside one cannot
lead out (:func:`tree_under_roots`).

Every path is resolved the same way (:func:`resolve_path`): ``~`` expanded, a relative path
counted from the data dir, symlinks followed, ``..`` collapsed; a path is inside a folder when the
resolved path lies under the resolved folder (a name that merely begins with the folder's does not).
Callers open the resolved path they get back, so what was checked is what is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tandem.shared.protocol.base import ErrorCode, ProtocolError


def absolute_path(path: str | os.PathLike, base: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded, counted from ``base`` when relative; links and ``..`` left for the
    system to follow (so it names what :func:`resolve_path` resolves, and keeps its own file name)."""
    given = Path(path).expanduser()
    return given if given.is_absolute() else Path(base).expanduser().resolve() / given


def resolve_path(path: str | os.PathLike, base: str | os.PathLike) -> Path:
    """``path`` with ``~`` expanded, counted from ``base`` when relative, symlinks followed, ``..`` collapsed."""
    return absolute_path(path, base).resolve()


def inside(path: Path, roots: Iterable[Path]) -> bool:
    """Whether the resolved ``path`` lies under one of the resolved ``roots`` (or is one)."""
    return any(path.is_relative_to(root) for root in roots)


def under_data_dir(path: str | os.PathLike, data_dir: str | os.PathLike, field: str) -> Path:
    """``path`` resolved, when it lies under ``data_dir``; else :class:`ProtocolError` naming ``field``."""
    (root,) = resolve_roots([data_dir])
    resolved = resolve_path(path, root)
    if not inside(resolved, [root]):
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"{field} {str(path)!r} is outside the data dir {root}: paths from the bus stay under it",
                            field)
    return resolved


def resolve_roots(roots: Iterable[str | os.PathLike]) -> list[Path]:
    """The allowed folders, resolved as the checks compare them."""
    return [Path(root).expanduser().resolve() for root in roots]


def _refusal(field: str, what: str, roots: Sequence[Path], setting: str) -> ProtocolError:
    shown = ", ".join(str(root) for root in roots) or "none"
    return ProtocolError(ErrorCode.INVALID_REQUEST,
                         f"{field} {what} leads outside the folders this service may read ({shown}): paths from the "
                         f"bus stay under them; to allow it, add its folder to {setting}", field)


def under_roots(path: str | os.PathLike, roots: Sequence[str | os.PathLike], data_dir: str | os.PathLike,
                field: str, setting: str) -> Path:
    """``path`` resolved (relative: from ``data_dir``), when it lies under one of ``roots``; else
    :class:`ProtocolError` naming ``field`` and ``setting`` (the flag or variable that lists the roots)."""
    allowed = resolve_roots(roots)
    resolved = resolve_path(path, data_dir)
    if not inside(resolved, allowed):
        raise _refusal(field, repr(str(path)), allowed, setting)
    return resolved


def tree(top: Path) -> Iterator[Path]:
    """Every entry below the folder ``top``, links included; a linked folder is walked too, once."""
    seen = {top.resolve()}
    for folder, dirs, files in os.walk(top, followlinks=True):
        for name in list(dirs):
            entry = Path(folder) / name
            yield entry
            target = entry.resolve()
            if target in seen:  # a loop, or a folder reached twice
                dirs.remove(name)
            seen.add(target)
        for name in files:
            yield Path(folder) / name


def tree_under_roots(top: Path, roots: Sequence[str | os.PathLike], field: str, setting: str,
                     entries: Iterable[Path] | None = None) -> None:
    """Refuse (as :func:`under_roots`) when an entry below the folder ``top`` resolves outside
    ``roots``: a link inside an allowed folder pointing out. ``entries``: the paths below ``top``
    that will be read (default: all of them, :func:`tree`). The refusal names the entry, not its target."""
    allowed = resolve_roots(roots)
    for entry in tree(top) if entries is None else entries:
        if not inside(entry.resolve(), allowed):
            try:
                shown = entry.relative_to(top)
            except ValueError:
                shown = entry
            raise _refusal(field, f"{str(top)!r}: its entry {str(shown)!r}", allowed, setting)
