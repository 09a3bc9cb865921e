"""tandem's async client library.

    import asyncio
    from tandem.client import connect

    async def main() -> None:
        async with connect() as client:  # the running `tandem up`; or connect("nats://host:4222")
            async for chunk in client.generate("def fib(n):", max_tokens=32):
                print(chunk.text, end="", flush=True)
            result = await client.complete("import os", max_tokens=16, temperature=0)
            print(result.text, result.finish_reason, result.ttft_s)
            several = await client.complete("def add(a, b):", n=3, temperature=0.8, max_tokens=16)
            for output in several.outputs:  # best first
                print(output.cumulative_logprob, output.text)
            beams = await client.beam_search("import", beam_width=4, max_tokens=8)
            vectors = await client.embed(["def f():", "import os"], pooling="mean")  # one Embedding each

    asyncio.run(main())

Every :class:`SamplingParams` field is a keyword of ``generate``/``complete`` (``logit_bias`` may
also be a mapping of token id to bias). A request with ``n`` outputs (or ``best_of`` candidates, or
beams) streams chunks that name their output (:attr:`Chunk.sample_index`); the stream ends once
every output has its ``finish_reason``. ``complete`` returns them all in
:attr:`Completion.outputs`, best first, its own ``text``/``token_ids``/... being the best one's.

A request with one output survives its worker's death: when the worker streaming it stops
sending heartbeats (the prefill worker's count until the first token of the placement), or its
stream ends with a worker failure, the client places it again with the tokens delivered so far,
and the stream goes on with no gap and no duplicate (``max_migrations`` per request, default 3;
see :mod:`tandem.client.migration`).

A request runs with a LoRA adapter by naming it as its ``model``:
``client.complete("SELECT", model="sql-lora", max_tokens=16)`` (or ``generate(..., model=...)``);
``model`` unset or the served model's own name runs the base model, a name the routers do not serve
raises :class:`UnknownModelError`. Adapters are managed through the routers, with a key whose role
may (the operator's, not a client's: see :mod:`tandem.client.adapters`)::

    record = await client.load_adapter("sql-lora", "/models/adapters/sql")  # an AdapterRecord
    [a.name for a in await client.adapters()]                               # served now
    await client.unload_adapter("sql-lora")

``embed`` returns one :class:`Embedding` per input: the served model's final hidden states pooled
(last token or mean) and L2-normalised, as an ``array('f')`` (see :mod:`tandem.client.embedding`).

Errors are typed: :class:`NoWorkersError`, :class:`RequestTimeoutError`,
:class:`InvalidRequestError` (and its :class:`UnknownModelError`, :class:`PromptTooLongError`),
:class:`WorkerFailureError`, :class:`ConnectionLostError`, all :class:`TandemError`; nats-py's own
errors never reach the caller. Leaving a ``generate`` loop early (``break``, an exception, Ctrl-C)
sends the request's cancel at once, so the workers free its blocks.
"""

from tandem.client.connect import connect, resolve_url
from tandem.client.embedding import Embedding
from tandem.client.errors import (
    ConnectionLostError,
    InvalidRequestError,
    NoWorkersError,
    OverloadedError,
    PromptTooLongError,
    RequestTimeoutError,
    RequestTooLargeError,
    ShuttingDownError,
    TandemError,
    UnknownModelError,
    WorkerFailureError,
    error_field,
    error_from_reply,
)
from tandem.client.output import Chunk, Completion, CompletionOutput, OutputAssembly
from tandem.client.session import Client
from tandem.client.stream import RequestStream

__all__ = [
    "Chunk", "Client", "Completion", "CompletionOutput", "ConnectionLostError", "Embedding", "InvalidRequestError",
    "NoWorkersError", "OutputAssembly", "OverloadedError", "PromptTooLongError", "RequestStream",
    "RequestTimeoutError", "RequestTooLargeError", "ShuttingDownError", "TandemError", "UnknownModelError",
    "WorkerFailureError", "connect", "error_field", "error_from_reply", "resolve_url",
]
