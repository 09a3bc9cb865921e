"""The air-gapped install, for real: ``tandem bundle`` made here (with the network), then installed and
run in a network namespace that has none.

* The bundle: ``python -m tandem bundle --out DIR`` (the CPU torch, this machine's platform), into a
  folder kept between runs in ``~/.cache/tandem/bundle-test/`` and remade there with ``--force``,
  which rebuilds, re-resolves and re-hashes everything but keeps the wheels still wanted (so a
  second run downloads nothing). A clean machine fetches them all.
* Offline: ``unshare --net --mount`` (root): only a loopback interface, and, in the namespace's own
  mounts, every local folder this host's pip takes wheels from (find-links, file:// indexes, its
  cache) hidden under an empty tmpfs, so the bundle is the only place a wheel can come from. A
  connect to PyPI's address must fail there before anything else runs. Then the bundle's
  install.sh (checksums, a fresh venv, ``pip install --no-index`` from wheels/), and the venv's
  ``tandem up --demo --exit-after-demo``, which must print generated text.
* Images: when a docker engine answers and holds the compose file's images, the bundle saves them
  (``--images require``) and install.sh ``docker load``s them inside the namespace (the engine's
  unix socket is reachable from it; its network is not needed). Otherwise that part is skipped
  and the test says why; tests/e2e/test_compose_up.py builds and runs the images.
* ``--torch cuda --dry-run``: resolves PyPI's CUDA torch and its nvidia-* wheels from metadata only,
  with a fresh pip cache that must stay small (the torch wheel alone is over 500 MB).

Times on a 2-core machine: the bundle about 100 s from an empty cache (most of it pip resolving
and downloading ~75 wheels, 260 MB), about 60 s when remade; the offline install about 2 min (torch
unpacking); ``tandem up --demo`` about 25 s; the CUDA dry run about 100 s.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("TANDEM_BUNDLE_TEST_CACHE", Path.home() / ".cache" / "tandem" / "bundle-test"))
# where the docker helper's engine listens (tests/docker_support.py), besides DOCKER_HOST and the default
ENGINE_SOCKETS = ("/var/run/docker.sock", "/run/tandem-dockerd/docker.sock")
PYPI_FALLBACK_IP = "151.101.0.223"  # pypi.org's address, for a host that cannot even resolve it


def offline_capable() -> str | None:
    """None when this host can make a network namespace; otherwise why not."""
    if os.geteuid() != 0:
        return "unshare --net needs root"
    for tool in ("unshare", "ip", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"no {tool} command"
    probe = subprocess.run(["unshare", "--net", "--mount", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --net --mount fails here: {probe.stderr.strip()}"
    return None


def docker_with_images() -> tuple[dict[str, str] | None, str]:
    """(DOCKER_HOST for an engine that holds every CPU image of the compose file, or None; why)."""
    from tandem.cli.bundle import compose_images

    if shutil.which("docker") is None:
        return None, "no docker command"
    images = compose_images(REPO / "compose" / "docker-compose.yml", "cpu")
    hosts = [h for h in (os.environ.get("DOCKER_HOST"), *(f"unix://{s}" for s in ENGINE_SOCKETS)) if h]
    for host in hosts:
        env = {"DOCKER_HOST": host}
        up = subprocess.run(["docker", "version"], capture_output=True, env={**os.environ, **env}, timeout=30)
        if up.returncode != 0:
            continue
        missing = [i for i in images if subprocess.run(["docker", "image", "inspect", i], capture_output=True,
                                                       env={**os.environ, **env}, timeout=60).returncode != 0]
        if missing:
            return None, f"the engine at {host} lacks {', '.join(missing)} (tests/e2e/test_compose_up.py builds them)"
        return env, f"the engine at {host} holds {', '.join(images)}"
    return None, f"no docker engine answers ({', '.join(hosts)})"


def pip_local_sources() -> list[str]:
    """Every local folder this host's pip could take a wheel from: find-links, file:// indexes and its cache."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    values = os.environ.get("PIP_FIND_LINKS", "").split() + os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    values += os.environ.get("PIP_INDEX_URL", "").split()
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("find-links", "index-url")):
            values += value.strip().strip("'\"").split()
    cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True).stdout
    values += cache.split()
    folders: list[str] = []
    for value in values:
        path = Path(value.removeprefix("file://"))
        if value.startswith("file://") and path.name == "simple":
            path = path.parent  # a file:// index's files lie beside its simple/ pages
        # never a folder holding the bundle or this Python: hiding it would hide what is being tested
        keep = (CACHE, Path(sys.prefix), Path(sys.base_prefix), REPO)
        if any(k == path or path in k.parents for k in keep):
            continue
        if path.is_absolute() and path.is_dir() and str(path) not in folders:
            folders.append(str(path))
    return folders


