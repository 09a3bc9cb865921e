"""Start-up cost of tandem's light processes: the router, the KV-store and a bare ``import tandem.client``.

For each process kind it measures, over ``--repeat`` fresh starts (the median is printed):

- start-up: wall seconds from spawning the process until it answers ``$SRV.PING.tandem-<service>``
  (the client: until ``import tandem.client`` has finished and the process has printed a line);
- memory once up: VmRSS and VmHWM of the process from ``/proc/<pid>/status``, in MiB;
- torch: whether libtorch is mapped into the process (``/proc/<pid>/maps`` names ``libtorch`` or
  ``torch/_C``);
- modules: ``len(sys.modules)`` once up, and which notable heavy packages are among them.

It starts its own nats-server (with JetStream: the router creates the KV-events stream), gives each
start a fresh data dir under one temporary folder, and stops everything it started, even on error or
Ctrl-C (each child runs in its own session and its process group is killed; children also get
PR_SET_PDEATHSIG). The children run this interpreter (``sys.executable``) in a neutral working
directory, so ``tandem`` resolves as it does for this interpreter, never to a checkout in the
current directory; every child reports its ``tandem.__file__`` and a mismatch is an error. Children
get no inherited ``TANDEM_*`` variables (defaults only, log level WARNING)::

    python3 benchmarks/service_startup.py                               # router, kvstore, client; 5 runs each
    python3 benchmarks/service_startup.py --repeat 3 --services router,client --json-out /tmp/startup.json
    /tmp/venv-before/bin/python benchmarks/service_startup.py --json-out /tmp/startup-before.json

Module counts come from a watcher thread that the service's bootstrap line starts before it runs
``python -m tandem serve <service>`` (via runpy); the thread sleeps until asked, then copies
``sys.modules``. ``--no-modules`` spawns the exact ``python -m tandem serve ...`` command instead
(no module count). Only relative figures matter: compare runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

KINDS = ("router", "kvstore", "client")
SERVICE_NAMES = {"router": "tandem-router", "kvstore": "tandem-kvstore"}
# Top-level packages worth naming when they turn up in a light process.
HEAVY = ("torch", "numpy", "sympy", "safetensors", "tokenizers", "transformers", "textual", "rich",
         "pydantic", "pydantic_settings", "prometheus_client", "jinja2", "networkx", "uvloop", "msgpack")

# Started by every service child before tandem runs: a daemon thread that sleeps until
# <file>.req exists, then writes tandem.__file__ and the names in sys.modules to <file>.
SERVICE_BOOT = r"""
import json, os, sys, threading, time
def _bench_watch(path=os.environ["TANDEM_BENCH_MODULES_FILE"]):
    while not os.path.exists(path + ".req"):
        time.sleep(0.05)
    for _ in range(50):
        try:
            names = list(sys.modules)
            break
        except RuntimeError:
            time.sleep(0.01)
    t = sys.modules.get("tandem")
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps({"tandem_file": getattr(t, "__file__", None), "modules": names}))
    os.replace(path + ".tmp", path)
threading.Thread(target=_bench_watch, name="bench-modules", daemon=True).start()
import runpy
sys.argv[0] = "tandem"
runpy.run_module("tandem", run_name="__main__", alter_sys=True)
"""

# The client process: import, report, then stay alive (for /proc) until stdin closes.
CLIENT_BOOT = r"""
import tandem.client
import json, sys, tandem
print("ready " + json.dumps({"tandem_file": tandem.__file__, "modules": list(sys.modules)}), flush=True)
sys.stdin.read()
"""


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def die_with_parent() -> None:
    """Children get SIGTERM if this process dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def kill_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the child's process group, then SIGKILL it if it has not exited in time."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            progress(f"pid {proc.pid} ignored SIGTERM for {timeout_s:.0f}s; killing its group")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (grandchildren too)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


# --- nats-server --------------------------------------------------------------------------------

