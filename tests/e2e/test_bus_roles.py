"""Each role's permissions as nats-server enforces them, credentials files as services use them, and
TLS to the server.

One nats-server trusting a fresh keyring (no tandem services) answers a table of (role, publish or
subscribe, subject): allowed ones pass, the rest get the server's permission error. A service
started by hand with ``--creds`` (a standard NATS ``.creds`` file, as ``nsc`` writes) and TLS flags
joins a server that requires both; without the CA the command says so in one line.

Run: ``python3 -m pytest -q tests/e2e/test_bus_roles.py``.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import subprocess

import nats
import pytest
from cli_support import TANDEM, service_env, wait_for
from support import flushed

from tandem.shared.auth.credentials import connect_options
from tandem.shared.auth.keyring import Keyring
from tandem.shared.infra.natsserver import NatsServer
from tandem.shared.protocol import subjects as s

PUB, SUB = "publish", "subscription"
ALLOWED, REFUSED = True, False
MINE = "MYKEY"  # stands for the connection's own user key (known once it connects)
SOMEONE = "UBSOMEONEELSESKEY"  # another connection's key
# (role, its user's name, action, subject, allowed): the policy of shared/auth/roles.py, row by row.
TABLE = [
    ("client", "c", PUB, s.router_generate(MINE), ALLOWED),
    ("client", "c", PUB, s.cancel(MINE), ALLOWED),
    ("client", "c", PUB, s.router_generate(SOMEONE), REFUSED),  # a request as another client
    ("client", "c", PUB, s.cancel(SOMEONE), REFUSED),  # a cancel as another client
    ("client", "c", PUB, s.ROUTER_GENERATE_ALL, REFUSED),
    ("client", "c", SUB, f"_INBOX.{SOMEONE}.>", REFUSED),  # another client's streams
    ("client", "c", PUB, "$SRV.INFO.tandem-router", ALLOWED),
    ("client", "c", SUB, s.HEARTBEAT_ALL, ALLOWED),
    ("client", "c", PUB, "$SRV.INFO", REFUSED),
    ("client", "c", PUB, s.prefill("p-1"), REFUSED),
    ("client", "c", PUB, s.metrics("decode", "d-1"), REFUSED),
    ("client", "c", PUB, s.KV_TRANSFERS, REFUSED),
    ("client", "c", PUB, "_INBOX.someone.x", REFUSED),
    ("client", "c", SUB, s.METRICS_ALL, REFUSED),
    ("client", "c", SUB, s.KV_EVENTS_ALL, REFUSED),
    ("client", "c", SUB, s.CANCEL_ALL, REFUSED),
    ("client", "c", SUB, s.PLANNER_DECISIONS, REFUSED),
    ("client", "c", SUB, s.TRAINER_STEPS_ALL, REFUSED),
    ("router", "r-1", PUB, s.prefill("p-1"), ALLOWED),
    ("router", "r-1", PUB, s.decode_admit("d-1"), ALLOWED),
    ("router", "r-1", PUB, s.ROUTER_DECISIONS, ALLOWED),
    ("router", "r-1", SUB, s.ROUTER_GENERATE_ALL, ALLOWED),
    ("router", "r-1", SUB, s.CANCEL_ALL, ALLOWED),
    ("decode", "d-1", SUB, s.CANCEL_ALL, ALLOWED),
    ("router", "r-1", PUB, s.heartbeat("decode", "d-1"), REFUSED),
    ("router", "r-1", PUB, s.drain("decode", "d-1"), REFUSED),
    ("router", "r-1", PUB, f"$JS.API.STREAM.PURGE.{s.KV_EVENTS_STREAM}", REFUSED),
    ("prefill", "p-1", PUB, s.decode_kv("d-1"), ALLOWED),
    ("prefill", "p-1", PUB, s.kv_events("prefill", "p-1"), ALLOWED),
    ("prefill", "p-1", PUB, s.kv_events("prefill", "p-2"), REFUSED),
    ("prefill", "p-1", SUB, s.prefill("p-2"), REFUSED),
    ("prefill", "p-1", PUB, s.decode_admit("d-1"), ALLOWED),
    ("decode", "d-1", SUB, s.decode_admit("d-1"), ALLOWED),
    ("decode", "d-1", PUB, s.decode_admit("d-2"), REFUSED),
    ("decode", "d-1", PUB, s.WEIGHTS_UPDATED, REFUSED),
    ("decode", "d-1", PUB, s.ROUTER_DECISIONS, REFUSED),
    ("kvstore", "k-1", SUB, s.kvstore_get("k-1"), ALLOWED),
    ("kvstore", "k-1", SUB, s.kvstore_get("k-2"), REFUSED),
    ("planner", "pl-1", PUB, s.PLANNER_DECISIONS, ALLOWED),
    ("planner", "pl-1", PUB, s.drain("decode", "d-1"), ALLOWED),  # its actuator drains before a scale-down
    ("planner", "pl-1", PUB, s.drain("router", "r-1"), REFUSED),
    ("planner", "pl-1", PUB, s.router_generate(MINE), REFUSED),
    ("client", "c", PUB, s.alive("decode", "d-1"), ALLOWED),  # is the worker holding my stream there?
    ("client", "c", PUB, s.alive("kvstore", "k-1"), REFUSED),
    ("router", "r-1", PUB, s.alive("prefill", "p-1"), ALLOWED),
    ("trainer", "t-1", PUB, s.WEIGHTS_UPDATED, ALLOWED),
    ("trainer", "t-1", PUB, s.router_generate(MINE), REFUSED),
    ("frontend", "f-1", PUB, s.router_generate(MINE), ALLOWED),
    ("frontend", "f-1", PUB, s.cancel(MINE), ALLOWED),
    ("frontend", "f-1", PUB, s.router_generate(SOMEONE), REFUSED),
    ("frontend", "f-1", PUB, s.cancel(SOMEONE), REFUSED),
    ("frontend", "f-1", PUB, s.decode_admit("d-1"), REFUSED),
    ("client", "c", PUB, s.router_embed(MINE), ALLOWED),  # embeddings: the same rules as generation
    ("client", "c", PUB, s.router_embed(SOMEONE), REFUSED),
    ("client", "c", PUB, s.decode_embed("d-1"), REFUSED),
    ("frontend", "f-1", PUB, s.router_embed(MINE), ALLOWED),
    ("router", "r-1", SUB, s.ROUTER_EMBED_ALL, ALLOWED),
    ("router", "r-1", PUB, s.decode_embed("d-1"), ALLOWED),
    ("prefill", "p-1", PUB, s.decode_embed("d-1"), REFUSED),
    ("decode", "d-1", SUB, s.decode_embed("d-1"), ALLOWED),
    ("operator", "op", PUB, s.drain("decode", "d-1"), ALLOWED),
    ("operator", "op", PUB, f"$JS.API.STREAM.PURGE.{s.KV_EVENTS_STREAM}", ALLOWED),
    ("operator", "op", SUB, "_INBOX.>", ALLOWED),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    ring = Keyring.generate()
    server = NatsServer.start(workdir=tmp_path_factory.mktemp("roles") / "server", auth_config=ring.server_config())
    yield ring, server
    server.stop()


@pytest.mark.parametrize("role,name,action,subject,allowed", TABLE,
                         ids=[f"{r}-{'pub' if a == PUB else 'sub'}-{subj}-{'ok' if ok else 'refused'}"
                              for r, _, a, subj, ok in TABLE])
async def test_the_server_enforces_each_roles_permissions(secured, role, name, action, subject, allowed):
    ring, server = secured
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(server.url, error_cb=on_error, **connect_options(ring.role_key(role), name))
    subject = subject.replace(MINE, s.stream_owner(nc.new_inbox()))
    try:
        if action == PUB:
            await nc.publish(subject, b"x")
        else:
            await nc.subscribe(subject)
        await flushed(nc)
        await asyncio.sleep(0.2)  # a refusal comes back as an -ERR after the flush's PONG at the latest
    finally:
        await nc.close()
    refused = any(f'permissions violation for {action} to "{subject.lower()}"' in e for e in errors)
    assert refused != allowed, f"{role} {action} {subject}: {'refused' if refused else 'allowed'}; errors {errors}"


def tls_files(folder):
    """A CA and a server certificate for 127.0.0.1 signed by it, as PEM files in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "nats")]))
            .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(2).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False).sign(ca_key, hashes.SHA256()))
    paths = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key")}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    return paths


