"""Incremental detokenization and stop conditions.

Text is produced vLLM/TGI style: decode a small window of ids that ends at the newest token, and
compare with the decode of the same window without the unread tokens; the difference is new text.
Text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens) is held back until a later
token completes it. The window starts a few prompt tokens back so tokenizers that drop a leading
space at the start of a decode (SentencePiece) still give the right first word.

Stop strings: the accepted text is searched for every stop string; on a hit the text is cut before
it and the request finishes with "stop". Until then, the longest tail of the text that is a prefix
of some stop string is not emitted (it may turn into a stop string), so a stop string is never sent.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from tandem.shared.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens (leading-space fix)


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Output text of one sequence, grown token by token, with stop-string handling."""

    def __init__(self, tokenizer: Decoder, num_prompt_tokens: int, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = max(num_prompt_tokens - PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = num_prompt_tokens  # tokens up to here are reflected in ``text``
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""  # accepted output text (cut before a stop string once one is seen)
        self.num_emitted = 0  # characters of ``text`` already returned by ``take_delta``

    def update(self, token_ids: Seq[int], num_tokens: int, final: bool = False, find_stops: bool = True) -> bool:
        """Fold ``token_ids[:num_tokens]`` into ``text``; return True if a stop string was hit.

        ``final`` accepts unstable text too (the request is finishing for another reason).
        ``find_stops=False`` folds without looking for stop strings (a sequence short of its
        ``min_tokens``); later calls find only stop strings that end in their own new text.
        """
        prefix_text = self.tokenizer.decode(list(token_ids[self.prefix_offset : self.read_offset]))
        new_text = self.tokenizer.decode(list(token_ids[self.prefix_offset : num_tokens]))
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return False  # nothing stable yet: wait for the token that completes the character
        old_len = len(self.text)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, num_tokens
        return self._cut_at_stop(old_len) if self.stop and find_stops else False

    def take_delta(self, finished: bool) -> str:
        """Return the not yet emitted text that can no longer become part of a stop string."""
        end = len(self.text) if finished else len(self.text) - self._stop_prefix_len()
        if end <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta

    def _cut_at_stop(self, old_len: int) -> bool:
        # A hit must end in the new text, so it starts at most len(s) - 1 chars before it (earlier
        # text was searched when it came, or must not be: the text of the first min_tokens tokens).
        hits = [i for i in (self.text.find(s, max(0, old_len - len(s) + 1)) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        text = self.text
        for length in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop):
                return length
        return 0


def check_stop(seq: Sequence, eos_token_ids: Seq[int], max_model_len: int, text: bool = True) -> str | None:
    """Detokenize the newest token of ``seq`` and return its finish reason, or None.

    Order: stop/eos token (kept in token ids, not in text), stop string, a complete structured
    output (its last token is text), max_tokens, max_model_len.
    The first ``min_tokens`` output tokens end it only by length, as in vLLM: stop tokens are not
    sampled before then (``logits_processors``) and stop strings must end in the text after them.
    ``text=False`` decides on token ids alone and leaves the text to :func:`catch_up_text` (only for
    a sequence without stop strings, whose text cannot end it).
    """
    detok = seq.detokenizer if text else None
    token = seq.token_ids[-1]
    params = seq.params
    may_stop = seq.num_output_tokens > params.min_tokens
    if may_stop and (token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids)):
        reason: str | None = "stop"
        if detok is not None:  # flush text held back for an incomplete character
            detok.update(seq.token_ids, seq.num_tokens - 1, final=True)
        return reason
    reason = None
    if detok is not None and detok.update(seq.token_ids, seq.num_tokens, find_stops=may_stop):
        reason = "stop"
    elif seq.grammar is not None and seq.grammar.is_done:
        reason = "stop"
        if detok is not None:
            detok.update(seq.token_ids, seq.num_tokens, final=True)
    elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        reason = "length"
        if detok is not None:
            detok.update(seq.token_ids, seq.num_tokens, final=True)
    return reason


def can_defer_text(seq: Sequence) -> bool:
    """Whether a sequence's text may lag its tokens by a step: not when stop strings (text) decide
    when it ends, nor for a prefill-only sequence, whose one token starts a hand-off at once, nor
    for one output of several (a group's outputs are made together)."""
    return not seq.params.stop and not seq.prefill_only and seq.group is None


def catch_up_text(seq: Sequence) -> None:
    """Fold the tokens :func:`check_stop` left (``text=False``) into the text, as it would have,
    flushing held-back text when the sequence has finished (a stop token itself is not text)."""
    detok = seq.detokenizer
    if detok is None:
        return
    if seq.finish_reason in ("stop", "length", "abort"):
        # A stop token is not text; the token that completes a structured output is.
        stop_token = seq.finish_reason == "stop" and not (seq.grammar is not None and seq.grammar.ended_on_text)
        detok.update(seq.token_ids, seq.num_tokens - stop_token, final=True)
    else:
        detok.update(seq.token_ids, seq.num_tokens)