def pypi_address() -> str:
    try:
        return socket.getaddrinfo("pypi.org", 443, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return PYPI_FALLBACK_IP


@pytest.fixture(scope="module")
def bundle() -> tuple[Path, subprocess.CompletedProcess, float, dict[str, str] | None, str]:
    """(the bundle, the command's output, its seconds, DOCKER_HOST when images are in it, why or why not)."""
    why = offline_capable()
    if why:
        pytest.skip(why)
    CACHE.mkdir(parents=True, exist_ok=True)
    lock = (CACHE / "lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # two runs at once share one bundle folder: one after the other
    out = CACHE / "bundle"
    if out.exists() and not (out / "bundle.json").exists():
        shutil.rmtree(out)
    docker_env, docker_note = docker_with_images()
    print(f"\nbundle test: images: {docker_note}")
    cmd = [sys.executable, "-m", "tandem", "bundle", "--out", str(out), "--images",
           "require" if docker_env else "skip", *(["--force"] if out.exists() else [])]
    started = time.monotonic()
    made = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **(docker_env or {})})
    took = time.monotonic() - started
    print(f"bundle test: tandem bundle took {took:.0f} s")
    assert made.returncode == 0, made.stdout + made.stderr
    try:
        yield out, made, took, docker_env, docker_note
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def test_the_bundle_holds_wheels_files_checksums_and_says_its_progress(bundle):
    out, made, _, _, _ = bundle
    lines = made.stdout.splitlines()
    assert any("wheels: built tandem-" in line for line in lines)
    fetch = next(line for line in lines if " to fetch besides tandem's" in line)
    total = int(fetch.split("wheels: ")[1].split()[0])
    fetching = [line for line in lines if "wheels: fetching" in line]
    already = [line for line in lines if " already in " in line]
    # one line a wheel, counting up to the total (after the ones a previous bundle already had)
    if fetching:
        assert fetching[-1].split("wheels: fetching ")[1].startswith(f"{total} of {total}: "), made.stdout
    else:
        assert already and already[0].split("wheels: ")[1].startswith(f"{total} of {total} "), made.stdout
    assert any(f"checksums: {n} files in SHA256SUMS" in made.stdout for n in range(total, total + 200))
    manifest = json.loads((out / "bundle.json").read_text())
    assert manifest["complete"] and manifest["torch"] == "torch==2.13.0+cpu"
    wheels = sorted(p.name for p in (out / "wheels").iterdir())
    assert len(wheels) == total + 1 and manifest["wheels"] == wheels
    assert any(w.startswith("torch-2.13.0+cpu-") for w in wheels) and any(w.startswith("numpy-") for w in wheels)
    for rel in ("compose/docker-compose.yml", "compose/nats.conf", "compose/README.md",
                "compose/kubernetes/base/kustomization.yaml", "install.sh", "requirements.txt"):
        assert (out / rel).is_file(), rel
    check = subprocess.run(["sha256sum", "-c", "--strict", "--quiet", "SHA256SUMS"], cwd=out, capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    listed = {line.split("  ", 1)[1] for line in (out / "SHA256SUMS").read_text().splitlines()}
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"SHA256SUMS"}
    assert listed == on_disk