def nsc_creds(user) -> str:
    return (f"-----BEGIN NATS USER JWT-----\n{user.jwt}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed}\n------END USER NKEY SEED------\n")


# slow: a TLS-enabled up and a service started by hand (11 s on 2 cores)
@pytest.mark.slow
def test_a_service_by_hand_joins_over_tls_with_a_creds_file(tmp_path, data_dir):
    ring = Keyring.generate()
    pem = tls_files(tmp_path)
    tls = f'tls {{ cert_file: "{pem["cert"]}", key_file: "{pem["key"]}" }}\n'
    server = NatsServer.start(workdir=tmp_path / "server", auth_config=ring.server_config() + tls)
    url = server.url.replace("nats://", "tls://")
    creds = tmp_path / "router.creds"
    creds.write_text(nsc_creds(ring.role_key("router").mint("router-by-hand")))  # a user, as nsc would make it
    (tmp_path / "operator.key").write_text(ring.role_key("operator").to_text())
    router = subprocess.Popen([*TANDEM, "serve", "router", "--nats-url", url, "--creds", str(creds), "--tls-ca",
                               str(pem["ca"]), "--instance-id", "router-by-hand"], env=service_env(data_dir),
                              stdout=open(tmp_path / "router.log", "wb"), stderr=subprocess.STDOUT)
    listing = [*TANDEM, "services", "--json", "--nats-url", url, "--creds", str(tmp_path / "operator.key")]
    try:
        def listed():
            run = subprocess.run([*listing, "--tls-ca", str(pem["ca"])], capture_output=True, text=True, timeout=60,
                                 env=service_env(data_dir))
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-2000:]
            return run.returncode == 0 and [r["instance"] for r in json.loads(run.stdout)]

        assert wait_for(listed, 60, "the router listed over TLS") == ["router-by-hand"]
        untrusted = subprocess.run(listing, capture_output=True, text=True, timeout=60, env=service_env(data_dir))
        assert untrusted.returncode == 1 and len(untrusted.stderr.strip().splitlines()) == 1, untrusted
        assert "certificate" in untrusted.stderr.lower(), untrusted.stderr
    finally:
        router.terminate()
        router.wait(20)
        server.stop()
