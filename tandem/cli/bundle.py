"""``tandem bundle --out DIR``: everything a host without network access needs to install and run tandem.

The bundle, written into DIR::

    wheels/           tandem's wheel and every dependency's, for one target platform (torch CPU or CUDA)
    images/           the compose file's images, ``docker save``d (when an engine and the images are there)
    compose/          docker-compose.yml, .env, nats.conf, README.md and kubernetes/
    requirements.txt  the exact versions resolved (the install uses it as constraints)
    bundle.json       what was bundled: target, torch variant, images, tandem's version
    install.sh        checks SHA256SUMS, makes a venv, installs from wheels/ only, loads the images
    SHA256SUMS        every other file's SHA-256, as ``sha256sum -c`` reads it

The wheels are fetched in two steps with the host's own pip (its index, find-links and certificates):
a resolution (``pip install --dry-run --report``, metadata only), which gives the count and the exact
versions, then a ``pip download --no-deps`` of those pins, whose progress is one line a wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

PROG = "tandem bundle"
# The PyPI default index's Linux torch wheels carry CUDA; the CPU builds (local version "+cpu") live here.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# As compose/Dockerfile installs it: the engine and the trainer (the base install is the client side only,
# and install.sh's next step is `tandem up`) and the planner's Kubernetes actuator.
DEFAULT_EXTRAS = ("all", "kubernetes")
# Copied into the bundle's compose/, relative to the source checkout; a folder is copied whole.
DEPLOY_FILES = ("compose/docker-compose.yml", "compose/.env", "compose/nats.conf", "compose/README.md",
                "compose/kubernetes")
MANIFEST = "bundle.json"
SUMS = "SHA256SUMS"
INSTALL = "install.sh"
PINS = "requirements.txt"


class BundleError(Exception):
    """A bundle that cannot be made; ``str()`` is the one line naming what to change."""

    exit_code = 1


class BundleUsageError(BundleError):
    """The command line cannot run as given (exit 2, as the rest of the CLI)."""

    exit_code = 2


def say(message: str) -> None:
    print(f"{PROG}: {message}", flush=True)


# --- target platform -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """The platform the wheels are for. ``platform`` None: this machine (pip picks by its own tags)."""

    platform: str | None = None
    python_version: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    implementation: str = "cp"

    @property
    def abi(self) -> str:
        return f"{self.implementation}{self.python_version.replace('.', '')}"

    @property
    def native(self) -> bool:
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.platform is None and self.python_version == here and self.implementation == "cp"

    @property
    def os_name(self) -> str:
        """``linux``, ``darwin`` or ``win32``: sys.platform on the target."""
        tag = self.platform or sys.platform
        if tag.startswith(("manylinux", "musllinux", "linux")):
            return "linux"
        if tag.startswith(("macosx", "darwin")):
            return "darwin"
        if tag.startswith("win"):
            return "win32"
        raise BundleUsageError(f"--platform {tag}: not a platform tag pip knows (e.g. manylinux_2_28_x86_64, "
                               "macosx_14_0_arm64, win_amd64)")

    def platform_tags(self) -> list[str]:
        """What ``--platform`` gets: a manylinux_2_N tag stands for every older glibc too, which pip 23
        does not infer (a wheel tagged manylinux_2_17 runs on a 2_28 host but would not be chosen)."""
        if self.platform is None:
            return []
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", self.platform)
        if not m:
            return [self.platform]
        glibc, arch = int(m.group(1)), m.group(2)
        tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
        legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
        tags += [f"{name}_{arch}" for n, name in legacy.items() if n <= glibc]
        return tags

    def pip_options(self) -> list[str]:
        """pip's target flags; none for this machine, where pip's own tags and marker values are right."""
        if self.native:
            return []
        options: list[str] = []
        for tag in self.platform_tags():
            options += ["--platform", tag]
        return options + ["--python-version", self.python_version, "--implementation", self.implementation,
                          "--abi", self.abi]

    def describe(self) -> str:
        where = self.platform or f"this machine's ({sys.platform} {platform.machine()})"
        return f"{where}, Python {self.python_version} ({self.abi})"


# --- what to fetch ---------------------------------------------------------------------------------------


def torch_pin(variant: str, version: str, target: Target) -> str:
    """The torch requirement for a variant. ``===`` is exact string equality, so the CUDA pin cannot be
    met by a ``+cpu`` build from find-links (``==2.13.0`` would be: PEP 440 ignores the local label)."""
    if variant not in ("cpu", "cuda"):
        raise BundleUsageError(f"--torch {variant}: choose cpu or cuda")
    base = version.split("+", 1)[0]
    if variant == "cuda":
        if target.os_name != "linux":
            raise BundleUsageError(f"--torch cuda: PyPI's CUDA torch wheels are Linux ones; the target is "
                                   f"{target.os_name}: use --torch cpu")
        return f"torch==={base}"
    if target.os_name == "linux" or target.os_name == "win32":
        return f"torch=={base}+cpu"
    return f"torch==={base}"  # macOS: PyPI's wheels are the CPU build, with no local label


def read_pyproject(source: Path) -> dict:
    try:
        return tomllib.loads((source / "pyproject.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BundleError(f"cannot read {source / 'pyproject.toml'}: {exc}; pass --source, a tandem checkout") from exc


def canonical_name(name: str) -> str:
    """PEP 503's form: ``Jinja2`` and ``jinja2``, ``pydantic_core`` and ``pydantic-core`` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(text: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", text)
    if not m:
        raise BundleError(f"pyproject.toml: {text!r} is not a requirement pip reads; fix it there")
    return canonical_name(m.group(1))


