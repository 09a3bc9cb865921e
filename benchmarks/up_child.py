"""``tandem up`` as a benchmark's child process: started on its own data dir, waited for until its
ready line, stopped at the end. The benchmarks that measure the whole system share it
(``from up_child import tandem_up``: a script's own folder is on its import path)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tandem.client.runstate import find_running

READY = "tandem up: NATS at"


@contextmanager
def tandem_up(up_args: list[str], data_dir: Path, log_path: Path,
              on_line: Callable[[str], None] | None = None) -> Iterator[str]:
    """Run ``python -m tandem up *up_args`` on ``data_dir`` for the ``with`` block; yields its NATS URL
    once it printed its ready line (the state file names the URLs then). Its stderr goes to
    ``log_path``; ``on_line`` sees each line it prints before it is ready. A ``tandem up`` that exits
    before it is ready ends the script in one line naming the log."""
    env = {**os.environ, "TANDEM_DATA_DIR": str(data_dir)}
    with open(log_path, "w") as log:
        up = subprocess.Popen([sys.executable, "-m", "tandem", "up", *up_args], env=env, stdout=subprocess.PIPE,
                              stderr=log, text=True)
        try:
            for line in up.stdout:
                if on_line is not None:
                    on_line(line)
                if line.startswith(READY):
                    url = find_running(data_dir).nats_url
                    break
            else:
                raise SystemExit(f"tandem up exited before it was ready; see {log_path}")
            yield url
        finally:
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