class OwnNats:
    """The repo's NatsServer helper where it imports (either module path), else the bare binary."""

    def __init__(self, workdir: Path) -> None:
        self.helper = None
        self.proc: subprocess.Popen | None = None
        self.url = ""
        helper_cls = None
        for module in ("tandem.shared.infra.natsserver", "tandem.shared.infra.natsserver"):
            try:
                helper_cls = __import__(module, fromlist=["NatsServer"]).NatsServer
                self.how = module
                break
            except ImportError:
                continue
        if helper_cls is not None:
            self.helper = helper_cls.start()
            self.url = self.helper.url
            return
        self.how = "nats-server binary"
        binary = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        store = workdir / "jetstream"
        log = open(workdir / "nats.log", "wb")
        self.proc = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        self.url = f"nats://127.0.0.1:{port}"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {(workdir / 'nats.log').read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            time.sleep(0.02)
        raise RuntimeError("nats-server did not start within 15 s")

    def stop(self) -> None:
        if self.helper is not None:
            self.helper.stop()
        if self.proc is not None:
            kill_group(self.proc)


# --- /proc ----------------------------------------------------------------------------------------

def proc_status_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024  # kB -> MiB
    return out


def torch_mapped(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libtorch" in maps or "torch/_C" in maps


def child_pids(pid: int) -> list[int]:
    found = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(p) for p in (task / "children").read_text().split()]
    return found


def heavy_of(modules: list[str]) -> list[str]:
    tops = {m.split(".", 1)[0] for m in modules}
    return [h for h in HEAVY if h in tops]


def top_level_counts(modules: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m in modules:
        top = m.split(".", 1)[0]
        counts[top] = counts.get(top, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# --- one start ------------------------------------------------------------------------------------

@dataclass
class Sample:
    startup_s: float
    rss_mib: float
    hwm_mib: float
    torch: bool
    modules: int | None
    heavy: list[str] = field(default_factory=list)
    top_level: dict[str, int] = field(default_factory=dict)
    tandem_file: str | None = None
    children: int = 0


def child_env(data_dir: Path, modules_file: Path | None) -> dict[str, str]:
    # No inherited TANDEM_* settings: every run starts from the defaults, whatever this shell has set.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "PYTHONSTARTUP"}
    env.update(TANDEM_DATA_DIR=str(data_dir), TANDEM_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    if modules_file is not None:
        env["TANDEM_BENCH_MODULES_FILE"] = str(modules_file)
    return env


def log_tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-3000:]
    return ""


async def wait_pong(nc: nats.NATS, name: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> float:
    """perf_counter() at the first answer to $SRV.PING.<name>; raises if the process exits first."""
    deadline = time.monotonic() + timeout_s
    subject = f"$SRV.PING.{name}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before answering:\n{log_tail(log)}")
        try:
            reply = await nc.request(subject, b"", timeout=0.25)
            stamp = time.perf_counter()
            if json.loads(reply.data).get("name") == name:
                return stamp
        except (NoRespondersError, NatsTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer {subject} within {timeout_s:.0f}s:\n{log_tail(log)}")
        await asyncio.sleep(0.01)


async def start_service(kind: str, run_dir: Path, nc: nats.NATS, url: str, args: argparse.Namespace,
                        live: list[subprocess.Popen]) -> Sample:
    modules_file = None if args.no_modules else run_dir / "modules.json"
    serve = ["serve", kind, "--nats-url", url]
    cmd = [sys.executable, "-m", "tandem", *serve] if args.no_modules else [sys.executable, "-c", SERVICE_BOOT, *serve]
    log = run_dir / f"{kind}.log"
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=run_dir, env=child_env(run_dir / "data", modules_file),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with_parent)
    live.append(proc)
    try:
        t1 = await wait_pong(nc, SERVICE_NAMES[kind], proc, log, args.timeout_s)
        await asyncio.sleep(args.settle_s)
        mem = proc_status_mib(proc.pid)
        sample = Sample(startup_s=t1 - t0, rss_mib=mem["VmRSS"], hwm_mib=mem["VmHWM"], torch=torch_mapped(proc.pid),
                        modules=None, children=len(child_pids(proc.pid)))
        if modules_file is not None:
            Path(str(modules_file) + ".req").touch()
            deadline = time.monotonic() + 10
            while not modules_file.exists():
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{kind} did not write its module list:\n{log_tail(log)}")
                await asyncio.sleep(0.02)
            found = json.loads(modules_file.read_text())
            sample.modules = len(found["modules"])
            sample.heavy = heavy_of(found["modules"])
            sample.top_level = top_level_counts(found["modules"])
            sample.tandem_file = found["tandem_file"]
        return sample
    finally:
        kill_group(proc, args.stop_timeout_s)
        live.remove(proc)


def start_client(run_dir: Path, args: argparse.Namespace, live: list[subprocess.Popen]) -> Sample:
    log = run_dir / "client.log"
    with open(log, "wb") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", CLIENT_BOOT], cwd=run_dir, env=child_env(run_dir / "data", None),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                preexec_fn=die_with_parent)
    live.append(proc)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], args.timeout_s)
        line = proc.stdout.readline() if ready else b""
        t1 = time.perf_counter()
        if not line.startswith(b"ready "):
            proc.poll()
            raise RuntimeError(f"client process printed {line[:200]!r} (exit {proc.returncode}):\n{log_tail(log)}")
        time.sleep(args.settle_s)
        found = json.loads(line[len(b"ready "):])
        mem = proc_status_mib(proc.pid)
        return Sample(startup_s=t1 - t0, rss_mib=mem["VmRSS"], hwm_mib=mem["VmHWM"], torch=torch_mapped(proc.pid),
                      modules=len(found["modules"]), heavy=heavy_of(found["modules"]),
                      top_level=top_level_counts(found["modules"]), tandem_file=found["tandem_file"],
                      children=len(child_pids(proc.pid)))
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        kill_group(proc, args.stop_timeout_s)
        with contextlib.suppress(OSError):
            proc.stdout.close()
        live.remove(proc)


# --- report ---------------------------------------------------------------------------------------

def summarize(kind: str, samples: list[Sample]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    mods = [s.modules for s in samples if s.modules is not None]
    return {
        "service": kind,
        "runs": len(samples),
        "startup_s_median": med([s.startup_s for s in samples]),
        "startup_s_min": min(s.startup_s for s in samples),
        "startup_s_max": max(s.startup_s for s in samples),
        "vmrss_mib_median": med([s.rss_mib for s in samples]),
        "vmhwm_mib_median": med([s.hwm_mib for s in samples]),
        "torch_loaded": any(s.torch for s in samples),
        "torch_loaded_runs": sum(s.torch for s in samples),
        "modules_median": med(mods),
        "heavy_packages": samples[-1].heavy,
        "top_level_packages": samples[-1].top_level,
        "children": max(s.children for s in samples),
        "samples": [{k: v for k, v in vars(s).items() if k not in ("top_level",)} for s in samples],
    }


def table(rows: list[dict]) -> str:
    head = ["service", "start s (med)", "min", "max", "VmRSS MiB", "VmHWM MiB", "torch", "modules", "heavy packages"]
    body = []
    for r in rows:
        torch = "yes" if r["torch_loaded_runs"] == r["runs"] else ("no" if not r["torch_loaded"] else
                                                                    f"{r['torch_loaded_runs']}/{r['runs']}")
        body.append([r["service"], f"{r['startup_s_median']:.3f}", f"{r['startup_s_min']:.3f}",
                     f"{r['startup_s_max']:.3f}", f"{r['vmrss_mib_median']:.1f}", f"{r['vmhwm_mib_median']:.1f}",
                     torch, "-" if r["modules_median"] is None else f"{r['modules_median']:.0f}",
                     ",".join(r["heavy_packages"]) or "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i in (0, 8) else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def tree_info() -> dict:
    import tandem

    where = Path(tandem.__file__).resolve().parent
    info = {"tandem_file": tandem.__file__, "commit": None, "dirty": None}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["commit"] = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10)
        info["dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return info


# --- main -----------------------------------------------------------------------------------------

async def run(args: argparse.Namespace, kinds: list[str], workdir: Path, live: list[subprocess.Popen],
              servers: list[OwnNats]) -> list[dict]:
    expect = tree_info()["tandem_file"]
    server = None
    nc = None
    try:
        if any(k != "client" for k in kinds):
            server = OwnNats(workdir)
            servers.append(server)
            progress(f"nats-server at {server.url} (via {server.how})")
            nc = await nats.connect(server.url)
        rows = []
        for kind in kinds:
            samples = []
            for i in range(args.warmup + args.repeat):
                run_dir = workdir / f"{kind}-{i}"
                (run_dir / "data").mkdir(parents=True)
                if kind == "client":
                    sample = start_client(run_dir, args, live)
                else:
                    sample = await start_service(kind, run_dir, nc, server.url, args, live)
                if sample.tandem_file is not None and Path(sample.tandem_file).resolve() != Path(expect).resolve():
                    raise RuntimeError(f"{kind} imported tandem from {sample.tandem_file}, this script from {expect}")
                warm = i < args.warmup
                progress(f"{kind} run {i + 1}/{args.warmup + args.repeat}{' (warm-up, dropped)' if warm else ''}: "
                         f"up in {sample.startup_s:.3f}s, VmRSS {sample.rss_mib:.1f} MiB, "
                         f"VmHWM {sample.hwm_mib:.1f} MiB, "
                         f"torch {'yes' if sample.torch else 'no'}"
                         + ("" if sample.modules is None else f", {sample.modules} modules"))
                if not warm:
                    samples.append(sample)
            rows.append(summarize(kind, samples))
        return rows
    finally:
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        if server is not None:
            server.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5, help="fresh starts per process kind; the median is reported")
    p.add_argument("--warmup", type=int, default=0, help="extra starts first, not counted (warm the page cache)")
    p.add_argument("--services", default=",".join(KINDS), help=f"comma-separated, from {','.join(KINDS)}")
    p.add_argument("--settle-s", type=float, default=0.3, help="wait this long after it is up before reading /proc")
    p.add_argument("--timeout-s", type=float, default=120.0, help="give up on a start after this long")
    p.add_argument("--stop-timeout-s", type=float, default=10.0, help="SIGTERM grace before SIGKILL")
    p.add_argument("--no-modules", action="store_true",
                   help="spawn the plain `python -m tandem serve ...` (no module count for services)")
    p.add_argument("--json-out", help="also write the figures (and every sample) to this JSON file")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.kinds = [k.strip() for k in args.services.split(",") if k.strip()]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown or not args.kinds:
        p.error(f"--services: unknown {unknown or 'empty list'}; choose from {','.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    live: list[subprocess.Popen] = []
    servers: list[OwnNats] = []
    workdir = Path(tempfile.mkdtemp(prefix="tandem-startup-"))

    def on_signal(signum, frame):  # unwind through the finally blocks wherever we are
        raise KeyboardInterrupt

    # Our own SIGINT handler too: asyncio.run's (cancel the main task) can be swallowed by a
    # nats request's wait_for on Python 3.11, and then nothing stops.
    signal.signal(signal.SIGTERM, on_signal)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_signal)
    info = tree_info()
    progress(f"python {sys.executable} ({platform.python_version()}), tandem from {info['tandem_file']}"
             f" (commit {(info['commit'] or '?')[:10]}{', dirty' if info['dirty'] else ''}); temp dir {workdir}")
    try:
        rows = asyncio.run(run(args, args.kinds, workdir, live, servers))
    except KeyboardInterrupt:
        progress("interrupted")
        return 130
    finally:
        for proc in list(live):
            kill_group(proc, 2.0)
        for server in servers:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(table(rows), flush=True)
    if args.json_out:
        doc = {
            "benchmark": "service_startup",
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": sys.executable,
            "python_version": platform.python_version(),
            **info,
            "host": socket.gethostname(),
            "cpus": os.cpu_count(),
            "settings": {k: v for k, v in vars(args).items() if k != "kinds"},
            "results": {r["service"]: r for r in rows},
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        progress(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