def extra_lines(project: dict, extras: Iterable[str]) -> list[str]:
    """The requirements of ``extras``, an extra that names tandem's own (``all = ["tandem[serve,train]"]``)
    replaced by those extras' lines: the bundle's pip fetches dependencies, and tandem itself is not on
    its index."""
    optional = project.get("optional-dependencies", {})
    own = canonical_name(project.get("name", "tandem"))
    lines: list[str] = []
    pending, done = list(extras), set()
    while pending:
        extra = pending.pop(0)
        if extra in done:
            continue
        done.add(extra)
        if extra not in optional:
            raise BundleUsageError(f"--extras {extra}: pyproject.toml has no such extra (it has: "
                                   f"{', '.join(sorted(optional)) or 'none'})")
        for line in optional[extra]:
            if requirement_name(line) == own:
                pending += [e.strip() for e in re.findall(r"\[([^\]]*)\]", line)[0].split(",") if e.strip()]
            else:
                lines.append(line)
    return lines


def requirements(project: dict, extras: Iterable[str], torch: str) -> list[str]:
    """pyproject's dependencies and the extras', as written, with torch's variant pin right after
    pyproject's torch range: pip checks the one against the other, and decides the markers."""
    extras = list(extras)
    lines = list(project.get("dependencies", [])) + extra_lines(project, extras)
    out: list[str] = []
    for line in lines:
        if line in out:
            continue
        out.append(line)
        if requirement_name(line) == "torch":
            out.append(torch)
    if torch not in out:
        named = ",".join(extras) or "''"
        raise BundleUsageError(f"--extras {named}: none of them brings torch, which the bundle is for (install.sh's "
                               "next step is `tandem up`): add serve, or all")
    return out


def dockerfile_torch_version(source: Path) -> str:
    """The torch version the images are built with (compose/Dockerfile's ARG), so wheels and images agree."""
    text = (source / "compose" / "Dockerfile").read_text() if (source / "compose" / "Dockerfile").is_file() else ""
    m = re.search(r"^ARG TORCH_VERSION=(\S+)", text, re.M)
    if m:
        return m.group(1)
    try:
        import torch
    except ImportError as exc:
        raise BundleUsageError("no torch version to bundle: pass --torch-version (e.g. 2.13.0)") from exc
    return torch.__version__.split("+")[0]


