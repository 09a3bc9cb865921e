"""One output's place in its grammar: the matcher a sequence advances with every token it samples.

A sequence's matcher has taken exactly its output tokens so far, whatever ran them: a prefill
worker's first token, a migration's resumed tokens and a hand-off's are taken when the request is
added (``accept_all``), so a decode worker's or a new worker's matcher is where the old one was. A
forked sample gets its own copy. With ``start_after`` (a reasoning section's end), tokens are free
until those ids have appeared in the output; the matcher takes what follows.
"""

from __future__ import annotations

from collections.abc import Sequence


class GrammarViolation(ValueError):
    """A token the grammar does not admit reached a matcher, or no token can continue the output."""


class OutputGrammar:
    """The matcher of one output (an ``llguidance.LLMatcher``), with the free prefix before it starts."""

    def __init__(self, matcher, start_after: Sequence[int] = ()) -> None:  # noqa: ANN001 - an LLMatcher
        self.matcher = matcher
        self.start_after = tuple(start_after)
        self.started = not self.start_after
        self._recent: tuple[int, ...] = ()  # the last tokens before the start, to find start_after in

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is masked (the grammar has started and has not ended)."""
        return self.started and not self.matcher.is_stopped()

    @property
    def is_done(self) -> bool:
        """The output is complete: nothing but its end may follow."""
        return self.started and self.matcher.is_stopped()

    @property
    def ended_on_text(self) -> bool:
        """The output's last token completed it (it is text), rather than an end-of-sequence token."""
        return self.is_done and self.matcher.stop_reason() != "EndOfSentence"

    def accept(self, token_id: int) -> None:
        """Advance with the output's next token; :class:`GrammarViolation` if the grammar refuses it."""
        if not self.started:
            self._recent = (self._recent + (token_id,))[-len(self.start_after):]
            self.started = self._recent == self.start_after
            return
        if self.matcher.is_stopped():
            return  # the end token after a complete output (eos) needs no place in the grammar
        if not self.matcher.consume_token(token_id):
            raise GrammarViolation(f"structured output: token {token_id} does not continue the output "
                                   f"({self.matcher.get_error() or 'refused'})")

    def accept_all(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            self.accept(token_id)

    def fork(self) -> OutputGrammar:
        """An independent copy at the same place (a forked sample's)."""
        child = OutputGrammar(self.matcher.deep_copy(), self.start_after)
        child.started, child._recent = self.started, self._recent
        return child
