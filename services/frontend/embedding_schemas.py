"""The bodies of ``POST /v1/embeddings``, as pydantic models (what crosses the HTTP boundary).

OpenAI's fields (``input``, ``model``, ``encoding_format``, ``dimensions``, ``user``) and vLLM-style
extensions: ``pooling`` ("last" or "mean"; unset: the model's default), ``truncate_prompt_tokens``
and ``priority``. Values are checked by the route (:mod:`.embeddings`), so that each refusal is one
line naming its field; unknown fields are ignored, as OpenAI's API and vLLM do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

TokenIds = list[int]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: str = "float"  # "float" or "base64" (little-endian float32 bytes)
    dimensions: int | None = None  # keep the first N components, normalised again
    user: str | None = None
    pooling: str | None = None
    truncate_prompt_tokens: int | None = None  # keep each input's last N tokens (-1: as the context holds)
    priority: int = 0  # the order in the router's admission queue (lower first)

    def inputs(self) -> list[str | TokenIds]:
        """One entry per input: a string, a list of strings, token ids, or lists of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(x, int) for x in self.input):
            return [list(self.input)]
        return list(self.input)


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # the floats, or their little-endian float32 bytes in base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