def compose_images(compose_file: Path, variant: str, environ: dict[str, str] | None = None) -> list[str]:
    """The images the compose file names, ``${VAR:-default}`` resolved as compose would. The CPU variant
    leaves out the CUDA image (its tag ends in ``-gpu``): only the gpu profiles use it."""
    environ = dict(os.environ if environ is None else environ)

    def expand(m: re.Match) -> str:
        name, _, default = m.group(1).partition(":-")
        return environ.get(name) or default

    images: list[str] = []
    for m in re.finditer(r"^\s*image:\s*[\"']?([^\"'\s#]+)", compose_file.read_text(), re.M):
        image = re.sub(r"\$\{([^}]+)\}", expand, m.group(1))
        if image not in images and (variant == "cuda" or not image.endswith("-gpu")):
            images.append(image)
    return images


def pip_find_links() -> list[Path]:
    """The local folders pip's configuration (files and PIP_FIND_LINKS) adds as find-links."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            values += value.strip().strip("'\"").split()
    folders = []
    for value in values:
        path = Path(value.removeprefix("file://"))
        if path.is_dir() and path not in folders:
            folders.append(path)
    return folders


def wheel_fits(filename: str, target: Target) -> bool:
    """Whether a wheel file's tags are the target's (roughly: its ABI and one of its platform tags)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5:
        return False
    abis, platforms = parts[-2].split("."), parts[-1].split(".")
    if target.abi not in abis and "abi3" not in abis and "none" not in abis:
        return False
    if target.platform is None:
        return any(p == "any" or p.endswith(platform.machine()) for p in platforms)
    return any(p == "any" or p in target.platform_tags() for p in platforms)


def torch_source(pin: str, target: Target, folders: Iterable[Path]) -> tuple[list[str], str]:
    """(pip options, a line saying where torch comes from). A local ``+cpu`` wheel in pip's find-links
    is used as pip would anyway, without adding PyTorch's index (which an intranet may not reach,
    and pip would wait out its timeouts for it)."""
    if "+cpu" not in pin:
        return [], "torch: " + ("the CUDA build from pip's index (PyPI's Linux wheel and its nvidia-* wheels, "
                                "several GB)" if "===" in pin and target.os_name == "linux" else "from pip's index")
    version = pin.split("==", 1)[1]
    for folder in folders:
        for hit in sorted(folder.glob(f"torch-{version}-*.whl")):
            if wheel_fits(hit.name, target):
                return [], f"torch: the CPU build {version} from pip's find-links {folder}"
    return ["--extra-index-url", TORCH_CPU_INDEX], f"torch: the CPU build {version} from {TORCH_CPU_INDEX}"


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    url: str

    @property
    def pin(self) -> str:
        # torch's exact version: "==" would let a differently labelled build stand in (see torch_pin)
        op = "===" if canonical_name(self.name) == "torch" and "+" not in self.version else "=="
        return f"{self.name}{op}{self.version}"

    @property
    def filename(self) -> str:
        """The file pip resolved to, which pip download saves under the same name."""
        return unquote(urlsplit(self.url).path.rsplit("/", 1)[-1])


@dataclass
class Plan:
    """Everything decided before anything is written."""

    source: Path
    target: Target
    torch: str
    requirements: list[str]
    pip_sources: list[str]
    extras: tuple[str, ...]
    images: list[str]
    tandem_version: str
    notes: list[str] = field(default_factory=list)


def pip_failure(lines: list[str]) -> str:
    """The line of pip's output that says what it could not do: the missing distribution, or the
    conflict's cause (pip's last line is only "ResolutionImpossible: for help visit ...")."""
    for n, line in enumerate(lines):
        if line.strip() == "The conflict is caused by:":
            causes = []
            for cause in lines[n + 1:]:
                if not cause.strip():
                    break
                causes.append(cause.strip())
            return "conflicting requirements: " + "; ".join(causes)
    errors = [x.removeprefix("ERROR: ") for x in lines if x.startswith("ERROR:")]
    found = [x for x in errors if x.startswith(("No matching distribution found", "Cannot install"))]
    return (found or errors or lines[-1:] or ["no output"])[-1]


class PipError(BundleError):
    """pip failed; ``lines`` is its output, for a caller that can say more than pip's last line."""

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


