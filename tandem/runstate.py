"""The running ``tandem up``'s state file: how every other command on this machine finds it.

``tandem up`` writes ``<data-dir>/run/up.json`` once its services are ready (its pid and every URL it
serves) and removes it when it stops. :func:`find_running` reads it back, and only while that pid is
alive, so a file left by a killed ``up`` is never taken for a running one. No torch: the client
library imports this.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tandem.shared.infra.config import default_data_dir


def data_dir_in_use() -> Path:
    """``TANDEM_DATA_DIR``, else the settings' default: the data dir a command given none uses."""
    return Path(os.environ["TANDEM_DATA_DIR"]) if os.environ.get("TANDEM_DATA_DIR") else default_data_dir()


@dataclass
class RunState:
    pid: int
    nats_url: str
    http_url: str = ""  # the frontend's OpenAI-compatible API ("" when none runs)
    metrics_urls: dict[str, str] = field(default_factory=dict)  # instance id -> its /metrics page


def state_file(data_dir: Path | str) -> Path:
    return Path(data_dir) / "run" / "up.json"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def find_running(data_dir: Path | str | None = None) -> RunState | None:
    """The state of the ``tandem up`` running on ``data_dir`` (default: :func:`data_dir_in_use`), if any."""
    path = state_file(data_dir_in_use() if data_dir is None else data_dir)
    try:
        raw = json.loads(path.read_text())
        state = RunState(pid=int(raw["pid"]), nats_url=str(raw["nats_url"]), http_url=str(raw.get("http_url", "")),
                         metrics_urls=dict(raw.get("metrics_urls", {})))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return state if pid_alive(state.pid) else None


def find_running_url(data_dir: Path | str | None = None) -> str | None:
    """The NATS URL of the ``tandem up`` running on ``data_dir``, if any."""
    state = find_running(data_dir)
    return state.nats_url if state else None


def write_state(data_dir: Path | str, state: RunState) -> None:
    path = state_file(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state)))
    tmp.replace(path)  # readers never see half a file


def remove_state(data_dir: Path | str, pid: int) -> None:
    """Remove the state file if it is ``pid``'s (never another ``up``'s)."""
    path = state_file(data_dir)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass
