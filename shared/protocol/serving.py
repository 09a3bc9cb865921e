"""Requests and their token streams: client to router to prefill to decode, and back to the client."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tandem.shared.protocol.adapters import AdapterRef
from tandem.shared.protocol.base import ErrorReply, WireMessage
from tandem.shared.protocol.kv import KVTransfer, RingSlots

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # the detokenizer searches each new text for every stop string
MAX_STOP_TOKEN_IDS = 1024  # each is compared against every sampled token of the request
INT32_MAX = 2**31 - 1  # token ids, top_k and max_tokens fit int32 (vocabularies and contexts are far smaller)
SEED_LIMIT = 2**63  # seeds are < 2**63 (torch.Generator.manual_seed takes them on every version)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (as vLLM): 1/T would overflow the logits
MAX_LOGPROBS = 20  # top alternatives per token a request may ask for (as vLLM's default and OpenAI's top_logprobs)
MAX_SAMPLES = 64  # outputs, candidates (best_of) or beams of one request: each holds a row of every step
MAX_LOGIT_BIAS = 1024  # biased tokens per request (OpenAI allows 300); each is one scatter into its row
MIN_PRIORITY, MAX_PRIORITY = -100, 100  # GenerateRequest.priority: lower is placed first
# Structured output specs: a schema, regex or grammar is compiled by every worker that runs the
# request and is carried in every message about it, so its size is bounded like a prompt's.
MAX_STRUCTURED_SPEC_CHARS = 65536
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
MAX_START_AFTER_TOKENS = 64

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


def _utf8(value: str) -> str:
    value.encode("utf-8")  # a lone surrogate raises UnicodeEncodeError (a ValueError): msgpack could not send it
    return value


# A request id becomes one token of the client's stream subject: no dots, wildcards or whitespace.
RequestId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\s.*>]+$"), AfterValidator(_utf8)]
MAX_SUBJECT_CHARS = 256  # far below nats-server's 4 KiB control line, whose overflow closes the publisher's connection
# Where workers publish a request's tokens: a subject they can publish to (dot-separated tokens, none
# empty, no wildcards, no whitespace), or one publish could fail a worker's every other stream; and
# an inbox, the only kind of subject a stream may name, so no request can make a worker publish on a
# service's subject (a forged heartbeat, a drain) in its own name.
# A worker's instance id as a peer names it: it becomes one token of the subjects a worker publishes
# to (``tandem.v1.decode.<id>.admit``), and a token with whitespace or a wildcard makes nats-server
# close the publisher's connection (a parser error), failing its every other request.
InstanceName = Annotated[str, Field(max_length=128, pattern=r"^[^\s.*>]*$")]
StreamSubject = Annotated[str, Field(min_length=1, max_length=MAX_SUBJECT_CHARS,
                                     pattern=r"^_INBOX(\.[^\s.*>]+)+$"), AfterValidator(_utf8)]


StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "lark", "gbnf"]


def grammar_syntax(text: str) -> Literal["gbnf", "lark"]:
    """The syntax a grammar is written in: GBNF's rules read ``name ::= ...``, Lark's ``name: ...``."""
    return "gbnf" if "::=" in text else "lark"


class StructuredOutput(BaseModel):
    """What the engine constrains a request's output to, token by token (see ``shared/structured``).

    ``kind`` says how to read ``spec``: ``json_object`` any JSON object (``spec`` unused);
    ``json_schema`` the JSON text of a schema; ``regex`` a regular expression the whole output
    matches; ``lark`` or ``gbnf`` a grammar in that syntax; ``choice`` one of ``choices``, exactly.
    The output starts at the first output token, or, with ``start_after``, right after those token
    ids first appear in the output (the end of a reasoning section): what comes before is free.
    Whether the spec compiles is checked where it is compiled (the front end, every worker), not
    here: the wire protocol carries it as text.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: StructuredKind
    spec: str = Field("", max_length=MAX_STRUCTURED_SPEC_CHARS)
    choices: list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]] = Field(
        default_factory=list, max_length=MAX_CHOICES)
    start_after: list[TokenId] = Field(default_factory=list, max_length=MAX_START_AFTER_TOKENS)

    @model_validator(mode="after")
    def _complete(self) -> StructuredOutput:
        if self.kind == "choice" and not self.choices:
            raise ValueError("a choice output needs at least one of choices")
        if self.kind not in ("choice", "json_object") and not self.spec:
            raise ValueError(f"a {self.kind} output needs its spec")
        return self