def run_pip(args: list[str], on_line: Callable[[str], None] | None = None, what: str = "pip",
            env: dict[str, str] | None = None) -> str:
    """Run pip with the host's configuration; its output streamed to ``on_line``. A failure raises
    one line: pip's last ERROR line, which names the package it could not get."""
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PIP_PROGRESS_BAR="off", PIP_NO_INPUT="1", **(env or {})))
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if on_line is not None:
            on_line(line.rstrip())
    if proc.wait() != 0:
        raise PipError(f"{what} failed: {pip_failure(lines)} (check the index pip uses: pip config list)", lines)
    return "\n".join(lines)


def resolve(plan: Plan) -> list[Wheel]:
    """Every wheel the requirements need on the target, resolved by pip from metadata only."""
    with tempfile.TemporaryDirectory(prefix="tandem-bundle-") as tmp:
        report = Path(tmp) / "report.json"
        try:
            run_pip(["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
                     "--only-binary=:all:", "--target", str(Path(tmp) / "target"), *plan.target.pip_options(),
                     *plan.pip_sources, *plan.requirements], what="resolving the wheels")
        except PipError as exc:
            unreachable = any("NewConnectionError" in line or "ConnectTimeoutError" in line for line in exc.lines)
            if unreachable and TORCH_CPU_INDEX in plan.pip_sources:
                raise BundleError(f"PyTorch's CPU index ({TORCH_CPU_INDEX}) does not answer from here: put the "
                                  f"{plan.torch.split('==')[-1]} torch wheel for {plan.target.describe()} in a "
                                  "folder and name it in PIP_FIND_LINKS") from exc
            raise
        data = json.loads(report.read_text())
    wheels = [Wheel(item["metadata"]["name"], item["metadata"]["version"], item["download_info"]["url"])
              for item in data.get("install", [])]
    return sorted(wheels, key=lambda w: canonical_name(w.name))


# --- files in the bundle ---------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checksums(root: Path) -> str:
    """``sha256sum -c``'s format (hash, two spaces, path relative to the bundle) for every file but
    SHA256SUMS itself, sorted so the same bundle gives the same text."""
    lines = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != SUMS):
        rel = path.relative_to(root).as_posix()
        if "\n" in rel or "\\" in rel:
            raise BundleError(f"{rel!r}: a file name sha256sum cannot list; rename it")
        lines.append(f"{sha256_file(path)}  {rel}\n")
    return "".join(lines)


def verify_checksums(root: Path, text: str) -> list[str]:
    """The paths whose content does not match ``text`` (missing ones included); [] when all do."""
    bad = []
    for line in text.splitlines():
        digest, _, rel = line.partition("  ")
        path = root / rel
        if not path.is_file() or sha256_file(path) != digest:
            bad.append(rel)
    return bad


