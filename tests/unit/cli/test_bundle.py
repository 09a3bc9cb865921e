"""``tandem bundle``'s pure parts: the requirement list from pyproject.toml, the torch pins, the
target's pip flags, the compose file's images, the checksum file (checked with the real
``sha256sum``), install.sh (run with ``sh`` as far as it goes without a bundle's wheels) and the
refusal of a non-empty --out. Nothing here reaches pip's index or a docker engine; the whole
bundle, made and installed offline, is tests/e2e/test_bundle_offline.py (slow)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.cli.bundle import (
    MANIFEST,
    BundleUsageError,
    Target,
    check_out_dir,
    checksums,
    compose_images,
    find_source,
    install_script,
    pip_failure,
    requirements,
    torch_pin,
    torch_source,
    verify_checksums,
    wheel_fits,
)
from tandem.cli.main import main

REPO = Path(__file__).resolve().parents[3]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
LINUX = Target(platform="manylinux_2_28_x86_64", python_version="3.11")


def names(reqs: list[str]) -> list[str]:
    return [r.split(";")[0].split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip().lower() for r in reqs]


def test_requirements_are_pyprojects_dependencies_and_the_serve_extra_with_torch_pinned():
    reqs = requirements(PROJECT, ("serve",), "torch==2.13.0+cpu")
    optional = PROJECT["optional-dependencies"]
    assert [r for r in reqs if r != "torch==2.13.0+cpu"] == PROJECT["dependencies"] + optional["serve"]
    # the pin beside pyproject's range, so pip checks one against the other (and refuses a torch below it)
    torch = next(r for r in reqs if names([r]) == ["torch"])
    assert reqs[reqs.index(torch) + 1] == "torch==2.13.0+cpu"
    assert any(";" in r for r in reqs if names([r]) == ["uvloop"]), "markers are left to pip"


def test_requirements_expand_an_extra_that_names_tandems_own():
    """``all = ["tandem[serve,train]"]``: the bundle's pip fetches dependencies, and tandem is not on its index."""
    reqs = requirements(PROJECT, ("all", "kubernetes"), "torch==2.13.0+cpu")
    assert "tandem" not in names(reqs), reqs
    optional = PROJECT["optional-dependencies"]
    wanted = set(PROJECT["dependencies"] + optional["serve"] + optional["train"] + optional["kubernetes"])
    assert set(reqs) - {"torch==2.13.0+cpu"} == wanted
    assert len(reqs) == len(set(reqs)), "a requirement two extras share is listed once"
    assert names(reqs).count("torch") == 2, "pyproject's range and the pin, once each"


def test_requirements_add_an_extras_dependencies_and_refuse_an_unknown_extra():
    reqs = requirements(PROJECT, ("serve", "kubernetes"), "torch==2.13.0+cpu")
    assert names(reqs).count("kubernetes") == 1
    with pytest.raises(BundleUsageError, match="--extras nope: pyproject.toml has no such extra"):
        requirements(PROJECT, ("nope",), "torch==2.13.0+cpu")


@pytest.mark.parametrize("extras", [(), ("kubernetes",)])
def test_requirements_need_an_extra_that_brings_torch(extras):
    """The base install is the client side: a bundle of it alone could not run `tandem up`."""
    with pytest.raises(BundleUsageError, match="none of them brings torch.*add serve, or all"):
        requirements(PROJECT, extras, "torch==2.13.0+cpu")


def test_the_source_is_the_checkout_this_tandem_runs_from():
    assert find_source(None) == REPO


def test_torch_pins_one_build_per_variant():
    assert torch_pin("cpu", "2.13.0", LINUX) == "torch==2.13.0+cpu"
    assert torch_pin("cpu", "2.13.0+cpu", LINUX) == "torch==2.13.0+cpu"
    # "===" is string equality: a +cpu wheel on find-links cannot satisfy the CUDA pin
    assert torch_pin("cuda", "2.13.0", LINUX) == "torch===2.13.0"
    mac = Target(platform="macosx_14_0_arm64", python_version="3.11")
    assert torch_pin("cpu", "2.13.0", mac) == "torch===2.13.0"
    with pytest.raises(BundleUsageError, match="--torch cuda: .*use --torch cpu"):
        torch_pin("cuda", "2.13.0", mac)


