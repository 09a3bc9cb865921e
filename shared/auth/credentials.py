"""What a process proves itself with on the bus, and the nats-py options that present it.

Two kinds of credentials file, told apart by their content:

* a **role key** (``tandem up`` writes one per role; ``tandem auth init`` for deployments): a
  scoped signing key of the tandem account. Its holder signs a fresh user for each connection,
  named after the process (a service's instance id) with a key of its own, so the server grants
  that connection the role's permissions with its own id and inbox in them (:mod:`roles`);
* a standard NATS **user credentials** file (``-----BEGIN NATS USER JWT-----``, as ``nsc``
  writes): used as it is, for deployments that manage their users themselves.

:func:`connect_options` turns either (and TLS files) into keyword arguments for ``nats.connect``:
the JWT and the nonce signature as callbacks (so no ``nkeys`` package is needed) and the inbox
prefix ``_INBOX.<user public key>``, the only inbox the roles let a connection read.
"""

from __future__ import annotations

import base64
import json
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.shared.auth import jwt
from tandem.shared.auth.nkeys import ACCOUNT, USER, KeyPair, NkeyError, public_key_bytes

ROLE_KEY_KIND = "tandem-role-key"
_CREDS = re.compile(r"-----BEGIN NATS USER JWT-----\s*(?P<jwt>\S+)\s*------END NATS USER JWT------.*?"
                    r"-----BEGIN USER NKEY SEED-----\s*(?P<seed>\S+)\s*------END USER NKEY SEED------", re.S)


class CredentialsError(ValueError):
    """A credentials file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class UserCreds:
    """One user: its JWT and its nkey seed."""

    jwt: str
    seed: str
    name: str = ""

    @property
    def public_key(self) -> str:
        return KeyPair.from_seed(self.seed).public_key

    def to_text(self) -> str:
        """A NATS user credentials file, as ``nsc`` writes one (nats-py and the nats CLI read it)."""
        return (f"-----BEGIN NATS USER JWT-----\n{self.jwt}\n------END NATS USER JWT------\n\n"
                f"-----BEGIN USER NKEY SEED-----\n{self.seed}\n------END USER NKEY SEED------\n")


@dataclass(frozen=True)
class RoleKey:
    """A role's scoped signing key of ``account``: mints users of that role (:meth:`mint`)."""

    role: str
    account: str
    seed: str

    def mint(self, name: str) -> UserCreds:
        """A new user named ``name`` (nats-server puts it where the role's permissions say
        ``{{name()}}``), with a key pair of its own."""
        user = KeyPair.generate(USER)
        token = jwt.scoped_user_jwt(KeyPair.from_seed(self.seed), self.account, user.public_key, name)
        return UserCreds(jwt=token, seed=user.seed, name=name)

    def to_text(self) -> str:
        return json.dumps({"kind": ROLE_KEY_KIND, "role": self.role, "account": self.account, "seed": self.seed},
                          indent=1) + "\n"

    @classmethod
    def from_dict(cls, raw: dict) -> RoleKey:
        key = cls(role=str(raw["role"]), account=str(raw["account"]), seed=str(raw["seed"]))
        public_key_bytes(key.account, ACCOUNT)
        if KeyPair.from_seed(key.seed).kind != ACCOUNT:
            raise NkeyError("a role key's seed must be an account signing key")
        return key


Credentials = RoleKey | UserCreds


def load_credentials(path: str | Path) -> Credentials:
    """The role key or user credentials in ``path``; :class:`CredentialsError` naming the file."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials {path}: {exc.strerror or exc}") from None
    try:
        found = _CREDS.search(text)
        if found:
            creds = UserCreds(jwt=found["jwt"], seed=found["seed"])
            creds.public_key  # noqa: B018 - checks the seed
            return creds
        try:
            raw = json.loads(text)
        except json.JSONDecodeError:
            raw = None
        if not isinstance(raw, dict) or raw.get("kind") != ROLE_KEY_KIND:
            raise ValueError("neither NATS user credentials nor a tandem role key")
        return RoleKey.from_dict(raw)
    except (ValueError, KeyError, NkeyError) as exc:
        raise CredentialsError(f"credentials {path}: {exc}") from None


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """A client TLS context trusting ``ca`` (else the system's roots), presenting ``cert``/``key``
    when given; None when no TLS file is named."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise CredentialsError("--tls-cert and --tls-key go together: give both or neither")
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
        if cert:
            context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsError(f"TLS files: {exc}") from None
    return context


def connect_options(creds: Credentials | None, name: str, *, tls: ssl.SSLContext | None = None) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` that present ``creds`` (a role key mints a user
    named ``name`` for this connection) and ``tls``; empty for an anonymous plain connection."""
    options: dict[str, Any] = {}
    if tls is not None:
        options["tls"] = tls
    if creds is None:
        return options
    user = creds.mint(name) if isinstance(creds, RoleKey) else creds
    key = KeyPair.from_seed(user.seed)
    options["user_jwt_cb"] = lambda: user.jwt.encode()
    options["signature_cb"] = lambda nonce: base64.b64encode(key.sign(nonce.encode()))
    options["inbox_prefix"] = f"_INBOX.{key.public_key}"
    return options
