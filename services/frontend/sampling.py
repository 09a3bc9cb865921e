"""An OpenAI request's generation fields as the bus's :class:`SamplingParams` fields.

OpenAI's names and shapes become the wire's: ``logit_bias`` (a map of token-id strings to biases)
becomes a list of (token id, bias) pairs, the older vLLM server's ``use_beam_search`` becomes
``beam_width`` (``best_of``, else ``n``, beams), chat's ``top_logprobs`` becomes ``logprobs``. The
bounds are the bus's own, checked here by building :class:`SamplingParams`: a bad value is a 400
naming the field as the client sent it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tandem.services.frontend import schemas
from tandem.services.frontend.errors import APIError, bad_request, from_validation, not_supported
from tandem.services.frontend.logprobs import asked_logprobs
from tandem.services.frontend.structured import asked_structured_output
from tandem.shared.protocol.serving import SamplingParams

# Fields taken when given, under the same name on the bus (None: the bus's default).
SAME_NAME = ("temperature", "top_p", "top_k", "seed", "n", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens")


def asked_prompt_logprobs(request: schemas.SamplingFields) -> int | None:
    """vLLM's ``prompt_logprobs``: an integer (the alternatives per prompt token), only whole."""
    value = request.prompt_logprobs
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request("prompt_logprobs: an integer, the alternatives per prompt token", "prompt_logprobs")
    if request.stream:
        raise bad_request("prompt_logprobs: not with stream (they come with the whole answer)", "prompt_logprobs")
    return value


def logit_bias_pairs(bias: dict[str, float]) -> list[tuple[Any, float]]:
    """OpenAI's ``{"50256": -100}`` as the bus's ``[(50256, -100.0)]``; a key that is no integer is a 400."""
    pairs = []
    for key, value in bias.items():
        try:
            pairs.append((int(key), value))
        except ValueError:
            raise bad_request(f"logit_bias: keys are token ids, not {key!r}", "logit_bias") from None
    return pairs


def beam_search_fields(request: schemas.SamplingFields) -> dict[str, Any]:
    """The bus's beam fields for the older vLLM server's ``use_beam_search`` (beam width: ``best_of``,
    else ``n``), or a 400 for a beam-search knob given without it (as vLLM refuses them)."""
    n = request.n or 1
    if not request.use_beam_search:
        if request.length_penalty not in (None, 1.0):
            raise bad_request("length_penalty: applies to beam search only (use_beam_search)", "length_penalty")
        if request.early_stopping not in (None, False):
            raise bad_request("early_stopping: applies to beam search only (use_beam_search)", "early_stopping")
        return {} if request.best_of is None else {"best_of": request.best_of}
    if request.best_of is not None and request.best_of < n:
        raise bad_request(f"best_of ({request.best_of}) must be at least n ({n})", "best_of")
    width = request.best_of if request.best_of is not None else n
    if width < 2:
        raise bad_request("use_beam_search: needs more than one beam (best_of, else n, is the beam width)",
                          "best_of" if request.best_of is not None else "n")
    fields: dict[str, Any] = {"beam_width": width}
    if request.length_penalty is not None:
        fields["length_penalty"] = request.length_penalty
    if request.early_stopping is not None:
        fields["early_stopping"] = request.early_stopping
    return fields


def sampling_params(request: schemas.SamplingFields, max_tokens: int | None, max_tokens_field: str) -> dict[str, Any]:
    """``request``'s :class:`SamplingParams` fields (as keywords of ``tandem.client``), validated by
    the bus's own bounds. ``max_tokens``: as the endpoint resolved it, from ``max_tokens_field``."""
    field_name = schemas.unsupported(request)
    if field_name:
        raise not_supported(field_name)
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params: dict[str, Any] = dict(max_tokens=max_tokens, stop=stop, ignore_eos=request.ignore_eos)
    for name in SAME_NAME:
        if getattr(request, name) is not None:
            params[name] = getattr(request, name)
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    logprobs = asked_logprobs(request)
    if logprobs is not None:
        params["logprobs"] = logprobs
    prompt_logprobs = asked_prompt_logprobs(request)
    if prompt_logprobs is not None:
        params["prompt_logprobs"] = prompt_logprobs
    if request.logit_bias:
        params["logit_bias"] = logit_bias_pairs(request.logit_bias)
    params.update(beam_search_fields(request))
    structured = asked_structured_output(request)
    if structured is not None:
        params["structured_output"] = structured[0]
    # The bus's names back to the request's: chat's number of alternatives is its top_logprobs, and
    # beam search's width came from best_of (or n).
    names = {"max_tokens": max_tokens_field,
             "logprobs": "top_logprobs" if isinstance(request, schemas.ChatCompletionRequest) else "logprobs",
             "beam_width": "best_of" if request.best_of is not None else "n",
             "structured_output": structured[1] if structured is not None else "structured_outputs"}
    try:
        SamplingParams(**params)
    except ValidationError as exc:
        raise logit_bias_error(exc, params) or from_validation(exc, names) from None
    return params


def logit_bias_error(exc: ValidationError, params: dict[str, Any]) -> APIError | None:
    """A 400 naming the token whose bias entry is out of bounds (the bus's location of it, an index
    into its list of pairs, means nothing to the client), or None for any other error."""
    loc = exc.errors()[0]["loc"]
    if len(loc) < 3 or loc[0] != "logit_bias":
        return None
    token = params["logit_bias"][loc[1]][0]
    what = "token id" if loc[2] == 0 else "bias"
    return bad_request(f"logit_bias: the {what} of {str(token)!r}: {exc.errors()[0]['msg']}", "logit_bias")
