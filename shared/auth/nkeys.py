"""NATS nkeys: Ed25519 key pairs in NATS's own text encoding (``S...`` seeds, ``O/A/U...`` public keys).

An nkey is base32 (no padding) of a prefix byte naming its kind, the 32 key bytes and a CRC-16
(XMODEM, little-endian); a seed carries two prefix bytes (``S`` and the kind). nats-server checks
every signature in an operator/account/user chain with these keys, so this module is what lets
tandem mint identities without the ``nkeys``/PyNaCl packages; the Ed25519 arithmetic is the
``cryptography`` package's.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

SEED = 18 << 3  # 'S'
OPERATOR = 14 << 3  # 'O'
ACCOUNT = 0  # 'A'
USER = 20 << 3  # 'U'
KINDS = {OPERATOR: "operator", ACCOUNT: "account", USER: "user"}


class NkeyError(ValueError):
    """A seed or public key that is not a valid nkey of the kind expected."""


def _crc16(data: bytes) -> int:
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def _encode(raw: bytes) -> str:
    return base64.b32encode(raw + _crc16(raw).to_bytes(2, "little")).decode().rstrip("=")


def _decode(text: str) -> bytes:
    try:
        raw = base64.b32decode(text + "=" * (-len(text) % 8))
    except (ValueError, TypeError) as exc:
        raise NkeyError(f"not an nkey: {exc}") from None
    body, checksum = raw[:-2], raw[-2:]
    if len(raw) < 3 or _crc16(body).to_bytes(2, "little") != checksum:
        raise NkeyError("not an nkey: bad checksum")
    return body


def public_key_bytes(public_key: str, kind: int) -> bytes:
    """The raw Ed25519 key of an encoded public nkey, checked to be of ``kind``."""
    body = _decode(public_key)
    if len(body) != 33 or body[0] != kind:
        raise NkeyError(f"{public_key[:8]}... is not a {KINDS.get(kind, kind)} public key")
    return body[1:]


@dataclass(frozen=True)
class KeyPair:
    """One nkey: its kind, its seed (the secret) and the public key derived from it."""

    kind: int
    seed: str

    @classmethod
    def generate(cls, kind: int) -> KeyPair:
        raw = Ed25519PrivateKey.generate().private_bytes_raw()
        return cls(kind, _encode(bytes([SEED | kind >> 5, (kind & 31) << 3]) + raw))

    @classmethod
    def from_seed(cls, seed: str) -> KeyPair:
        body = _decode(seed.strip())
        kind = ((body[0] & 7) << 5) | ((body[1] & 248) >> 3)
        if body[0] & 248 != SEED or kind not in KINDS or len(body) != 34:
            raise NkeyError("not an nkey seed of an operator, account or user")
        return cls(kind, seed.strip())

    @property
    def _private(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(_decode(self.seed)[2:])

    @property
    def public_key(self) -> str:
        raw = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return _encode(bytes([self.kind]) + raw)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)


def verify(public_key: str, kind: int, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s over ``data`` (tests and JWT checks)."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key_bytes(public_key, kind)).verify(signature, data)
    except Exception:
        return False
    return True