def test_the_cpu_wheel_comes_from_find_links_when_it_lies_there(tmp_path):
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    options, note = torch_source("torch==2.13.0+cpu", LINUX, [tmp_path])
    assert options == [] and str(tmp_path) in note
    options, note = torch_source("torch==2.13.0+cpu", LINUX, [tmp_path / "empty"])
    assert options == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]
    options, note = torch_source("torch===2.13.0", LINUX, [tmp_path])
    assert options == [] and "CUDA" in note


def test_a_find_links_wheel_counts_only_for_its_own_platform(tmp_path):
    x86 = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    arm = Target(platform="manylinux_2_28_aarch64", python_version="3.11")
    assert wheel_fits(x86, LINUX) and not wheel_fits(x86, arm)
    assert not wheel_fits(x86, Target(platform="manylinux_2_28_x86_64", python_version="3.12"))
    assert wheel_fits("numpy-2.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", LINUX)
    assert wheel_fits("six-1.0-py2.py3-none-any.whl", arm)
    (tmp_path / x86).write_bytes(b"")
    options, _ = torch_source("torch==2.13.0+cpu", arm, [tmp_path])
    assert options == ["--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def test_a_pip_failure_is_the_line_that_names_the_package():
    missing = "No matching distribution found for foo==9"
    assert pip_failure(["WARNING: x", "ERROR: Could not find a version that satisfies the requirement foo==9",
                        f"ERROR: {missing}"]) == missing
    assert pip_failure(["ERROR: Cannot install a==1 and a>=2 because these package versions have conflicting "
                        "dependencies.", "ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/"]
                       ).startswith("Cannot install a==1 and a>=2")
    assert pip_failure(["The conflict is caused by:", "    The user requested a==1", "    b 1 depends on a>=2", "",
                        "ERROR: ResolutionImpossible"]) == \
        "conflicting requirements: The user requested a==1; b 1 depends on a>=2"


def test_a_target_platform_becomes_pips_flags_and_this_machine_none():
    assert Target().pip_options() == []
    options = LINUX.pip_options()
    tags = [options[i + 1] for i, o in enumerate(options) if o == "--platform"]
    # older glibc tags too: pip 23 does not infer them from manylinux_2_28
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert options[-6:] == ["--python-version", "3.11", "--implementation", "cp", "--abi", "cp311"]
    with pytest.raises(BundleUsageError, match="--platform sparc: not a platform tag"):
        Target(platform="sparc").os_name  # noqa: B018


def test_images_are_the_compose_files(tmp_path):
    compose = REPO / "compose" / "docker-compose.yml"
    assert compose_images(compose, "cpu", {}) == ["tandem:latest", "nats:2.10-alpine"]
    assert compose_images(compose, "cuda", {}) == ["tandem:latest", "tandem:latest-gpu", "nats:2.10-alpine"]
    assert compose_images(compose, "cpu", {"TANDEM_TAG": "v1", "TANDEM_NATS_TAG": "2.11"}) == ["tandem:v1", "nats:2.11"]


def make_files(root: Path) -> None:
    (root / "wheels").mkdir(parents=True)
    (root / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"wheel a")
    (root / "compose" / "kubernetes").mkdir(parents=True)
    (root / "compose" / "kubernetes" / "x.yaml").write_text("kind: X\n")
    script = root / "install.sh"
    script.write_text(install_script("tandem==0.1.0", f"{sys.version_info.major}.{sys.version_info.minor}", []))
    script.chmod(0o755)


def test_checksums_are_what_sha256sum_checks(tmp_path):
    make_files(tmp_path)
    text = checksums(tmp_path)
    assert text.splitlines() == sorted(text.splitlines(), key=lambda line: line.split("  ", 1)[1])
    assert f"{hashlib.sha256(b'wheel a').hexdigest()}  wheels/a-1.0-py3-none-any.whl\n" in text
    (tmp_path / "SHA256SUMS").write_text(text)
    assert "SHA256SUMS" not in checksums(tmp_path), "the list leaves itself out"
    if shutil.which("sha256sum"):
        ok = subprocess.run(["sha256sum", "-c", "--strict", "SHA256SUMS"], cwd=tmp_path, capture_output=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr
    assert verify_checksums(tmp_path, text) == []
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"tampered")
    assert verify_checksums(tmp_path, text) == ["wheels/a-1.0-py3-none-any.whl"]
    if shutil.which("sha256sum"):
        bad = subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=tmp_path, capture_output=True)
        assert bad.returncode != 0


