"""Request migration, the client's side: what a stream has delivered, and the request that places
it again when the worker streaming it died.

The client is the one party sure to hold every token a request has streamed, so it re-places the
request itself: the same prompt (as token ids, so it is not tokenized again), the ``max_tokens``
the router granted the first time, and ``resume_output_token_ids`` = the tokens delivered so far.
The workers take those as output sampled elsewhere and stream what follows from index
``len(resume_output_token_ids)`` on, so the caller sees one stream with no gap and no duplicate.
``exclude_workers`` names the workers the client saw die under the request: a router that has not
noticed yet (their last heartbeat is a moment old, and they cache the prompt) would otherwise
place it on one of them again.
Each placement has its own request id (:func:`placement_request_id`), hence its own stream
subject: a late chunk of a placement given up on cannot enter the new one, and a cancel reaches
exactly the placement it names.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from tandem.shared.protocol.serving import GenerateAccepted, GenerateRequest, StreamChunk

MAX_REQUEST_ID_CHARS = 128  # as RequestId allows
MAX_EXCLUDED = 32  # as GenerateRequest.exclude_workers allows


def placement_request_id(request_id: str, placement: int) -> str:
    """The id of a request's ``placement``-th placement after the first (0: the request's own id)."""
    if placement == 0:
        return request_id
    suffix = f"~p{placement}"
    if len(request_id) + len(suffix) > MAX_REQUEST_ID_CHARS:  # still one per request: a digest of the id
        request_id = hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()
    return request_id + suffix


@dataclass
class ResumeState:
    """One request's output as delivered to the caller, and its migrations so far. Only requests
    with one output migrate (several outputs' candidates are not re-placed yet), so this is output
    0's."""

    max_migrations: int
    token_ids: list[int] = field(default_factory=list)  # delivered, in order
    logprob_sum: float = 0.0  # of the delivered tokens' logprobs, when they were asked for
    prompt_logprobs_delivered: bool = False
    migrations: int = 0
    resumed: int = 0  # tokens the current placement started from
    resumed_logprob_sum: float = 0.0  # their logprobs' sum: the current placement's own figure leaves them out
    reasons: list[str] = field(default_factory=list)  # why each migration happened
    excluded: list[str] = field(default_factory=list)  # workers seen dead under it, oldest first

    def exclude(self, instance: str) -> None:
        """Never place the request on ``instance`` again (bounded as ``GenerateRequest`` bounds it)."""
        if instance not in self.excluded:
            self.excluded = [*self.excluded, instance][-MAX_EXCLUDED:]

    def deliver(self, chunk: StreamChunk) -> StreamChunk:
        """Record ``chunk`` as delivered and return it as the caller should see it: after a
        migration its cumulative logprob counts the resumed tokens too, and prompt logprobs a
        placement computed again are not delivered twice."""
        self.token_ids.extend(chunk.token_ids)
        self.logprob_sum += sum(entry.logprob for entry in chunk.logprobs or ())
        update = {}
        if chunk.prompt_logprobs is not None:
            if self.prompt_logprobs_delivered:
                update["prompt_logprobs"] = None
            self.prompt_logprobs_delivered = True
        if chunk.cumulative_logprob is not None and self.resumed:
            update["cumulative_logprob"] = chunk.cumulative_logprob + self.resumed_logprob_sum
        return chunk.model_copy(update=update) if update else chunk

    def limit_reached(self) -> bool:
        return self.migrations >= self.max_migrations

    def limit_message(self, reason: str) -> str:
        return f"migrated {self.migrations} times; last: {reason}"

    def migrate(self, reason: str) -> None:
        """Count a migration from here: the next placement resumes after every token delivered."""
        self.migrations += 1
        self.reasons.append(reason)
        self.resumed = len(self.token_ids)
        self.resumed_logprob_sum = self.logprob_sum

    def resumed_request(self, original: GenerateRequest, accepted: GenerateAccepted | None, request_id: str,
                        stream_subject: str) -> GenerateRequest:
        """``original`` placed again under ``request_id`` and ``stream_subject``, going on after the
        delivered tokens. ``accepted``: the router's answer to an earlier placement (None when none
        came: then the request is sent as it was, with the tokens it has, maybe none)."""
        update: dict = {"request_id": request_id, "stream_subject": stream_subject,
                        "resume_output_token_ids": list(self.token_ids), "exclude_workers": list(self.excluded)}
        if accepted is not None:
            # The same tokens and the same grant: a re-placement neither re-tokenizes the prompt nor
            # lets another worker's context length change max_tokens.
            update.update(prompt=None, prompt_token_ids=list(accepted.prompt_token_ids),
                          params=original.params.model_copy(
                              update={"max_tokens": accepted.max_tokens or original.params.max_tokens}))
        return original.model_copy(update=update)