OFFLINE_SCRIPT = r"""
set -eu
ip link set lo up
for folder in $HIDE; do mount -t tmpfs tandem-bundle-test "$folder"; done
"$HOST_PYTHON" - <<'EOF'
import os, socket
try:
    socket.create_connection((os.environ["PYPI_IP"], 443), timeout=5).close()
    print("offline check: CONNECTED to PyPI")
except OSError as exc:
    print(f"offline check: connect to PyPI ({os.environ['PYPI_IP']}:443) failed: {exc}")
try:
    socket.getaddrinfo("pypi.org", 443)
    print("offline check: RESOLVED pypi.org")
except OSError as exc:
    print(f"offline check: pypi.org does not resolve: {exc}")
EOF
PYTHON="$HOST_PYTHON" "$BUNDLE/install.sh" "$VENV"
"$VENV/bin/python" -c "import tandem, torch; print('installed: tandem from', tandem.__file__, torch.__version__)"
"$VENV/bin/tandem" up --demo --exit-after-demo
"""


def test_installs_and_runs_with_no_network(bundle, tmp_path):
    out, _, _, docker_env, docker_note = bundle
    hide = pip_local_sources()
    venv = tmp_path / "venv"
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(Path.home()),
           "LANG": "C.UTF-8", "HIDE": " ".join(hide), "HOST_PYTHON": sys.executable, "PYPI_IP": pypi_address(),
           "BUNDLE": str(out), "VENV": str(venv), "TANDEM_DATA_DIR": str(tmp_path / "data"),
           "TANDEM_HTTP_PORT": "0", "TANDEM_LOG_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    if docker_env:
        env.update(docker_env)
    else:
        print(f"\nbundle test: docker load skipped: {docker_note}")
    script = tmp_path / "offline.sh"
    script.write_text(OFFLINE_SCRIPT)
    started = time.monotonic()
    ran = subprocess.run(["unshare", "--net", "--mount", "sh", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=1200)
    print(f"bundle test: offline install and tandem up took {time.monotonic() - started:.0f} s "
          f"(hidden from pip: {', '.join(hide) or 'nothing'})")
    text = ran.stdout + ran.stderr
    assert "offline check: connect to PyPI" in text and "failed" in text.split("offline check: connect")[1][:200], text
    assert "CONNECTED" not in text and "RESOLVED" not in text, text
    assert ran.returncode == 0, text[-6000:]
    assert "install.sh: checking SHA256SUMS" in text and "install.sh: done. Next:" in text
    installed = next(line for line in text.splitlines() if line.startswith("installed: tandem from"))
    assert str(venv) in installed and installed.endswith(" 2.13.0+cpu")
    assert "--- demo: 'def fibonacci(n):'" in text and "tandem up: stopped" in text
    demo = text.split("--- demo: ")[1].split("\n--- ")[0]
    generated = demo.split("\n", 1)[1].strip()
    assert generated.startswith("def fibonacci(n):") and len(generated) > len("def fibonacci(n):"), demo
    if docker_env:
        assert "install.sh: docker load -i images/" in text and "Loaded image" in text, text[-4000:]


def test_cuda_torch_is_planned_from_metadata_only(tmp_path):
    cache = tmp_path / "pip-cache"
    started = time.monotonic()
    # the serving extra: it brings torch (the base install is the client side, without it)
    cmd = [sys.executable, "-m", "tandem", "bundle", "--torch", "cuda", "--dry-run", "--extras", "serve"]
    ran = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PIP_CACHE_DIR": str(cache)})
    print(f"\nbundle test: the CUDA dry run took {time.monotonic() - started:.0f} s")
    assert ran.returncode == 0, ran.stdout + ran.stderr
    listed = [line.split() for line in ran.stdout.splitlines() if line.startswith("  ")]
    pins = {pin.split("==")[0].lower(): pin.split("==")[1] for pin, _ in listed}
    assert pins["torch"] == "2.13.0", "the CUDA build has no +cpu label"
    assert any(name.startswith("nvidia-") for name in pins), pins
    assert "torch===2.13.0" in ran.stdout and "download.pytorch.org" not in ran.stdout
    cached = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
    assert cached < 100 * 2**20, f"the dry run downloaded {cached / 2**20:.0f} MiB"
