"""Every NATS subject tandem uses, in one place.

Subjects are versioned: ``tandem.v1.<service>.<verb>`` for a service as a whole (queue-balanced)
and ``tandem.v1.<service>.<id>.<verb>`` for one instance. Nothing else in the code base spells a
subject by hand.
"""

from __future__ import annotations

PREFIX = "tandem.v1"

ROUTER_GENERATE_ALL = f"{PREFIX}.router.generate.*"  # every owner's requests (the routers' queue group)
ROUTER_EMBED_ALL = f"{PREFIX}.router.embed.*"  # every owner's embedding requests (the same queue group)
ROUTER_DECISIONS = f"{PREFIX}.router.decisions"  # one RoutingDecision per placed request
CANCEL_ALL = f"{PREFIX}.cancel.*"  # every owner's cancels (the router's queue and every worker)
HEARTBEAT_ALL = f"{PREFIX}.heartbeat.>"
KV_EVENTS_ALL = f"{PREFIX}.kv.events.>"
KV_EVENTS_STREAM = "TANDEM_KV_EVENTS"  # JetStream stream holding every KV event, for index rebuilds
KV_TRANSFERS = f"{PREFIX}.kv.transfers"  # one KVTransferEvent per completed hand-off or store transfer

METRICS_ALL = f"{PREFIX}.metrics.>"
PLANNER_DECISIONS = f"{PREFIX}.planner.decisions"  # ScalingDecision, also kept in PLANNER_STREAM
PLANNER_STREAM = "TANDEM_PLANNER"
PLANNER_SCALE = f"{PREFIX}.planner.scale"  # ScaleRequest from an operator (request-reply)

TRAINER_START = f"{PREFIX}.trainer.start"  # TrainStart (queue group: one trainer takes a job)
TRAINER_STOP = f"{PREFIX}.trainer.stop"  # TrainStop (every trainer hears it; the owner acts)
TRAINER_STATUS = f"{PREFIX}.trainer.status"  # TrainStatusRequest
TRAINER_STEPS_ALL = f"{PREFIX}.trainer.steps.>"
TRAINER_TIMELINE_ALL = f"{PREFIX}.trainer.timeline.>"
WEIGHTS_UPDATED = f"{PREFIX}.models.updated"  # WeightsUpdated
ADAPTERS_CONTROL = f"{PREFIX}.router.adapters"  # LoadAdapter / UnloadAdapter (the routers' queue group)
ADAPTERS_ALL = f"{PREFIX}.adapters.>"  # AdapterRecord per name, kept (last per name) in ADAPTERS_STREAM
ADAPTERS_STREAM = "TANDEM_ADAPTERS"


def router_generate(owner: str) -> str:
    """Where a client sends its :class:`GenerateRequest`: under its owner token. On a bus with
    identities that token is the connection's user key and nats-server lets a connection publish
    under its own key only, so the token a router reads off the subject is one the server vouched
    for; the router then refuses a stream subject that is not under the same owner."""
    return f"{PREFIX}.router.generate.{owner}"


def router_embed(owner: str) -> str:
    """Where a client sends its :class:`EmbedRequest`: under its owner token, as :func:`router_generate`."""
    return f"{PREFIX}.router.embed.{owner}"


def cancel(owner: str) -> str:
    """Where a client cancels its requests: under its owner token, as :func:`router_generate`, so
    a cancel stops only streams that owner holds."""
    return f"{PREFIX}.cancel.{owner}"


def owner_of(subject: str) -> str:
    """The owner token a :func:`router_generate`, :func:`router_embed` or :func:`cancel` subject was
    published under."""
    return subject.rsplit(".", 1)[-1]


def stream_owner(stream_subject: str) -> str:
    """Who owns a stream: the token after ``_INBOX``, the connection's user key on a bus with
    identities (the only inbox it may read), its client id on one without."""
    parts = stream_subject.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "_INBOX" else ""


def sent_by_owner(subject: str, stream_subject: str) -> bool:
    """Whether a request or cancel that arrived on ``subject`` came from the owner of
    ``stream_subject``: the one rule the router (requests, queued cancels) and the workers
    (cancels) apply."""
    return stream_owner(stream_subject) == owner_of(subject)