def test_the_install_script_installs_only_from_the_bundle():
    script = install_script("tandem[kubernetes]==0.1.0", "3.11", ["tandem:latest", "nats:2.10-alpine"])
    assert script.startswith("#!/bin/sh\n")
    assert "sha256sum -c --quiet --strict SHA256SUMS" in script
    assert '-m venv "$venv"' in script
    install = next(line for line in script.splitlines() if "-m pip install" in line)
    assert "--no-index" in install and "--isolated" in install and "PIP_CONFIG_FILE=/dev/null" in install
    assert '--find-links "$bundle/wheels" -c "$bundle/requirements.txt" \'tandem[kubernetes]==0.1.0\'' in script
    assert 'docker load -i "$tar"' in script
    assert "tandem up --demo" in script
    if shutil.which("sh"):
        syntax = subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True)
        assert syntax.returncode == 0, syntax.stderr


def run_script(folder: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(folder / "install.sh"), str(folder / "venv")], capture_output=True, text=True,
                          timeout=60, env={"PATH": "/usr/bin:/bin", **env})


@pytest.mark.skipif(shutil.which("sh") is None, reason="no sh")
def test_the_install_script_stops_at_a_bad_checksum_before_making_anything(tmp_path):
    make_files(tmp_path)
    out = run_script(tmp_path)
    assert out.returncode == 1 and "no SHA256SUMS: the bundle is incomplete" in out.stderr
    (tmp_path / "SHA256SUMS").write_text(checksums(tmp_path))
    (tmp_path / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"tampered")
    out = run_script(tmp_path)
    assert out.returncode == 1 and "do not match SHA256SUMS: copy the bundle over again" in out.stderr
    assert "wheels/a-1.0-py3-none-any.whl: FAILED" in out.stdout
    assert not (tmp_path / "venv").exists()


@pytest.mark.skipif(shutil.which("sh") is None, reason="no sh")
def test_the_install_script_refuses_an_unlisted_wheel_and_a_wrong_python(tmp_path):
    make_files(tmp_path)
    (tmp_path / "SHA256SUMS").write_text(checksums(tmp_path))
    (tmp_path / "wheels" / "evil-9.9-py3-none-any.whl").write_bytes(b"x")
    out = run_script(tmp_path)
    assert out.returncode == 1 and "wheels/evil-9.9-py3-none-any.whl is not in SHA256SUMS" in out.stderr
    (tmp_path / "wheels" / "evil-9.9-py3-none-any.whl").unlink()
    other = tmp_path / "python-other"
    other.write_text("#!/bin/sh\necho 2.7\n")
    other.chmod(0o755)
    out = run_script(tmp_path, PYTHON=str(other))
    assert out.returncode == 1 and "is 2.7, the wheels are for" in out.stderr
    assert not (tmp_path / "venv").exists()


def test_a_non_empty_out_dir_is_refused_unless_it_is_a_bundle_and_force(tmp_path):
    assert check_out_dir(tmp_path / "new", force=False) is False
    assert check_out_dir(tmp_path, force=False) is False  # empty
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(BundleUsageError, match="is not empty: pick a new or empty folder, or pass --force"):
        check_out_dir(tmp_path, force=False)
    with pytest.raises(BundleUsageError, match="holds no bundle.json: --force replaces only a previous bundle"):
        check_out_dir(tmp_path, force=True)
    (tmp_path / MANIFEST).write_text(json.dumps({"complete": False}))
    assert check_out_dir(tmp_path, force=True) is True
    (tmp_path / "file").write_text("")
    with pytest.raises(BundleUsageError, match="a file, not a folder"):
        check_out_dir(tmp_path / "file", force=False)


def test_the_command_refuses_a_non_empty_out_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["bundle", "--out", str(tmp_path), "--images", "skip"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tandem bundle: --out {tmp_path} is not empty")
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert main(["bundle", "--images", "skip"]) == 2
    assert "--out DIR is required" in capsys.readouterr().err
    assert main(["bundle", "--python-version", "311", "--dry-run"]) == 2
    assert "--python-version 311: give X.Y" in capsys.readouterr().err