def install_script(tandem_spec: str, python_version: str, images: list[str]) -> str:
    """install.sh: POSIX sh, run on the offline host from anywhere (it finds the bundle beside itself)."""
    spec = shlex.quote(tandem_spec)
    loads = " ".join(shlex.quote(i) for i in images)
    return f"""#!/bin/sh
# Install tandem from this bundle without any network: ./install.sh [VENV]   (default VENV: ./venv)
# PYTHON=python{python_version} picks the interpreter (the wheels are for Python {python_version}).
set -eu
bundle=$(cd "$(dirname "$0")" && pwd)
venv=${{1:-$bundle/venv}}
python=${{PYTHON:-python3}}
cd "$bundle"

if [ ! -f {SUMS} ]; then
    echo "install.sh: no {SUMS}: the bundle is incomplete; make it again (tandem bundle --out DIR --force)" >&2
    exit 1
fi
for f in wheels/* images/*; do  # a wheel slipped in beside the listed ones would be installable too
    [ -e "$f" ] || continue
    grep -qF "  $f" {SUMS} || {{ echo "install.sh: $f is not in {SUMS}: remove it" >&2; exit 1; }}
done
echo "install.sh: checking {SUMS}"
if command -v sha256sum >/dev/null 2>&1; then
    sha256sum -c --quiet --strict {SUMS} || {{
        echo "install.sh: the files above do not match {SUMS}: copy the bundle over again" >&2; exit 1; }}
else
    "$python" - <<'EOF'
import hashlib, sys
bad = [p for d, p in (l.rstrip("\\n").split("  ", 1) for l in open("{SUMS}"))
       if hashlib.sha256(open(p, "rb").read()).hexdigest() != d]
sys.exit("install.sh: checksum mismatch: " + " ".join(bad) if bad else 0)
EOF
fi

got=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || {{
    echo "install.sh: no $python here: set PYTHON to a Python {python_version} interpreter" >&2; exit 1; }}
if [ "$got" != "{python_version}" ]; then
    echo "install.sh: $python is $got, the wheels are for {python_version}: use PYTHON=python{python_version}" >&2
    exit 1
fi

echo "install.sh: making the virtual environment $venv"
"$python" -m venv "$venv" || {{
    echo "install.sh: $python cannot make a venv (on Debian/Ubuntu: apt-get install python3-venv)" >&2; exit 1; }}

# Only this bundle's wheels: no index, and no pip configuration of this host (its find-links or
# index would mix other wheels in, or make pip wait for a network that is not there).
echo "install.sh: installing {tandem_spec} from wheels/"
PIP_CONFIG_FILE=/dev/null "$venv/bin/python" -m pip install --quiet --isolated --no-index --no-cache-dir \\
    --disable-pip-version-check --find-links "$bundle/wheels" -c "$bundle/{PINS}" {spec}

loaded=""
if [ -n "$(ls images 2>/dev/null)" ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        for tar in images/*.tar; do
            echo "install.sh: docker load -i $tar"
            docker load -i "$tar"
        done
        loaded=yes
    else
        echo "install.sh: no docker engine answers here: images/ not loaded (later: docker load -i images/FILE.tar)"
    fi
fi

echo "install.sh: done. Next: $venv/bin/tandem up --demo"
if [ -n "$loaded" ]; then
    echo "install.sh: or with the loaded images ({loads}): cd $bundle/compose && docker compose up -d"
fi
"""


# --- docker ----------------------------------------------------------------------------------------------


def docker_engine() -> str | None:
    """None when an engine answers; otherwise why not (one clause)."""
    if shutil.which("docker") is None:
        return "no docker command on PATH"
    try:
        out = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "the docker engine did not answer in 20 s"
    if out.returncode != 0:
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock, DOCKER_HOST being unset"
        return f"no docker engine answers at {where}"
    return None


