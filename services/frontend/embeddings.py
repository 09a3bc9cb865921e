"""``POST /v1/embeddings``: OpenAI's embeddings endpoint over the workers.

Each input becomes one embedding request on the bus through :meth:`tandem.client.Client.embed`, as
a library user's would: the router tokenizes and places it, a decode worker prefills it in its
running batch beside generation and returns the pooled, L2-normalised final hidden states (what
feeds the LM head; ``pooling`` "last" or "mean", unset: the model's default). The route shares
everything else with generation: the API key (the gate covers every ``/v1/`` path), the body's size
bound, ``--max-concurrent-requests`` (each input in flight on the bus counts, at most
``IN_FLIGHT`` of one request at a time), a client that disconnects cancelling its requests, the
HTTP metrics, and OpenAI's error shape: one line naming the field for an empty input, more than
``MAX_INPUTS`` inputs, a token id outside the vocabulary, an input longer than the context, or a
bad ``encoding_format``, ``dimensions`` (above the hidden size too), ``pooling`` or
``truncate_prompt_tokens``. ``encoding_format`` "base64" is the vector's little-endian float32
bytes, as OpenAI's client decodes them.
"""

from __future__ import annotations

import asyncio
import base64
import time
from array import array
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tandem.client import Embedding, TandemError
from tandem.services.frontend.embedding_schemas import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from tandem.services.frontend.errors import APIError, bad_request, from_tandem
from tandem.shared.protocol.embedding import POOLING_METHODS, vector_bytes

if TYPE_CHECKING:
    from tandem.services.frontend.app import Frontend

PATH = "/v1/embeddings"
MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
IN_FLIGHT = 64  # inputs of one request on the bus at once (the rest wait here, not in the router's queue)
ENCODINGS = ("float", "base64")
DISCONNECT_POLL_S = 0.25
# The bus names an input ``prompt`` (or ``prompt_token_ids``); the HTTP request calls it ``input``.
BUS_FIELDS = {"prompt": "input", "prompt_token_ids": "input"}


def add_embeddings_route(app: FastAPI, frontend: Frontend) -> None:
    """Serve ``POST /v1/embeddings`` on ``app`` with ``frontend``'s client, model, limits and metrics."""

    @app.post(PATH)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        bus_model = frontend.check_model(body.model)
        inputs = checked_inputs(body)
        check_options(body)
        in_flight = min(len(inputs), IN_FLIGHT)
        frontend.admit(in_flight)
        started = time.perf_counter()
        try:
            vectors = await embed_unless_disconnected(request, frontend, body, inputs, bus_model)
        finally:
            frontend.running -= in_flight
        if frontend.metrics is not None:
            frontend.metrics.e2e.observe(time.perf_counter() - started)
            for vector in vectors:
                frontend.metrics.embedded(vector.prompt_tokens)
        prompt_tokens = sum(vector.prompt_tokens for vector in vectors)
        data = [EmbeddingData(index=v.index, embedding=encoded(v.vector, body.encoding_format)) for v in vectors]
        return JSONResponse(EmbeddingResponse(data=data, model=frontend.model.served_name,
                                              usage=EmbeddingUsage(prompt_tokens=prompt_tokens,
                                                                   total_tokens=prompt_tokens)).model_dump())


def checked_inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, or a 400 naming ``input``: none, too many, or an empty one."""
    inputs = body.inputs()
    if not inputs:
        raise bad_request("input: no input to embed; send a string, a list of strings or token ids", "input")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input: {len(inputs):,} inputs in one request; at most {MAX_INPUTS:,}: split the request",
                          "input", "too_many_inputs")
    empty = next((i for i, item in enumerate(inputs) if len(item) == 0), None)
    if empty is not None:
        which = f"input {empty} is empty" if len(inputs) > 1 else "the input is empty"
        raise bad_request(f"input: {which}; every input needs at least one token", "input")
    negative = next((t for item in inputs if not isinstance(item, str) for t in item if t < 0), None)
    if negative is not None:
        raise bad_request(f"input: token id {negative} is negative; token ids are 0 or more", "input")
    return inputs


def check_options(body: EmbeddingRequest) -> None:
    """A 400 naming the first option out of its bounds (the bus checks ``dimensions`` against the
    model's hidden size, and token ids against its vocabulary and context)."""
    if body.encoding_format not in ENCODINGS:
        raise bad_request(f"encoding_format: {body.encoding_format!r} is not one of {', '.join(ENCODINGS)}",
                          "encoding_format")
    if body.pooling is not None and body.pooling not in POOLING_METHODS:
        raise bad_request(f"pooling: {body.pooling!r} is not one of {', '.join(POOLING_METHODS)} (leave it out for "
                          "the model's default)", "pooling")
    if body.dimensions is not None and body.dimensions < 1:
        raise bad_request(f"dimensions: {body.dimensions} must be at least 1", "dimensions")
    keep = body.truncate_prompt_tokens
    if keep is not None and keep < 1 and keep != -1:
        raise bad_request(f"truncate_prompt_tokens: {keep} must be at least 1, or -1 (as many as the context holds)",
                          "truncate_prompt_tokens")


async def embed_unless_disconnected(request: Request, frontend: Frontend, body: EmbeddingRequest,
                                    inputs: list[str | list[int]], bus_model: str) -> list[Embedding]:
    """Every input's embedding, in order; a client gone meanwhile cancels them (499)."""
    work = asyncio.ensure_future(frontend.client.embed(
        inputs, pooling=body.pooling, dimensions=body.dimensions, model=bus_model,  # an adapter: the router says no
        priority=body.priority, truncate_prompt_tokens=body.truncate_prompt_tokens, max_in_flight=IN_FLIGHT))

    async def disconnected() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client left (or this handler was cancelled): the inputs are cancelled
            work.cancel()
    if work.cancelled():
        raise APIError(499, "the client closed the connection", "client_closed_request")
    try:
        return work.result()
    except TandemError as exc:
        raise from_tandem(exc, BUS_FIELDS.get(exc.param, exc.param)) from None


def encoded(vector: array, encoding_format: str) -> list[float] | str:
    """The vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector_bytes(vector)).decode("ascii")
    return vector.tolist()
