"""nkeys, JWTs and credentials files in nats-server's formats, without a server.

The seed/public-key pair is the reference vector of nats-io/nkeys.py; the server-side checks of
these JWTs are tests/e2e/test_bus_roles.py.
"""

from __future__ import annotations

import base64
import json
import re

import pytest

from tandem.shared.auth import jwt
from tandem.shared.auth.credentials import (
    CredentialsError,
    RoleKey,
    UserCreds,
    connect_options,
    load_credentials,
    tls_context,
)
from tandem.shared.auth.keyring import Keyring
from tandem.shared.auth.nkeys import ACCOUNT, OPERATOR, USER, KeyPair, NkeyError, public_key_bytes, verify
from tandem.shared.auth.roles import PERMISSIONS, ROLES

REFERENCE_SEED = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU"
REFERENCE_PUBLIC = "UCK5N7N66OBOINFXAYC2ACJQYFSOD4VYNU6APEJTAVFZB2SVHLKGEW7L"


def test_the_reference_seed_gives_the_reference_public_key():
    assert KeyPair.from_seed(REFERENCE_SEED).public_key == REFERENCE_PUBLIC


@pytest.mark.parametrize("kind,letter", [(OPERATOR, "O"), (ACCOUNT, "A"), (USER, "U")])
def test_a_generated_key_round_trips_and_signs(kind: int, letter: str):
    key = KeyPair.generate(kind)
    assert key.seed.startswith("S" + letter) and key.public_key.startswith(letter), (key.seed[:2], key.public_key[:1])
    assert KeyPair.from_seed(key.seed).public_key == key.public_key
    signature = key.sign(b"nonce")
    assert verify(key.public_key, kind, b"nonce", signature)
    assert not verify(key.public_key, kind, b"other", signature), "a signature over other bytes verified"


def test_a_damaged_or_misnamed_key_is_refused():
    damaged = REFERENCE_SEED[:-3] + ("A" if REFERENCE_SEED[-3] != "A" else "B") + REFERENCE_SEED[-2:]
    with pytest.raises(NkeyError, match="checksum"):
        KeyPair.from_seed(damaged)
    with pytest.raises(NkeyError, match="not a account public key"):
        public_key_bytes(REFERENCE_PUBLIC, ACCOUNT)
    with pytest.raises(NkeyError):
        KeyPair.from_seed(REFERENCE_PUBLIC)  # a public key is no seed


def test_a_jwt_is_signed_by_its_issuer_over_header_and_claims():
    operator, account = KeyPair.generate(OPERATOR), KeyPair.generate(ACCOUNT)
    token = jwt.account_jwt(operator, account.public_key, "TANDEM", jetstream=True)
    head, body, signature = token.split(".")
    assert json.loads(base64.urlsafe_b64decode(head + "==")) == {"typ": "JWT", "alg": "ed25519-nkey"}
    claims = jwt.claims_of(token)
    assert (claims["iss"], claims["sub"], claims["nats"]["type"], claims["nats"]["version"]) == \
        (operator.public_key, account.public_key, "account", 2)
    assert claims["nats"]["limits"]["streams"] == -1, "JetStream is off in an account whose limits do not set it"
    assert verify(operator.public_key, OPERATOR, f"{head}.{body}".encode(),
                  base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)))


def test_a_minted_user_carries_no_permissions_of_its_own():
    """nats-server refuses a user of a scoped signing key that carries any permission or limit:
    the scope's template is what applies."""
    ring = Keyring.generate()
    user = ring.role_key("client").mint("someone")
    nats = jwt.claims_of(user.jwt)["nats"]
    assert nats == {"type": "user", "issuer_account": ring.account.public_key, "version": 2}, nats
    assert jwt.claims_of(user.jwt)["iss"] == ring.roles["client"].public_key
    assert user.public_key != ring.role_key("client").mint("someone").public_key, "each connection its own key"