def heartbeat(service: str, instance_id: str) -> str:
    """Where one instance publishes its load and health, a few times a second."""
    return f"{PREFIX}.heartbeat.{service}.{instance_id}"


def alive(service: str, instance_id: str) -> str:
    """Answers while one instance's process is on the bus. A request that met the instance's death
    gets no "no responders" (the server delivered it before it saw the connection close), so whoever
    waits on an answer from an instance asks this meanwhile (a client its router, the router a worker)."""
    return f"{PREFIX}.{service}.{instance_id}.alive"


def prefill(instance_id: str) -> str:
    """Ask one prefill worker to prefill a prompt and hand its KV to a decode worker."""
    return f"{PREFIX}.prefill.{instance_id}.prefill"


def decode_admit(instance_id: str) -> str:
    """Admit a sequence into one decode worker's batch (prefilled elsewhere or not)."""
    return f"{PREFIX}.decode.{instance_id}.admit"


def decode_embed(instance_id: str) -> str:
    """Ask one decode worker to prefill a prompt and publish its pooled vector (``EmbedWork``)."""
    return f"{PREFIX}.decode.{instance_id}.embed"


def decode_kv(instance_id: str) -> str:
    """Binary KV-block frames for one decode worker."""
    return f"{PREFIX}.decode.{instance_id}.kv"


def stream_inbox(inbox_prefix: str, client_id: str, request_id: str) -> str:
    """A client's token stream for one request (the client subscribes before asking): under its
    connection's inbox prefix (``_INBOX.<user key>`` on a bus with identities, the only inbox it
    may read), then the client's random id. Its owner (:func:`stream_owner`) is the first token
    after ``_INBOX``: the user key, or with no identities the client id."""
    return f"{inbox_prefix}.{client_id}.{request_id}"


def kv_events(service: str, instance_id: str) -> str:
    """Where one worker or store publishes its KV events (into the JetStream stream)."""
    return f"{PREFIX}.kv.events.{service}.{instance_id}"


KVSTORE_LOOKUP_ALL = f"{PREFIX}.kvstore.lookup"  # every KV store answers (one queue group each)


def kvstore_lookup(instance_id: str) -> str:
    """Ask one KV store which blocks of a hash chain it holds."""
    return f"{PREFIX}.kvstore.{instance_id}.lookup"


def kvstore_get(instance_id: str) -> str:
    """Ask one KV store to send blocks (as KV frames) to an inbox."""
    return f"{PREFIX}.kvstore.{instance_id}.get"


def kvstore_put(instance_id: str) -> str:
    """Tell one KV store to keep the blocks of a transfer already sent to its kv subject."""
    return f"{PREFIX}.kvstore.{instance_id}.put"


def kvstore_kv(instance_id: str) -> str:
    """Binary KV-block frames for one KV store (the bytes of a later put)."""
    return f"{PREFIX}.kvstore.{instance_id}.kv"


def kvstore_stats(instance_id: str) -> str:
    """One KV store's tier usage and hit counters (a msgpack map)."""
    return f"{PREFIX}.kvstore.{instance_id}.stats"


def metrics(service: str, instance_id: str) -> str:
    """Where one instance publishes its MetricsSnapshot every few seconds."""
    return f"{PREFIX}.metrics.{service}.{instance_id}"


def drain(service: str, instance_id: str) -> str:
    """Ask one worker to drain (DrainRequest, request-reply)."""
    return f"{PREFIX}.{service}.{instance_id}.drain"


def blocks(service: str, instance_id: str) -> str:
    """Ask one worker for its BlockSnapshot (request-reply, any payload)."""
    return f"{PREFIX}.{service}.{instance_id}.blocks"


def adapter_record(name: str) -> str:
    """Where ``name``'s AdapterRecord goes (names may hold "/" and ":", never a dot or wildcard)."""
    return f"{PREFIX}.adapters.{name}"


def trainer_steps(job_id: str) -> str:
    return f"{PREFIX}.trainer.steps.{job_id}"


def trainer_timeline(job_id: str) -> str:
    return f"{PREFIX}.trainer.timeline.{job_id}"
