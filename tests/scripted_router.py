"""A router played by the test, on a real NATS connection: it accepts every ``GenerateRequest``
(the prompt's token ids: its UTF-8 bytes, as the tiny byte-level model's), then publishes the
``StreamChunk`` objects a script makes for it on the request's stream subject, as workers would.

So the client library's and the frontend's handling of several outputs (interleaved, out of
order, held until the end, an error mid-way) is tested on real messages over a real server,
whatever the engine does today::

    router = await ScriptedRouter.start(url, lambda request: [chunk(request, 0, 0, [104], "h", "stop")])
    ...
    await router.close()

``router.requests`` keeps every request it took, as decoded from the wire. It takes embedding
requests too (``tandem.v1.router.embed.<owner>``): their script publishes an ``EmbeddingResult``
(see :func:`embedding_result`) or an error chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import nats
from support import flushed

from tandem.shared.protocol import subjects
from tandem.shared.protocol.base import ErrorCode, ErrorReply
from tandem.shared.protocol.codec import decode, encode
from tandem.shared.protocol.embedding import EmbeddingResult, EmbedRequest, vector_bytes
from tandem.shared.protocol.fleet import Heartbeat
from tandem.shared.protocol.serving import GenerateAccepted, GenerateRequest, Probe, StreamChunk, TokenLogprobs

DECODE_WORKER = "decode-scripted"  # the decode worker every placement names
PROBE = "probe"  # a script step: ask the client whether it still listens, as a decode worker does every 2 s
# A script step: a chunk to publish, a pause (seconds) before the next one, PROBE, or a heartbeat of
# the scripted decode worker (see :func:`beat`).
Step = StreamChunk | EmbeddingResult | float | str | Heartbeat
Script = Callable[[GenerateRequest | EmbedRequest], Sequence[Step]]


def chunk(request: GenerateRequest, sample: int, index: int, token_ids: list[int], text: str | None = None,
          finish_reason: str | None = None, **fields) -> StreamChunk:
    """Output ``sample``'s tokens from ``index`` on (their text: the bytes decoded, unless given)."""
    text = bytes(token_ids).decode("utf-8", "replace") if text is None else text
    return StreamChunk(request_id=request.request_id, index=index, token_ids=token_ids, text=text,
                       finish_reason=finish_reason, sample_index=sample, **fields)


def embedding_result(request: EmbedRequest, vector: list[float]) -> EmbeddingResult:
    """What a decode worker publishes for an embedding request: its vector (as given: unnormalised here)."""
    return EmbeddingResult(request_id=request.request_id, embedding=vector_bytes(vector),
                           num_prompt_tokens=len(prompt_ids(request)), pooling=request.pooling.method or "last")


def error_chunk(request: GenerateRequest | EmbedRequest, message: str,
                code: ErrorCode = ErrorCode.WORKER_FAILURE) -> StreamChunk:
    """The chunk a worker sends when the request failed there (or, ``shutting_down``, it stopped
    before the request finished): it ends every output."""
    error = ErrorReply(code=code, message=message, request_id=request.request_id)
    return StreamChunk(request_id=request.request_id, index=0, token_ids=[], text="", error=error)


def entries(*logprobs: float) -> list[TokenLogprobs]:
    """One logprobs entry per value, each its own only alternative."""
    return [TokenLogprobs(logprob=value, top=[(0, value)]) for value in logprobs]


def prompt_ids(request: GenerateRequest | EmbedRequest) -> list[int]:
    return list(request.prompt.encode()) if request.prompt is not None else list(request.prompt_token_ids)


def beat(incarnation: str) -> Heartbeat:
    """A script step: the scripted decode worker beats as the process ``incarnation``; placements
    from then on name it (a new one stands for a restart under the same instance id)."""
    return Heartbeat(service="decode", instance_id=DECODE_WORKER, host="scripted", pid=1, model="tiny",
                     incarnation=incarnation)


class ScriptedRouter:
    def __init__(self, nc: nats.NATS, script: Script) -> None:
        self.nc = nc
        self.script = script
        self.requests: list[GenerateRequest | EmbedRequest] = []
        self.decode_incarnation = ""  # the process placements name (GenerateAccepted.decode_incarnation)
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    async def start(cls, url: str, script: Script) -> ScriptedRouter:
        router = cls(await nats.connect(url), script)
        await router.nc.subscribe(subjects.ROUTER_GENERATE_ALL, cb=router._on_generate)
        await router.nc.subscribe(subjects.ROUTER_EMBED_ALL, cb=router._on_embed)
        await flushed(router.nc)
        return router

    async def _on_generate(self, msg) -> None:
        request = decode(msg.data, GenerateRequest)
        self.requests.append(request)
        await msg.respond(encode(GenerateAccepted(request_id=request.request_id, prompt_token_ids=prompt_ids(request),
                                                  prefill_worker=None, decode_worker=DECODE_WORKER,
                                                  decode_incarnation=self.decode_incarnation,
                                                  max_tokens=request.params.max_tokens or 16)))
        self._play(request)

    async def _on_embed(self, msg) -> None:
        request = decode(msg.data, EmbedRequest)
        self.requests.append(request)
        await msg.respond(encode(GenerateAccepted(request_id=request.request_id, prompt_token_ids=prompt_ids(request),
                                                  prefill_worker=None, decode_worker=DECODE_WORKER,
                                                  decode_incarnation=self.decode_incarnation)))
        self._play(request)

    def _play(self, request: GenerateRequest | EmbedRequest) -> None:
        task = asyncio.ensure_future(self._stream(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stream(self, request: GenerateRequest | EmbedRequest) -> None:
        await asyncio.sleep(0.05)  # after the client has the accept: chunks are published to its live inbox
        for step in self.script(request):
            if isinstance(step, float | int):
                await asyncio.sleep(step)
            elif isinstance(step, Heartbeat):
                self.decode_incarnation = step.incarnation
                await self.nc.publish(subjects.heartbeat(step.service, step.instance_id), encode(step))
            elif step == PROBE:
                await self.nc.request(request.stream_subject, encode(Probe(request_id=request.request_id)), timeout=2)
            else:
                await self.nc.publish(request.stream_subject, encode(step))
        await self.nc.flush()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.nc.close()