class SamplingParams(BaseModel):
    """What the client asks of generation: the one definition, on the bus and in the engine.

    The field bounds are the whole validation: any value they admit is one the engine's sampler,
    its tensors and msgpack can carry (a ``top_k`` above the vocabulary keeps every token, like -1;
    a temperature below ``GREEDY_TEMPERATURE`` is greedy). Construction validates; an invalid value
    raises ``pydantic.ValidationError`` (a ``ValueError``) naming the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    # None: as many as the context leaves after the prompt (the router sets the number); more than
    # it leaves is refused by the router.
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False)  # 0: greedy (argmax)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)  # nucleus mass kept; 1: off
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)  # tokens kept; 0 or -1: off
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)  # samples depend only on (seed, output index)
    stop: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    # None: off. N: each output token's log-probability and the N most likely tokens of its step
    # (raw log_softmax of the model's logits, before temperature, top-k and top-p; see engine.sampling).
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # None: off. N: the same for every prompt token but the first (it has no logits before it).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Penalties on the logits before sampling, as vLLM (and OpenAI for presence/frequency) define them:
    # presence subtracts once per token already in the output, frequency once per occurrence;
    # repetition divides a positive logit (multiplies a negative one) of a token seen in the prompt or
    # the output. 0, 0 and 1 are off.
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, allow_inf_nan=False)
    min_tokens: int = Field(0, ge=0, le=INT32_MAX)  # eos and stop token ids are masked until this many outputs
    # (token id, bias) pairs added to the logits (a list, not a map: msgpack maps take string keys only).
    logit_bias: list[tuple[TokenId, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]]] = Field(
        default_factory=list, max_length=MAX_LOGIT_BIAS)
    # Several outputs: n samples, drawn from best_of candidates (the n with the highest cumulative
    # logprob are returned; with best_of > n nothing streams until all candidates end). Sample i has
    # its own randomness: with a seed, its tokens depend only on (seed, i), not on the batch.
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    # Beam search with this many beams (1: off), as transformers' generate(num_beams=k, do_sample=False):
    # deterministic (temperature, top-p, top-k and seed do not apply), the n best finished beams come
    # back when the search ends, each scored sum(logprobs) / length ** length_penalty.
    beam_width: int = Field(1, ge=1, le=MAX_SAMPLES)
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False  # transformers' meaning: True, False (heuristic), "never"
    # Constrained decoding: every output token keeps the output a prefix of what this admits, and
    # the output ends ("stop") when it is complete. None: free text.
    structured_output: StructuredOutput | None = None

    @model_validator(mode="after")
    def _consistent(self) -> SamplingParams:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.beam_width > 1:
            if self.best_of is not None:
                raise ValueError("best_of does not apply to beam search (beam_width > 1); set n <= beam_width")
            if self.n > self.beam_width:
                raise ValueError(f"n ({self.n}) must not exceed beam_width ({self.beam_width})")
            if self.stop:
                raise ValueError("stop strings do not apply to beam search; use stop_token_ids")
            if self.structured_output is not None:
                raise ValueError("structured_output does not apply to beam search (beam_width > 1): use n or best_of")
            # Beams rank by raw logprobs, as transformers' search with no logits processors does.
            unapplied = [name for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                                                ("repetition_penalty", 1.0), ("min_tokens", 0), ("logit_bias", []))
                         if getattr(self, name) != off]
            if unapplied:
                raise ValueError(f"{unapplied[0]} does not apply to beam search (beam_width > 1)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def num_candidates(self) -> int:
        """Sequences the request runs at once: its beams, else its best_of (or n) samples."""
        return self.beam_width if self.beam_width > 1 else (self.best_of or self.n)

    @property
    def holds_outputs(self) -> bool:
        """Outputs come only when the request ends (the best are chosen among more than are returned)."""
        return self.beam_width > 1 or self.num_candidates > self.n


class TokenLogprobs(BaseModel):
    """One output token's log-probability and its step's most likely tokens, most likely first
    (``(token id, logprob)``; the sampled token may be among them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    logprob: float
    top: list[tuple[int, float]] = Field(default_factory=list, max_length=MAX_LOGPROBS)


class GenerateRequest(WireMessage):
    """Client to router. Exactly one of ``prompt`` and ``prompt_token_ids``."""

    kind: Literal["generate"] = "generate"
    request_id: RequestId
    prompt: str | None = None
    prompt_token_ids: list[TokenId] | None = None
    params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    stream_subject: StreamSubject
    # A migrated request: the output tokens its client already streamed from a worker that died.
    # The workers take them as sampled elsewhere and stream only what follows (see RequestSpec).
    resume_output_token_ids: list[TokenId] = Field(default_factory=list)
    # Workers the client saw die under this request: never placed on again, though a router may not
    # have noticed yet (their heartbeats are only a moment late, and they cache its prefix).
    exclude_workers: list[InstanceName] = Field(default_factory=list, max_length=32)
    # Order in the router's admission queue while every decode worker is saturated: lower first (as
    # vLLM's priority scheduling), equal priorities first come first served.
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # The router answers PlacementReceived the moment it takes the request, then the outcome, so
    # a client can tell a router that died holding the request from one still placing it (which
    # may take as long as the admission queue's wait).
    ack_placement: bool = False


class PlacementReceived(WireMessage):
    """Router to client, first of two replies when :attr:`GenerateRequest.ack_placement` is set:
    this router holds the request; while it places it, ``tandem.v1.router.<router>.alive`` answers."""

    kind: Literal["placement_received"] = "placement_received"
    request_id: str
    router: InstanceName


class GenerateAccepted(WireMessage):
    """Router to client: the request is placed; tokens follow on the stream subject."""

    kind: Literal["accepted"] = "accepted"
    request_id: str
    prompt_token_ids: list[int]
    prefill_worker: str | None
    decode_worker: str
    # The worker processes that hold it (Heartbeat.incarnation): when one restarts under the same
    # name, its new process does not hold the request, and the client migrates it. Empty: not said.
    decode_incarnation: str = ""
    prefill_incarnation: str = ""
    max_tokens: int = 0  # as the router granted it (an unset max_tokens becomes what the context leaves)
    queue_wait_s: float = 0.0  # seconds it waited in the router's admission queue (0: placed at once)


class RequestSpec(BaseModel):
    """One request as the client asked for it, resolved by the router (prompt tokenized, model
    named, arrival stamped). The router builds it once; :class:`PrefillRequest` and
    :class:`DecodeRequest` carry it whole, and every worker builds its engine request from it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    request_id: RequestId
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    params: SamplingParams
    stream_subject: StreamSubject  # where the workers publish the request's tokens
    model: str
    # Unix time the router accepted it (time to first token is measured from it).
    arrival_time: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    # Output tokens already streamed to the client before a migration: every worker starts the
    # request's engine sequence with them as its output so far (seeds, penalties, min_tokens and
    # stop strings see them), and streams from index len(resume_output_token_ids) on.
    resume_output_token_ids: list[TokenId] = Field(default_factory=list)
    # The LoRA adapter it runs with (None: the base model): resolved by the router from the request's
    # model name; a worker without it reads it from its path before admitting.
    adapter: AdapterRef | None = None


class PrefillRequest(WireMessage):
    """Router to a prefill worker: prefill ``spec``, emit the first token, hand the KV to
    ``decode_worker`` (through its shared-memory ring ``decode_ring`` when the prefill worker is on
    ``decode_host``)."""

    kind: Literal["prefill"] = "prefill"
    spec: RequestSpec
    decode_worker: Annotated[InstanceName, Field(min_length=1)]
    decode_ring: str = ""
    decode_host: str = ""
    kvstore: InstanceName = ""  # a KV-store to fetch the prompt's cached prefix from and offer its new blocks to
    kvstore_fetch_blocks: int = Field(0, ge=0)  # leading blocks worth fetching (the store has more than the worker)
    kvstore_held_blocks: int = Field(0, ge=0)  # leading blocks the store already holds (offer only the rest)


class DecodeRequest(WireMessage):
    """To a decode worker: admit ``spec``, already prefilled (``transfer``/``ring``, with
    ``output_token_ids`` sampled there) or to prefill locally."""

    kind: Literal["decode"] = "decode"
    spec: RequestSpec
    output_token_ids: list[TokenId] = Field(default_factory=list)  # sampled (and streamed) by the prefill worker
    # The sum of those tokens' logprobs, so the request's cumulative_logprob counts them too.
    output_cumulative_logprob: float = Field(0.0, le=0.0, allow_inf_nan=False)
    transfer: KVTransfer | None = None  # KV sent ahead as NATS frames ...
    ring: RingSlots | None = None  # ... or left in the decode worker's shared-memory ring
    kv_namespace: str = ""  # the sender's KV layout: must equal the receiver's when KV comes along
    kvstore: InstanceName = ""  # a KV-store to offer the sequence's full blocks to when it ends ...
    kvstore_held_blocks: int = Field(0, ge=0)  # ... past the leading blocks it already holds
    # Prefilled here (no KV along): leading prompt blocks worth fetching from that store first.
    kvstore_fetch_blocks: int = Field(0, ge=0)
    # Unix time the prefill worker sent the first token (inter-token latency starts there).
    first_token_time: float = Field(0.0, ge=0.0, allow_inf_nan=False)


class StreamChunk(WireMessage):
    """Worker to client: output ``sample_index``'s tokens ``index .. index+len(token_ids)-1`` and
    their text. A request with ``n`` outputs streams them interleaved, each ending with its own
    ``finish_reason``; the request ends when all ``n`` have (or at the first ``error``, which ends
    every output). Held outputs (``SamplingParams.holds_outputs``) come whole at the end, best
    first: ``sample_index`` is then the rank."""

    kind: Literal["chunk"] = "chunk"
    request_id: str
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: ErrorReply | None = None
    # With ``params.logprobs`` set: one entry per token of ``token_ids``, in order; else None.
    logprobs: list[TokenLogprobs] | None = None
    sample_index: int = Field(0, ge=0, lt=MAX_SAMPLES)
    # On an output's last chunk: the sum of its tokens' logprobs (raw log_softmax, as ``logprobs``).
    cumulative_logprob: float | None = None
    # With ``params.prompt_logprobs`` set, on the request's first chunk: one entry per prompt token,
    # None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Probe(WireMessage):
    """Worker to client stream, with a reply subject: is anybody still listening?"""

    kind: Literal["probe"] = "probe"
    request_id: str


class Cancel(WireMessage):
    """Stop a request. Only its owner can: a cancel is sent under its sender's owner token
    (``subjects.cancel``; the user key nats-server lets the connection publish under) and stops a
    stream only when the stream lies under that owner's inbox and is the one it names."""

    kind: Literal["cancel"] = "cancel"
    request_id: str
    stream_subject: str
