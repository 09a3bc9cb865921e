"""The keys of one tandem deployment: an operator, its tandem account (and the system account
nats-server wants), and one scoped signing key per role.

:func:`Keyring.generate` makes them all; :meth:`Keyring.server_config` is the nats-server
configuration that trusts them (operator mode, accounts preloaded into a memory resolver, so the
server needs no account server); :meth:`Keyring.role_key` is what a process of one role is given.
Only the operator and account seeds can make new roles or accounts; ``tandem up`` keeps them in
memory and writes out role keys only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tandem.shared.auth import jwt
from tandem.shared.auth.credentials import RoleKey
from tandem.shared.auth.nkeys import ACCOUNT, OPERATOR, KeyPair
from tandem.shared.auth.roles import PERMISSIONS, ROLES

ACCOUNT_NAME = "TANDEM"


@dataclass(frozen=True)
class Keyring:
    operator: KeyPair
    account: KeyPair
    system_account: KeyPair
    roles: dict[str, KeyPair]  # role -> its scoped signing key (an account nkey)

    @classmethod
    def generate(cls) -> Keyring:
        return cls(KeyPair.generate(OPERATOR), KeyPair.generate(ACCOUNT), KeyPair.generate(ACCOUNT),
                   {role: KeyPair.generate(ACCOUNT) for role in ROLES})

    def role_key(self, role: str) -> RoleKey:
        return RoleKey(role=role, account=self.account.public_key, seed=self.roles[role].seed)

    def server_config(self) -> str:
        """The lines of nats-server's config that make it trust this keyring and nothing else."""
        scopes = [jwt.user_scope(key.public_key, role, PERMISSIONS[role]) for role, key in self.roles.items()]
        tandem = jwt.account_jwt(self.operator, self.account.public_key, ACCOUNT_NAME, jetstream=True,
                                 signing_keys=scopes)
        system = jwt.account_jwt(self.operator, self.system_account.public_key, "SYS", jetstream=False)
        operator = jwt.operator_jwt(self.operator, "tandem", self.system_account.public_key)
        return "\n".join([
            f"operator: {json.dumps(operator)}",
            f"system_account: {self.system_account.public_key}",
            "resolver: MEMORY",
            "resolver_preload: {",
            f"  {self.account.public_key}: {json.dumps(tandem)}",
            f"  {self.system_account.public_key}: {json.dumps(system)}",
            "}",
        ]) + "\n"

    def write_user(self, folder: Path, role: str, name: str) -> Path:
        """A user of ``role`` named ``name``, minted here, as a credentials file in ``folder``
        (0600 in a 0700 folder): what a process gets when it may act under that name only, since
        it holds no role key to mint another."""
        path = private_folder(folder) / f"{name}.creds"
        write_private(path, self.role_key(role).mint(name).to_text())
        return path

    def write_role_keys(self, folder: Path) -> dict[str, Path]:
        """One key file per role in ``folder`` (mode 0600 in a 0700 folder); role -> its path."""
        private_folder(folder)
        paths = {}
        for role in self.roles:
            paths[role] = folder / f"{role}.key"
            write_private(paths[role], self.role_key(role).to_text())
        return paths


def private_folder(folder: Path) -> Path:
    """``folder``, made if absent, readable by this user only (0700); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by this user only, never world-readable even briefly."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
