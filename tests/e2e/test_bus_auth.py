"""The bus as a trust boundary, against a real ``tandem up`` (identities are on by default).

One ``tandem up`` (1 prefill, 1 decode, no KV-store) for the module. An anonymous connection to its
server is refused. An attacker holding the *client* role (what any user of the system holds) tries
each abuse the fault-and-abuse trial found; each now fails with nats-server's permission error,
while a victim's greedy stream, running through it all, completes with the tokens it gives alone.
A worker's role key does not let it speak for another worker. ``tandem generate``, ``tandem
services``, ``tandem bench serve``, the console's source and the HTTP API work with no extra step;
the state file and the role keys are readable by their owner only.

Run: ``python3 -m pytest -q tests/e2e/test_bus_auth.py``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import stat
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from cli_support import TANDEM, stop_process, tandem_env, wait_for
from support import flushed

from tandem.client import connect
from tandem.client.access import bus_options
from tandem.client.runstate import find_running, nats_dir
from tandem.console.source import NatsSource
from tandem.console.state import ConsoleState
from tandem.shared.auth.credentials import RoleKey, UserCreds, connect_options, load_credentials
from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.fleet import DrainRequest, ScaleRequest
from tandem.shared.protocol.serving import Cancel, GenerateRequest, SamplingParams

PROMPT = "def fibonacci(n):"
VICTIM_TOKENS = 48
# Where the trial's attacks went, before requests and cancels carried their sender's key.
KEYLESS_GENERATE, KEYLESS_CANCEL = f"{subjects.PREFIX}.router.generate", f"{subjects.PREFIX}.cancel"


@dataclass
class Up:
    proc: subprocess.Popen
    data_dir: Path
    url: str
    http_url: str
    env: dict[str, str]

    def instance(self, service: str) -> str:
        state = find_running(self.data_dir)
        return next(i for i in state.metrics_urls if i.startswith(service))


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("bus-auth")
    env = {**tandem_env(data_dir), "TANDEM_DEVICE": "cpu"}
    log = open(data_dir / "up.log", "w")
    proc = subprocess.Popen([*TANDEM, "up", "--kvstore", "0"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    try:
        state = wait_for(lambda: find_running(data_dir) or proc.poll() is not None, 180, "tandem up to be ready")
        assert proc.poll() is None, f"tandem up exited:\n{(data_dir / 'up.log').read_text()[-3000:]}"
        yield Up(proc, data_dir, state.nats_url, state.http_url, env)
    finally:
        stop_process(proc, signal.SIGINT, 60)


class Attacker:
    """A connection holding the client role, collecting the server's errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    async def on_error(self, exc: Exception) -> None:
        self.errors.append(str(exc).lower())

    async def refused(self, action: str, subject: str) -> bool:
        """Whether the server answered a permission error for ``action`` ("publish" or
        "subscription") on ``subject``."""
        want = f'permissions violation for {action} to "{subject.lower()}"'
        for _ in range(40):
            if any(want in e for e in self.errors):
                return True
            await asyncio.sleep(0.05)
        return False


def client_key(up: Up):
    return find_running(up.data_dir).keys["client"]


async def attacker_for(up: Up) -> Attacker:
    attacker = Attacker()
    attacker.nc = await nats.connect(up.url, error_cb=attacker.on_error,
                                     **connect_options(RoleKey.from_dict(client_key(up)), "attacker"))
    return attacker


async def test_an_anonymous_connection_is_refused(up):
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    with pytest.raises(Exception) as caught:
        await nats.connect(up.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                           error_cb=on_error)
    assert "authorization violation" in (str(caught.value) + " ".join(errors)).lower(), (caught.value, errors)


