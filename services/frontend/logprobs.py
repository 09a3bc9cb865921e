"""Per-token logprobs in OpenAI's shapes, from the bus's :class:`TokenLogprobs` and the tokenizer.

The bus carries token ids and raw ``log_softmax`` values (see ``tandem.shared.engine.sampling``);
the token strings are the model tokenizer's decoding of each id alone, as vLLM writes them (a
token holding part of a multi-byte character decodes to U+FFFD, and its ``bytes`` are those of
that text). ``/v1/completions`` asks with ``logprobs: N``; ``/v1/chat/completions`` with
``logprobs: true`` and ``top_logprobs: N``.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.services.frontend import schemas
from tandem.services.frontend.errors import bad_request
from tandem.shared.protocol.serving import TokenLogprobs
from tandem.shared.text.tokenizer import Tokenizer


def asked_logprobs(request: schemas.SamplingFields) -> int | None:
    """The bus's ``logprobs`` (top alternatives per token; None: off) for an API request, or a 400
    naming the field whose type is wrong. Its bounds are the bus's, checked with the other params."""
    if isinstance(request, schemas.ChatCompletionRequest):
        if request.logprobs not in (None, True, False):
            raise bad_request("logprobs: chat takes true or false (the number of alternatives is top_logprobs)",
                              "logprobs")
        if not request.logprobs:
            if request.top_logprobs is not None:
                raise bad_request("top_logprobs: only with logprobs set to true", "top_logprobs")
            return None
        return request.top_logprobs or 0
    if request.logprobs is None:
        return None
    if isinstance(request.logprobs, bool) or not isinstance(request.logprobs, int):
        raise bad_request("logprobs: completions take an integer, the alternatives per token", "logprobs")
    return request.logprobs


class TokenText:
    """Token ids to their text, each id decoded alone once (a stream asks for the same ids often)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs], text_of: TokenText,
                        text_offset: int = 0) -> schemas.CompletionLogprobs:
    """The legacy completion shape for ``token_ids`` (one entry each); offsets count characters of
    the tokens' texts from ``text_offset`` (where the previous chunk of a stream stopped)."""
    result = schemas.CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text_of(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        # As vLLM: the alternatives and the sampled token (which may be one of them).
        top = {text_of(top_id): value for top_id, value in entry.top}
        top.setdefault(token, entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def _top(token: str, logprob: float) -> schemas.TopLogprob:
    return schemas.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[TokenLogprobs],
                  text_of: TokenText) -> schemas.ChatLogprobs:
    """The chat shape: per token its text, logprob, bytes and exactly the top ``top_logprobs``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = text_of(token_id)
        content.append(schemas.ChatTokenLogprob(
            token=token, logprob=entry.logprob, bytes=list(token.encode("utf-8")),
            top_logprobs=[_top(text_of(top_id), value) for top_id, value in entry.top]))
    return schemas.ChatLogprobs(content=content)


def prompt_logprobs(prompt_token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None],
                    text_of: TokenText) -> schemas.PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first, which has nothing before
    it) the prompt's own token and the top alternatives of that position, by token id, each with
    its logprob, rank (1: most likely) and text."""
    shaped: schemas.PromptLogprobs = []
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            shaped.append(None)
            continue
        ranks = {top_id: rank for rank, (top_id, _) in enumerate(entry.top, 1)}
        position = {str(token_id): schemas.PromptLogprob(logprob=entry.logprob, rank=ranks.get(token_id),
                                                         decoded_token=text_of(token_id))}
        for top_id, value in entry.top:
            position.setdefault(str(top_id), schemas.PromptLogprob(logprob=value, rank=ranks[top_id],
                                                                   decoded_token=text_of(top_id)))
        shaped.append(position)
    return shaped