def image_exists(image: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", image], capture_output=True, timeout=60).returncode == 0


def image_file(image: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", image) + ".tar"


def choose_images(wanted: list[str], mode: str) -> tuple[list[str], list[str]]:
    """(images to save, lines saying what was skipped and why). ``require`` raises instead of skipping."""
    if mode == "skip":
        return [], ["images: skipped (--images skip)"]
    why = docker_engine()
    if why is not None:
        if mode == "require":
            raise BundleError(f"--images require: {why}; start dockerd (or set DOCKER_HOST), or use --images auto")
        return [], [f"images: skipped, {why} (--images require makes this an error)"]
    present = [i for i in wanted if image_exists(i)]
    missing = [i for i in wanted if i not in present]
    if missing and mode == "require":
        raise BundleError(f"--images require: {', '.join(missing)} not in the docker engine; build them "
                          "(cd compose && docker compose build) or use --images auto")
    return present, [f"images: {i} skipped, not in the docker engine (build it: cd compose && docker compose build)"
                     for i in missing]


# --- making it -------------------------------------------------------------------------------------------


def find_source(explicit: Path | None) -> Path:
    """The tandem checkout whose compose/ and pyproject.toml go in: --source, else the one this
    tandem was imported from (an editable install)."""
    source = explicit or Path(__file__).resolve().parents[2]  # <checkout>/tandem/cli/bundle.py
    if not ((source / "pyproject.toml").is_file() and (source / "compose" / "docker-compose.yml").is_file()):
        raise BundleUsageError(f"{source} is not a tandem checkout (it needs pyproject.toml and compose/): "
                               "pass --source DIR, a clone of the repository")
    return source


def check_out_dir(out: Path, force: bool) -> bool:
    """Whether ``out`` holds a previous bundle to replace. A non-empty folder is refused unless
    --force, and even then only when it is a bundle (bundle.json in it): --force on a home
    directory must not empty it."""
    if out.exists() and not out.is_dir():
        raise BundleUsageError(f"--out {out}: a file, not a folder; pick a new or empty folder")
    if not out.exists() or not any(out.iterdir()):
        return False
    if not force:
        raise BundleUsageError(f"--out {out} is not empty: pick a new or empty folder, or pass --force to "
                               "replace the bundle in it")
    if not (out / MANIFEST).is_file():
        raise BundleUsageError(f"--out {out} is not empty and holds no {MANIFEST}: --force replaces only a "
                               "previous bundle; pick a new or empty folder")
    return True


def clear_previous(out: Path) -> None:
    """Empty a previous bundle, keeping its wheels/: pip skips a wheel already there, and the ones no
    longer wanted are deleted after the resolution."""
    for entry in out.iterdir():
        if entry.name == "wheels" and entry.is_dir():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def source_files(source: Path) -> list[str]:
    """The files a wheel is built from: what git tracks or would add (so nothing ignored, no build/
    leftovers), or, outside git, the four package folders and the top-level files."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=source, capture_output=True, check=True, timeout=60).stdout
        names = [os.fsdecode(n) for n in out.split(b"\0") if n]
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        names = [p.relative_to(source).as_posix() for p in source.rglob("*")]
    roots = ("tandem", "shared", "services", "console")
    return sorted(n for n in names if (source / n).is_file() and ("/" not in n or n.split("/", 1)[0] in roots))


def source_date(source: Path) -> str:
    """The last commit's time (seconds since the epoch); outside git, 1980-01-01, zip's earliest date."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=source, capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "315532800"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip().isdigit() else "315532800"


def build_tandem_wheel(source: Path, wheels: Path) -> Path:
    """tandem's wheel from a copy of the checkout: an in-tree build would write build/ into the
    checkout and reuse whatever an earlier build left there."""
    for old in wheels.glob("tandem-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="tandem-bundle-src-") as tmp:
        copy = Path(tmp) / "src"
        for name in source_files(source):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, copy / name)
        # the host's setuptools when it has one: no index needed for the build itself
        isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
        # zip entries dated by the last commit, not the build: the same checkout gives the same wheel
        # (and the same line in SHA256SUMS) every time it is bundled
        run_pip(["wheel", "--no-deps", *isolation, "--quiet", "-w", str(wheels), str(copy)],
                what="building tandem's wheel", env={"SOURCE_DATE_EPOCH": source_date(source)})
    built = sorted(wheels.glob("tandem-*.whl"))
    if not built:
        raise BundleError(f"pip built no tandem wheel into {wheels}")
    return built[0]


def fetch_wheels(plan: Plan, wanted: list[Wheel], wheels: Path) -> None:
    """``pip download --no-deps`` of the resolved pins into wheels/, one progress line a wheel; wheels
    already there (a --force rerun) are kept, any other file is removed."""
    names = {w.filename for w in wanted}
    for path in wheels.iterdir():
        if not path.name.startswith("tandem-") and path.name not in names:
            path.unlink()
    todo = [w for w in wanted if not (wheels / w.filename).is_file()]
    total = len(wanted)
    done = total - len(todo)
    if done:
        say(f"wheels: {done} of {total} already in {wheels} from the previous bundle")
    if not todo:
        return
    count = [done]

    def progress(line: str) -> None:
        # pip says "Collecting NAME==V" for an index's wheel and "Processing PATH" for a local one
        m = re.match(r"\s*(?:Collecting|Processing) (\S+)", line)
        if m:
            count[0] += 1
            say(f"wheels: fetching {count[0]} of {total}: {m.group(1).rsplit('/', 1)[-1]}")

    run_pip(["download", "--no-deps", "--only-binary=:all:", "-d", str(wheels), *plan.target.pip_options(),
             *plan.pip_sources, *(w.pin for w in todo)], on_line=progress, what="downloading the wheels")
    missing = [w.filename for w in wanted if not (wheels / w.filename).is_file()]
    if missing:
        raise BundleError(f"pip download did not save {', '.join(missing)}, which the resolution chose; "
                          "run tandem bundle again (an index that changed in between?)")


def copy_deploy_files(source: Path, out: Path) -> int:
    count = 0
    for rel in DEPLOY_FILES:
        src = source / rel
        dst = out / rel
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            count += sum(1 for p in dst.rglob("*") if p.is_file())
        elif src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            count += 1
        else:
            raise BundleError(f"{src} is missing from the checkout; restore it (git checkout -- {rel})")
    return count


def save_images(images: list[str], folder: Path) -> list[dict[str, str]]:
    saved = []
    for n, image in enumerate(images, 1):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / image_file(image)
        say(f"images: saving {n} of {len(images)}: {image} -> images/{path.name}")
        out = subprocess.run(["docker", "save", "-o", str(path), image], capture_output=True, text=True)
        if out.returncode != 0:
            raise BundleError(f"docker save {image} failed: {out.stderr.strip().splitlines()[-1:]}; "
                              "check the engine (docker info) or use --images skip")
        path.chmod(0o644)  # docker save writes 0600; the rest of the bundle is world-readable too
        image_id = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image],
                                  capture_output=True, text=True).stdout.strip()
        saved.append({"image": image, "file": f"images/{path.name}", "id": image_id})
        say(f"images: saved {image} ({path.stat().st_size / 2**20:.0f} MiB)")
    return saved


