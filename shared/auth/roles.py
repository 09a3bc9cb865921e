"""Who may do what on the bus: one permission set per role, in nats-server's own terms.

Each role is a scoped signing key of the tandem account (see :mod:`keyring`): a process holding a
role's key signs a user for itself, and nats-server gives that user exactly the role's permissions,
with ``{{name()}}`` replaced by the user's name (a service's instance id) and ``{{subject()}}`` by
its public key (so an inbox ``_INBOX.<key>.>`` can be read by the connection that holds the key
and by nothing else). Least privilege, as the trust-boundary issue asks:

* a **client** publishes only generate and embed requests and cancels, each under its own user key
  (``tandem.v1.router.{generate,embed}.<key>``, ``tandem.v1.cancel.<key>``: the router refuses a stream
  subject outside ``_INBOX.<that key>``, and a cancel stops only streams there, so a stream belongs
  to its requester by the server's rules, not by the secrecy of its subject), ``$SRV`` questions
  to the routers (which model, what vocabulary) and the alive questions of the router and workers
  holding its requests, and reads only its own inbox and the heartbeats (so a request whose
  worker died migrates at once; they carry load figures and ids, no request data);
* only **workers** publish heartbeats, metrics and KV events, each under its own id; only the
  **router** sends prefill and embed requests, and admits come from the router or, as the hand-off,
  from a prefill worker;
* drain, scale, trainer control and ``models.updated`` belong to the **operator** (``tandem up``,
  the console, ``tandem train``), which may do anything; the **planner** may drain workers too (its
  actuator drains one before removing it under compose or Kubernetes);
* LoRA adapters are loaded and unloaded through the routers (``tandem.v1.router.adapters``): the
  front end (vLLM's load and unload endpoints), the trainer (publishing what it trained) and the
  operator ask; only routers write the registry stream, which routers and front ends follow;
* a service may ``$SRV.PING`` its own service's instances (``tandem ping <service>``: a container's
  readiness probe, with the key the container already holds);
* JetStream's API is granted per stream to the roles that keep or replay that stream.

Replies to requests (``$SRV`` pings, endpoint answers) go out through ``allow_responses``; token
streams and KV frames go to ``_INBOX.`` subjects the requester named, which only workers, the
router and the KV store may publish to.
"""

from __future__ import annotations

from typing import Any

from tandem.shared.protocol import subjects as s

ME = "{{name()}}"  # the user's name: a service's instance id
MY_KEY = "{{subject()}}"  # the user's public key: what it proved it holds when it connected
OWN_INBOX = f"_INBOX.{MY_KEY}.>"  # the connection's inbox prefix is _INBOX.<its public key>
ANY_INBOX = "_INBOX.>"
REPLIES = {"max": 1, "ttl": 0}  # allow_responses: one reply per request received, no time limit

ROLES = ("client", "frontend", "router", "prefill", "decode", "kvstore", "planner", "trainer", "operator")
SERVICE_ROLES = ("frontend", "router", "prefill", "decode", "kvstore", "planner", "trainer")