def test_connect_options_present_the_user_and_its_own_inbox():
    key = Keyring.generate().role_key("client")
    options = connect_options(key, "tandem-client")
    token = options["user_jwt_cb"]().decode()
    user = jwt.claims_of(token)["sub"]
    assert options["inbox_prefix"] == f"_INBOX.{user}", "the roles let a connection read only _INBOX.<its key>"
    signature = base64.b64decode(options["signature_cb"]("the-nonce"))
    assert verify(user, USER, b"the-nonce", signature)
    assert connect_options(None, "x") == {}, "no credentials: an anonymous connection"


def test_both_kinds_of_credentials_file_load(tmp_path):
    key = Keyring.generate().role_key("decode")
    role_file = tmp_path / "decode.key"
    role_file.write_text(key.to_text())
    assert load_credentials(role_file) == key
    user = key.mint("decode-1")
    creds_file = tmp_path / "decode.creds"  # the layout nsc writes
    creds_file.write_text(f"-----BEGIN NATS USER JWT-----\n{user.jwt}\n------END NATS USER JWT------\n\n"
                          "************************* IMPORTANT *************************\n\n"
                          f"-----BEGIN USER NKEY SEED-----\n{user.seed}\n------END USER NKEY SEED------\n")
    assert load_credentials(creds_file) == UserCreds(jwt=user.jwt, seed=user.seed)


@pytest.mark.parametrize("text,reason", [
    ("not json", "neither NATS user credentials nor a tandem role key"),
    ('{"kind": "tandem-role-key", "role": "x"}', "account"),
    (json.dumps({"kind": "tandem-role-key", "role": "x", "account": REFERENCE_PUBLIC, "seed": REFERENCE_SEED}),
     "not a account public key"),
], ids=["garbage", "missing-fields", "user-key-as-account"])
def test_a_bad_credentials_file_is_one_line_naming_it(tmp_path, text: str, reason: str):
    path = tmp_path / "bad.key"
    path.write_text(text)
    with pytest.raises(CredentialsError, match=re.escape(str(path))) as caught:
        load_credentials(path)
    assert reason in str(caught.value) and "\n" not in str(caught.value), caught.value
    with pytest.raises(CredentialsError, match="cannot read"):
        load_credentials(tmp_path / "absent.key")


def test_a_tls_certificate_needs_its_key():
    with pytest.raises(CredentialsError, match="--tls-cert and --tls-key go together"):
        tls_context(None, "cert.pem", None)
    assert tls_context(None, None, None) is None


def test_a_role_key_cannot_sign_for_the_account_itself():
    ring = Keyring.generate()
    with pytest.raises(NkeyError):
        RoleKey.from_dict({"role": "client", "account": ring.account.public_key, "seed": KeyPair.generate(USER).seed})


TOKEN = re.compile(r"^(\$?[A-Za-z0-9_\-]+|\*|>|\{\{(name|subject)\(\)\}\})$")


@pytest.mark.parametrize("role", ROLES)
def test_every_permission_is_a_valid_subject_or_template(role: str):
    perms = PERMISSIONS[role]
    for direction in ("pub", "sub"):
        for subject in perms[direction]["allow"]:
            tokens = subject.split(".")
            assert all(TOKEN.match(t) for t in tokens), f"{role} {direction}: {subject!r}"
            assert ">" not in tokens[:-1], f"{role} {direction}: '>' only last in {subject!r}"


def test_only_the_operator_may_drain_scale_train_or_reload():
    """The planner drains workers too, and only workers (its actuator's scale-downs)."""
    operator_only = ("tandem.v1.planner.scale", "tandem.v1.trainer.start", "tandem.v1.models.updated", "drain")
    planner_drains = {"tandem.v1.prefill.*.drain", "tandem.v1.decode.*.drain"}
    assert planner_drains <= set(PERMISSIONS["planner"]["pub"]["allow"]), "the planner's actuator must drain"
    for role in ROLES:
        if role in ("operator", "trainer"):
            continue
        allowed = " ".join(p for p in PERMISSIONS[role]["pub"]["allow"] if role != "planner" or p not in planner_drains)
        assert not any(word in allowed for word in operator_only) and ">" not in allowed.split(), (role, allowed)