def make_plan(args: argparse.Namespace) -> Plan:
    source = find_source(args.source)
    project = read_pyproject(source).get("project", {})
    target = Target(platform=args.platform, python_version=args.python_version or Target().python_version)
    extras = tuple(e for e in (args.extras.split(",") if args.extras else []) if e)
    pin = torch_pin(args.torch, args.torch_version or dockerfile_torch_version(source), target)
    reqs = requirements(project, extras, pin)
    pip_sources, torch_note = torch_source(pin, target, pip_find_links())
    images = compose_images(source / "compose" / "docker-compose.yml", args.torch)
    return Plan(source=source, target=target, torch=pin, requirements=reqs, pip_sources=pip_sources, extras=extras,
                images=images, tandem_version=project.get("version", "0"), notes=[torch_note])


def tandem_spec(plan: Plan) -> str:
    extras = f"[{','.join(plan.extras)}]" if plan.extras else ""
    return f"tandem{extras}=={plan.tandem_version}"


def dry_run(plan: Plan) -> int:
    """Say what a bundle would hold, resolving the wheels from metadata only: nothing is downloaded
    (a CUDA torch's several GB included) and nothing is written."""
    say(f"dry run: target {plan.target.describe()}; {plan.notes[0]}")
    say(f"dry run: requirements: {' '.join(plan.requirements)}")
    wheels = resolve(plan)
    for w in wheels:
        print(f"  {w.name}=={w.version}  {w.url}")
    say(f"dry run: {len(wheels)} wheels plus tandem's own; images the compose file names: {', '.join(plan.images)}")
    return 0