def stream_api(stream: str, *, consume: bool = False) -> list[str]:
    """The JetStream API subjects that keep ``stream`` (make it, read its info) and, with
    ``consume``, replay it through an ordered consumer."""
    api = [f"$JS.API.STREAM.{verb}.{stream}" for verb in ("CREATE", "UPDATE", "INFO")]
    if consume:
        api += [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
                f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.FC.{stream}.>"]
    return api


def _service(role: str, pub: list[str], sub: list[str]) -> dict[str, Any]:
    """A service: registered with ``$SRV`` (answers pings, and may ping its own kind: a readiness
    probe), beating and publishing metrics under its own id, serving its own instance subjects
    (drain, blocks, alive, ...), reading its own inbox."""
    return {
        "pub": {"allow": [s.heartbeat(role, ME), s.metrics(role, ME), f"$SRV.PING.tandem-{role}", *pub]},
        "sub": {"allow": ["$SRV.>", f"{s.PREFIX}.{role}.{ME}.>", OWN_INBOX, *sub]},
        "resp": REPLIES,
    }


# The routers' $SRV answers (alive? which model, what vocabulary?), for clients that size requests;
# and whether the router, prefill or decode worker holding one of its requests is still on the bus.
ASK_ROUTERS = ["$SRV.PING.tandem-router", "$SRV.INFO.tandem-router",
               *(s.alive(service, "*") for service in ("router", "prefill", "decode"))]
KV_FRAMES_TO_DECODE = s.decode_kv("*")
KVSTORE_ANY = f"{s.PREFIX}.kvstore.>"  # lookups, gets, puts and frames to any store
_WORKER_PUB = [ANY_INBOX, KV_FRAMES_TO_DECODE, KVSTORE_ANY, s.KV_TRANSFERS, *stream_api(s.KV_EVENTS_STREAM)]
_WORKER_SUB = [s.CANCEL_ALL, s.WEIGHTS_UPDATED, s.HEARTBEAT_ALL]
# A requester's own generate, embed and cancel subjects: under its key, so whose stream it is comes from the server.
OWN_REQUESTS = [s.router_generate(MY_KEY), s.router_embed(MY_KEY), s.cancel(MY_KEY)]

PERMISSIONS: dict[str, dict[str, Any]] = {
    "client": {
        "pub": {"allow": [*OWN_REQUESTS, *ASK_ROUTERS]},
        "sub": {"allow": [OWN_INBOX, s.HEARTBEAT_ALL]},
    },
    "frontend": _service("frontend", [*OWN_REQUESTS, *ASK_ROUTERS, s.ADAPTERS_CONTROL,
                                      *stream_api(s.ADAPTERS_STREAM, consume=True)], [s.HEARTBEAT_ALL]),
    "router": _service("router", [s.prefill("*"), s.decode_admit("*"), s.decode_embed("*"), s.alive("prefill", "*"),
                                  s.alive("decode", "*"), s.ROUTER_DECISIONS, ANY_INBOX,
                                  *stream_api(s.KV_EVENTS_STREAM, consume=True), s.ADAPTERS_ALL,
                                  *stream_api(s.ADAPTERS_STREAM, consume=True)],
                       [s.ROUTER_GENERATE_ALL, s.ROUTER_EMBED_ALL, s.HEARTBEAT_ALL, s.KV_EVENTS_ALL,
                        s.CANCEL_ALL, s.ADAPTERS_CONTROL]),  # cancel: queued ones
    "prefill": _service("prefill", [s.decode_admit("*"), s.kv_events("prefill", ME), *_WORKER_PUB], _WORKER_SUB),
    "decode": _service("decode", [s.kv_events("decode", ME), *_WORKER_PUB], _WORKER_SUB),
    "kvstore": _service("kvstore", [s.kv_events("kvstore", ME), *_WORKER_PUB], [s.KVSTORE_LOOKUP_ALL]),
    "planner": _service("planner", [s.PLANNER_DECISIONS, *stream_api(s.PLANNER_STREAM),
                                    s.drain("prefill", "*"), s.drain("decode", "*")],  # its actuator's scale-downs
                        [s.HEARTBEAT_ALL, s.METRICS_ALL, s.PLANNER_SCALE]),
    "trainer": _service("trainer", [s.TRAINER_STEPS_ALL, s.TRAINER_TIMELINE_ALL, s.WEIGHTS_UPDATED, s.ADAPTERS_CONTROL],
                        [s.TRAINER_START, s.TRAINER_STOP, s.TRAINER_STATUS]),
    "operator": {"pub": {"allow": [">"]}, "sub": {"allow": [">"]}, "resp": REPLIES},
}
assert set(PERMISSIONS) == set(ROLES), "every role has its permissions"


def role_for_service(service: str) -> str:
    """The role a ``tandem serve <service>`` process takes (each service its own)."""
    if service not in SERVICE_ROLES:
        raise ValueError(f"no bus role for service {service!r}")
    return service
