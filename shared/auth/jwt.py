"""NATS JWTs (v2): the signed claims that make an operator, an account and its users.

A JWT is ``base64url(header).base64url(claims).base64url(signature)``, the header naming the
``ed25519-nkey`` algorithm and the signature the issuer's nkey over the first two parts. Its
``nats`` object carries what nats-server enforces: an account's limits and signing keys, a user's
permissions. Field names are nats-server's (github.com/nats-io/jwt/v2); only what tandem sets is
written.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

from tandem.shared.auth.nkeys import KeyPair

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
NO_LIMIT = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def encode(issuer: KeyPair, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A JWT for ``subject`` signed by ``issuer``; ``nats`` must carry ``type``."""
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public_key, "name": name, "sub": subject}
    # jti: a digest of the claims, as nats-io/jwt makes it; unique per JWT and what the server logs.
    claims["jti"] = base64.b32encode(hashlib.new("sha512_256", json.dumps(claims, sort_keys=True).encode())
                                     .digest()).decode().rstrip("=")
    claims["nats"] = {**nats, "version": 2}
    head = _b64(json.dumps(HEADER, separators=(",", ":")).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    return f"{head}.{body}.{_b64(issuer.sign(f'{head}.{body}'.encode()))}"


def claims_of(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the server verifies; this reads names and keys for messages)."""
    try:
        return json.loads(_unb64(token.split(".")[1]))
    except (IndexError, ValueError) as exc:
        raise ValueError(f"not a JWT: {exc}") from None


def operator_jwt(operator: KeyPair, name: str, system_account: str) -> str:
    return encode(operator, operator.public_key, name, {"type": "operator", "system_account": system_account})


def account_jwt(operator: KeyPair, account: str, name: str, *, jetstream: bool,
                signing_keys: list[dict[str, Any]] | None = None) -> str:
    """An account signed by the operator; ``signing_keys`` are user scopes (:func:`user_scope`).
    JetStream is off in an account unless its limits turn it on."""
    limits: dict[str, Any] = {"subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT, "imports": NO_LIMIT,
                              "exports": NO_LIMIT, "wildcards": True, "conn": NO_LIMIT, "leaf": NO_LIMIT}
    if jetstream:
        limits |= {"mem_storage": NO_LIMIT, "disk_storage": NO_LIMIT, "streams": NO_LIMIT, "consumer": NO_LIMIT}
    nats: dict[str, Any] = {"type": "account", "limits": limits}
    if signing_keys:
        nats["signing_keys"] = signing_keys
    return encode(operator, account, name, nats)


def user_scope(signing_key: str, role: str, permissions: dict[str, Any]) -> dict[str, Any]:
    """A scoped signing key: every user it signs gets ``permissions`` (templates expanded by the
    server: ``{{name()}}`` the user's name, ``{{subject()}}`` its public key) and nothing else."""
    return {"kind": "user_scope", "key": signing_key, "role": role,
            "template": {**permissions, "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT}}


def scoped_user_jwt(signing_key: KeyPair, account: str, user: str, name: str) -> str:
    """A user signed by a scoped signing key of ``account``: no permissions of its own (the
    server refuses a scoped user that carries any), the scope's apply."""
    return encode(signing_key, user, name, {"type": "user", "issuer_account": account})