def make_bundle(plan: Plan, out: Path, images_mode: str, force: bool) -> Path:
    previous = check_out_dir(out, force)
    save, skipped = choose_images(plan.images, images_mode)  # before the long part: --images require fails fast
    if previous:
        clear_previous(out)
        say(f"replacing the bundle in {out} (--force; its wheels are reused where still wanted)")
    out.mkdir(parents=True, exist_ok=True)
    # First in, rewritten last: a bundle cut short (Ctrl-C, a full disk) is still one --force may replace;
    # SHA256SUMS, written after it, is what tells install.sh the bundle is whole.
    (out / MANIFEST).write_text(json.dumps({"complete": False}) + "\n")
    wheels = out / "wheels"
    wheels.mkdir(exist_ok=True)
    say(f"target: {plan.target.describe()}; {plan.notes[0]}")

    say("wheels: building tandem's wheel")
    own = build_tandem_wheel(plan.source, wheels)
    say(f"wheels: built {own.name}")
    say("wheels: resolving every dependency (pip, metadata only)")
    wanted = resolve(plan)
    say(f"wheels: {len(wanted)} to fetch besides tandem's")
    fetch_wheels(plan, wanted, wheels)
    size = sum(p.stat().st_size for p in wheels.iterdir())
    say(f"wheels: {len(wanted) + 1} in wheels/ ({size / 2**20:.0f} MiB)")

    for line in skipped:
        say(line)
    saved = save_images(save, out / "images")

    say(f"files: {copy_deploy_files(plan.source, out)} compose and Kubernetes files in compose/")
    pins = [f"tandem=={plan.tandem_version}", *(w.pin for w in wanted)]
    (out / PINS).write_text("".join(f"{p}\n" for p in pins))
    manifest = {"complete": True, "tandem": plan.tandem_version, "install": tandem_spec(plan), "torch": plan.torch,
                "target": {"platform": plan.target.platform or "native", "python": plan.target.python_version,
                           "abi": plan.target.abi},
                "wheels": sorted(p.name for p in wheels.glob("*.whl")), "images": saved}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    script = out / INSTALL
    script.write_text(install_script(tandem_spec(plan), plan.target.python_version, [s["image"] for s in saved]))
    script.chmod(0o755)

    say("checksums: hashing every file")
    text = checksums(out)
    (out / SUMS).write_text(text)
    say(f"checksums: {len(text.splitlines())} files in {SUMS}")
    say(f"done: {out}. On the offline host: {out.name}/{INSTALL}")
    return out


# --- command line ----------------------------------------------------------------------------------------


def add_bundle_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bundle", help="write everything an offline host needs (wheels, images, compose and "
                                      "Kubernetes files, install.sh)",
                       description="Write into DIR everything a host without network access needs to install and "
                                   "run tandem: wheels/ (tandem and every dependency, for one platform), images/ "
                                   "(docker save), compose/ (the compose and Kubernetes files), SHA256SUMS and "
                                   "install.sh, which checks them, makes a venv and installs from wheels/ only.")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="the folder to write (new or empty; required unless --dry-run)")
    p.add_argument("--force", action="store_true", help="replace a previous bundle in --out")
    p.add_argument("--torch", choices=("cpu", "cuda"), default="cpu",
                   help="torch's build: cpu (the CPU wheel, ~200 MB) or cuda (PyPI's Linux wheel with its nvidia-* "
                        "wheels, several GB)")
    p.add_argument("--torch-version", metavar="V", help="torch's version (default: compose/Dockerfile's)")
    p.add_argument("--platform", metavar="TAG",
                   help="the target's pip platform tag, e.g. manylinux_2_28_x86_64 (default: this machine's)")
    p.add_argument("--python-version", metavar="X.Y",
                   help=f"the target's Python (default: {sys.version_info.major}.{sys.version_info.minor}, this one)")
    p.add_argument("--extras", metavar="NAMES", default=",".join(DEFAULT_EXTRAS),
                   help="tandem's extras to bundle, comma-separated; one of them must bring torch (serve, train "
                        "or all: the base install is the client side only)")
    p.add_argument("--images", choices=("auto", "require", "skip"), default="auto",
                   help="docker save the compose file's images: auto skips them (one line) when there is no "
                        "engine or no image, require fails instead")
    p.add_argument("--source", type=Path, metavar="DIR",
                   help="the tandem checkout to bundle (default: the one this tandem runs from)")
    p.add_argument("--dry-run", action="store_true",
                   help="list the wheels (with their URLs) and images it would fetch; download and write nothing")


def run_bundle(args: argparse.Namespace) -> int:
    try:
        if args.python_version is not None and not re.fullmatch(r"3\.\d+", args.python_version):
            raise BundleUsageError(f"--python-version {args.python_version}: give X.Y, e.g. 3.11")
        if not args.dry_run:
            if args.out is None:
                raise BundleUsageError("--out DIR is required (the folder to write the bundle into)")
            check_out_dir(args.out.resolve(), args.force)  # before the plan's pip calls: a refusal is instant
        plan = make_plan(args)
        if args.dry_run:
            return dry_run(plan)
        make_bundle(plan, args.out.resolve(), args.images, args.force)
    except BundleError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0