def test_a_command_without_the_keys_is_refused_in_one_line(up, tmp_path):
    """Another data dir (so no state file to take the keys from): the server says no, and the
    command says what to pass, in one line."""
    env = {**up.env, "TANDEM_DATA_DIR": str(tmp_path)}
    run = subprocess.run([*TANDEM, "services", "--nats-url", up.url], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "requires an identity" in lines[0] and "--creds" in lines[0], run.stderr


async def victim_stream(up: Up) -> list[int]:
    async with connect(up.url, data_dir=str(up.data_dir)) as client:
        result = await client.complete(PROMPT, max_tokens=VICTIM_TOKENS, temperature=0.0, ignore_eos=True)
    return result.token_ids


async def test_every_abuse_fails_with_a_permission_error_and_the_victim_is_unharmed(up):
    alone = await victim_stream(up)
    attacker = await attacker_for(up)
    decode_id, prefill_id = up.instance("decode"), up.instance("prefill")
    async with connect(up.url, data_dir=str(up.data_dir)) as victim:
        stream = victim.generate(PROMPT, max_tokens=VICTIM_TOKENS, temperature=0.0, ignore_eos=True)
        first = await stream.__anext__()
        victim_subject = stream.request.stream_subject
        nc = attacker.nc
        subscriptions = {
            "read every token stream": "_INBOX.>",
            "read the victim's stream": victim_subject,
            "learn every request id from the router's decisions": subjects.ROUTER_DECISIONS,
            "receive prompts meant for a prefill worker": subjects.prefill("*"),
            "receive admits meant for a decode worker": subjects.decode_admit(decode_id),
            "receive KV frames meant for a decode worker": subjects.decode_kv(decode_id),
        }
        publishes = {
            "forge a heartbeat to be routed requests": (subjects.heartbeat("decode", "decode-forged"), b"x"),
            "inject output into the victim's stream": (victim_subject, b"x"),
            "drain a worker": (subjects.drain("decode", decode_id), encode(DrainRequest(exit=False))),
            "scale the workers": (subjects.PLANNER_SCALE, encode(ScaleRequest(decode=0, reason="x"))),
            "start a training job": (subjects.TRAINER_START, b"x"),
            "make workers reload weights": (subjects.WEIGHTS_UPDATED, b"x"),
            "purge the KV-events stream": (f"$JS.API.STREAM.PURGE.{subjects.KV_EVENTS_STREAM}", b""),
            "send a worker prefill work": (subjects.prefill(prefill_id), b"x"),
        }
        for subject in subscriptions.values():
            await nc.subscribe(subject)
        for subject, payload in publishes.values():
            await nc.publish(subject, payload)
        await flushed(nc)
        not_refused = [what for what, subject in subscriptions.items()
                       if not await attacker.refused("subscription", subject)]
        not_refused += [what for what, (subject, _) in publishes.items()
                        if not await attacker.refused("publish", subject)]
        assert not not_refused, f"no permission error for: {not_refused}; the server said: {attacker.errors}"
        rest = [chunk async for chunk in stream]
        await nc.close()
    tokens = [t for chunk in [first, *rest] for t in chunk.token_ids]
    assert tokens == alone, "the victim's stream changed under the attack"


async def attack_mid_stream(up: Up, attack) -> tuple[list[int], str, list[int]]:
    """The victim's greedy stream as it comes with ``attack(attacker, victim stream)`` run after
    its first chunk; and the stream's finish reason, and the tokens it gives alone."""
    alone = await victim_stream(up)
    attacker = await attacker_for(up)
    try:
        async with connect(up.url, data_dir=str(up.data_dir)) as victim:
            stream = victim.generate(PROMPT, max_tokens=VICTIM_TOKENS, temperature=0.0, ignore_eos=True)
            chunks = [await stream.__anext__()]
            await attack(attacker, stream)
            chunks += [chunk async for chunk in stream]
    finally:
        await attacker.nc.close()
    return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason, alone


async def test_a_client_cannot_write_into_another_clients_stream(up):
    """The trial's injection: a GenerateRequest naming the victim's stream subject, resuming after
    its tokens so far with a logit bias forcing one token. Sent under the attacker's own key, the
    router refuses it (the stream is not under the sender's inbox); under the victim's key, the
    server refuses the publish. The victim's stream is untouched."""
    replies: list = []

    async def inject(attacker: Attacker, stream) -> None:
        nc = attacker.nc
        forced = 7
        request = GenerateRequest(request_id="injected", prompt=PROMPT, stream_subject=stream.request.stream_subject,
                                  resume_output_token_ids=[1] * 8, params=SamplingParams(
                                      max_tokens=9, temperature=0.0, ignore_eos=True, logit_bias=[(forced, 100.0)]))
        mine = subjects.stream_owner(nc.new_inbox())
        replies.append(decode((await nc.request(subjects.router_generate(mine), encode(request), timeout=10)).data))
        victims = subjects.router_generate(subjects.stream_owner(stream.request.stream_subject))
        for subject in (victims, KEYLESS_GENERATE):
            await nc.publish(subject, encode(request), reply=nc.new_inbox())
        await flushed(nc)
        assert await attacker.refused("publish", victims), f"sent as the victim; the server said {attacker.errors}"

    tokens, finish, alone = await attack_mid_stream(up, inject)
    reply = replies[0]
    assert isinstance(reply, ErrorReply) and reply.param == "stream_subject", f"the router placed it: {reply}"
    assert (tokens, finish) == (alone, "length"), f"the victim's stream changed: {len(tokens)} tokens, {finish}"


async def test_knowing_a_stream_subject_is_not_enough_to_cancel_it(up):
    """The trial leaked every stream subject through the monitoring port, and the subject was all a
    cancel needed. The victim's exact subject, cancelled under the attacker's key, is ignored; under
    the victim's key the server refuses the publish."""
    async def cancel(attacker: Attacker, stream) -> None:
        nc = attacker.nc
        request = Cancel(request_id=stream.placement_id, stream_subject=stream.request.stream_subject)
        await nc.publish(subjects.cancel(subjects.stream_owner(nc.new_inbox())), encode(request))
        victims = subjects.cancel(subjects.stream_owner(stream.request.stream_subject))
        for subject in (victims, KEYLESS_CANCEL):
            await nc.publish(subject, encode(request))
        await flushed(nc)
        assert await attacker.refused("publish", victims), f"sent as the victim; the server said {attacker.errors}"

    tokens, finish, alone = await attack_mid_stream(up, cancel)
    assert (tokens, finish) == (alone, "length"), f"the victim stopped after {len(tokens)} tokens ({finish})"


def test_the_nats_monitoring_port_is_off(up):
    """What leaked every subscription to any user of the host."""
    state = find_running(up.data_dir)
    assert state.nats_monitor_url == "", f"tandem up serves nats-server's monitoring at {state.nats_monitor_url}"
    ports = [json.loads(p.read_text()) for p in nats_dir(up.data_dir).glob("*.ports")]
    assert ports and not any(p.get("monitoring") for p in ports), f"nats-server listens on {ports}"


async def test_a_workers_credentials_speak_only_for_its_own_id(up):
    """tandem up gives each child a user minted for its instance id, never a role key: holding the
    prefill worker's credentials, one may beat as that prefill worker and nothing else (not as the
    decode worker, not as a client, not under any other prefill id)."""
    mine = up.instance("prefill")
    creds = load_credentials(nats_dir(up.data_dir) / "auth" / f"{mine}.creds")
    assert isinstance(creds, UserCreds), "a child holds its own user, not a key that mints others"
    attacker = Attacker()
    nc = await nats.connect(up.url, error_cb=attacker.on_error, **connect_options(creds, "ignored"))
    decoder = up.instance("decode")
    await nc.publish(subjects.heartbeat("prefill", mine), b"x")  # its own: allowed
    as_a_client = subjects.router_generate(subjects.stream_owner(nc.new_inbox()))  # even under its own key
    for subject in (subjects.heartbeat("prefill", "prefill-other"), subjects.heartbeat("decode", decoder),
                    as_a_client):
        await nc.publish(subject, b"x")
    await nc.subscribe(subjects.decode_admit(decoder))
    await flushed(nc)
    for subject in (subjects.heartbeat("prefill", "prefill-other"), subjects.heartbeat("decode", decoder),
                    as_a_client):
        assert await attacker.refused("publish", subject), (subject, attacker.errors)
    assert await attacker.refused("subscription", subjects.decode_admit(decoder)), attacker.errors
    assert not any(mine.lower() in e for e in attacker.errors), f"its own heartbeat was refused: {attacker.errors}"
    await nc.close()


def test_the_state_file_and_role_keys_are_their_owners_only(up):
    state_file = up.data_dir / "run" / "up.json"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600, oct(state_file.stat().st_mode)
    folder = nats_dir(up.data_dir) / "auth"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700, oct(folder.stat().st_mode)
    files = sorted(folder.iterdir())
    children = find_running(up.data_dir).metrics_urls  # every child, by instance id
    assert {f.name for f in files} >= {f"{child}.creds" for child in children}, [f.name for f in files]
    assert not [f for f in files if f.suffix == ".key" and f.name != "client.key"], "no role key but a client's"
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [oct(f.stat().st_mode) for f in files]
    assert set(json.loads(state_file.read_text())["keys"]) == {"client", "operator"}, "only what commands need"


def test_generate_services_and_bench_work_with_no_extra_step(up):
    gen = subprocess.run([*TANDEM, "generate", PROMPT, "--max-tokens", "8", "--ignore-eos", "--json"], env=up.env,
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0 and len(json.loads(gen.stdout)["token_ids"]) == 8, gen
    services = subprocess.run([*TANDEM, "services", "--json"], env=up.env, capture_output=True, text=True, timeout=60)
    assert services.returncode == 0, services
    assert {row["service"] for row in json.loads(services.stdout)} >= {f"tandem-{s}" for s in ("router", "prefill",
                                                                       "decode", "frontend")}
    bench = subprocess.run([*TANDEM, "bench", "serve", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                            "--no-progress"], env=up.env, capture_output=True, text=True, timeout=180)
    assert bench.returncode == 0 and "failed" not in bench.stderr.lower(), bench


def test_the_http_api_needs_no_bus_identity_from_its_user(up):
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(f"{up.http_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert answer["choices"][0]["text"], answer


async def test_the_console_follows_the_up_as_its_operator(up):
    source = NatsSource(None, follow=up.data_dir,
                        options=lambda at: bus_options("operator", "tandem-console", at, data_dir=up.data_dir))
    state = ConsoleState()
    await source.start(state)
    try:
        for _ in range(150):
            if state.connection == "connected" and state.instances("decode"):
                break
            await asyncio.sleep(0.1)
        assert state.connection == "connected", (state.connection, state.connection_error)
        assert state.instances("decode"), "no worker reached the console"
    finally:
        await source.stop()


# slow: a whole up without identities (11 s on 2 cores)
@pytest.mark.slow
async def test_insecure_turns_identities_off(tmp_path):
    env = {**tandem_env(tmp_path), "TANDEM_DEVICE": "cpu"}
    out = open(tmp_path / "up.out", "w")
    proc = subprocess.Popen([*TANDEM, "up", "--insecure", "--kvstore", "0"], env=env, stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        state = wait_for(lambda: find_running(tmp_path) or proc.poll() is not None, 180, "tandem up --insecure")
        assert proc.poll() is None, (tmp_path / "up.out").read_text()[-3000:]
        assert state.keys == {}, "no keys to hand out"
        nc = await nats.connect(state.nats_url, allow_reconnect=False, max_reconnect_attempts=0)
        await nc.request("$SRV.PING.tandem-router", b"", timeout=5)  # anyone may do anything
        await nc.close()
        assert "--insecure: no identities" in (tmp_path / "up.out").read_text()
    finally:
        proc.send_signal(2)
        proc.wait(60)
