"""Paths that arrive over the bus stay under the data dir.

A training job's ``output_dir`` and a ``WeightsUpdated`` event's ``path`` come from whoever can
publish on those subjects. Unchecked, a job could write its checkpoint anywhere the trainer may
write, and an event could make every serving worker load weights from any folder. Both are
resolved (symlinks followed, ``..`` collapsed; a relative path counts from the data dir) and
must lie under the data dir.
"""

from __future__ import annotations

from pathlib import Path

from tandem.shared.protocol.base import ErrorCode, ProtocolError


def under_data_dir(path: str | Path, data_dir: str | Path, field: str) -> Path:
    """``path`` resolved, when it lies under ``data_dir``; else :class:`ProtocolError` naming ``field``."""
    root = Path(data_dir).expanduser().resolve()
    given = Path(path).expanduser()
    resolved = (given if given.is_absolute() else root / given).resolve()
    if not resolved.is_relative_to(root):
        raise ProtocolError(ErrorCode.INVALID_REQUEST,
                            f"{field} {str(path)!r} is outside the data dir {root}: paths from the bus stay under it",
                            field)
    return resolved
