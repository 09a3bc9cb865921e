"""What identities on the bus cost at start-up: keys, the server, one connection, a whole ``tandem up``.

Measured in one run, each with and without identities: making a keyring and its server config; a
nats-server starting with that config and without; a connection (anonymous, and with a user minted
from a role key: the JWT, the nonce signature, the permission template); and ``tandem up`` until its
state file is written, in ABBA order (default, ``--insecure``, ``--insecure``, default, per round) so
that drift within a round cancels. Prints one line per figure with the ratio secured / open.

    python3 benchmarks/bus_auth_cost.py [--rounds 2] [--connects 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

from tandem.client.runstate import find_running
from tandem.shared.auth.credentials import connect_options
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra.natsserver import NatsServer


def ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:8.1f} ms"


def line(what: str, secured: list[float], open_: list[float]) -> None:
    ratio = statistics.median(secured) / statistics.median(open_)
    print(f"{what:<34} secured {ms(secured)}   open {ms(open_)}   ratio {ratio:5.2f}", flush=True)


async def connects(url: str, n: int, options_for) -> list[float]:  # noqa: ANN001 - () -> dict
    times = []
    for _ in range(n):
        start = time.perf_counter()
        nc = await nats.connect(url, **options_for())
        await nc.flush()
        times.append(time.perf_counter() - start)
        await nc.close()
    return times


def up_until_ready(insecure: bool, timeout_s: float = 300) -> float:
    with tempfile.TemporaryDirectory(prefix="tandem-auth-cost-") as data_dir:
        env = dict(os.environ, TANDEM_DATA_DIR=data_dir, TANDEM_HTTP_PORT="0", TANDEM_LOG_LEVEL="WARNING")
        env.pop("TANDEM_NATS_URL", None)
        cmd = [sys.executable, "-m", "tandem", "up", "--kvstore", "0", *(["--insecure"] if insecure else [])]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while find_running(Path(data_dir)) is None:
                if proc.poll() is not None or time.perf_counter() - start > timeout_s:
                    raise SystemExit(f"tandem up {'--insecure ' if insecure else ''}did not get ready")
                time.sleep(0.05)
            return time.perf_counter() - start
        finally:
            proc.send_signal(2)
            proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2, help="ABBA rounds of tandem up (4 starts each)")
    p.add_argument("--connects", type=int, default=50, help="connections timed per kind")
    args = p.parse_args()

    keyring_s = []
    for _ in range(20):
        start = time.perf_counter()
        ring = Keyring.generate()
        ring.server_config()
        keyring_s.append(time.perf_counter() - start)
    print(f"{'keyring + server config':<34} {ms(keyring_s)} (no open counterpart)", flush=True)

    secured_start, open_start, secured_conn, open_conn = [], [], [], []
    client_key = ring.role_key("client")
    for _ in range(3):
        for auth in (True, False):
            start = time.perf_counter()
            server = NatsServer.start(auth_config=ring.server_config() if auth else "")
            (secured_start if auth else open_start).append(time.perf_counter() - start)
            try:
                if auth:
                    secured_conn += asyncio.run(connects(server.url, args.connects,
                                                         lambda: connect_options(client_key, "bench")))
                else:
                    open_conn += asyncio.run(connects(server.url, args.connects, dict))
            finally:
                server.stop()
    line("nats-server start", secured_start, open_start)
    line("one connection (mint + connect)", secured_conn, open_conn)

    secured_up, open_up = [], []
    for r in range(args.rounds):
        for insecure in (False, True, True, False):
            took = up_until_ready(insecure)
            (open_up if insecure else secured_up).append(took)
            print(f"  round {r + 1}: tandem up{' --insecure' if insecure else ''} ready in {took:.2f} s",
                  file=sys.stderr, flush=True)
    if secured_up:
        line("tandem up until ready", secured_up, open_up)


if __name__ == "__main__":
    main()
