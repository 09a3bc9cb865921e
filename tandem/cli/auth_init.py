"""``tandem auth init FOLDER``: a deployment's keys, for services not started by ``tandem up``
(compose, Kubernetes, ``tandem serve`` by hand).

Writes into ``FOLDER`` (made 0700): ``nats-auth.conf``, the lines a nats-server config includes to
trust these keys and no one else (``include "nats-auth.conf"``), and one role key per role
(``router.key``, ``decode.key``, ..., ``client.key``, ``operator.key``; mode 0600), each given to the
processes of that role with ``--creds`` or ``TANDEM_NATS_CREDS``. The operator and account seeds
are not kept: a new keyring is a new ``init``, which replaces every key (``--keep`` leaves a
complete folder as it is, so a container that runs this at every start keeps its keys).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tandem.shared.auth.keyring import Keyring, write_private
from tandem.shared.auth.roles import ROLES

SERVER_CONFIG = "nats-auth.conf"


def wanted_files(folder: Path) -> list[Path]:
    return [folder / SERVER_CONFIG, *(folder / f"{role}.key" for role in ROLES)]


def init_keyring(folder: Path, *, keep: bool = False, force: bool = False) -> str:
    """Make the keyring in ``folder``; returns the line to print. Raises ``FileExistsError`` (one
    line) for a folder that already holds keys, unless ``keep`` or ``force``."""
    present = [p for p in wanted_files(folder) if p.exists()]
    if present and keep and len(present) == len(wanted_files(folder)):
        return f"{folder}: a keyring is already there; kept as it is (--keep)"
    if present and not force:
        raise FileExistsError(f"{folder} already holds {present[0].name}: a new keyring replaces every key in use; "
                              "pass --force to do that, or --keep to leave it")
    ring = Keyring.generate()
    ring.write_role_keys(folder)
    write_private(folder / SERVER_CONFIG, ring.server_config())
    return (f"{folder}: {SERVER_CONFIG} (include it in the nats-server config) and a key per role: "
            + ", ".join(f"{role}.key" for role in ROLES))


def add_auth_parser(sub: argparse._SubParsersAction) -> None:
    auth = sub.add_parser("auth", help="identities for the bus (deployments not started by tandem up)")
    verbs = auth.add_subparsers(dest="auth_command", required=True)
    init = verbs.add_parser("init", help="make a deployment's keys: a nats-server config and one key per role",
                            description=__doc__.split("\n\n")[0] + " " + " ".join(__doc__.split("\n\n")[1].split()))
    init.add_argument("folder", type=Path, help="where to write the keys (made if absent)")
    given = init.add_mutually_exclusive_group()
    given.add_argument("--keep", action="store_true", help="leave a folder that already holds a keyring as it is")
    given.add_argument("--force", action="store_true", help="replace the keys a folder already holds")


def run_auth(args: argparse.Namespace) -> int:
    try:
        print(init_keyring(args.folder, keep=args.keep, force=args.force))
    except FileExistsError as exc:
        print(f"tandem auth init: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tandem auth init: {args.folder}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0
