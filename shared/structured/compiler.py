"""Compiling structured output specs over one worker's vocabulary, once per spec (a few times on a GPU).

A compiled grammar is kept as a template matcher, keyed by the spec's hash: a request whose spec
was seen before starts from a copy of it (llguidance shares the compiled grammar between copies),
so a schema costs its compile once per worker, never per request or per token. The cache is an LRU
of ``capacity`` specs. Copies of one template also share its lazily built lexer state, which
serializes filling their masks: on a GPU, where masks are filled on several threads, a spec gets up
to ``copies_per_spec`` templates, compiled as its concurrent requests first need them, and its
requests take them in turn, so the rows of one step can be filled in parallel. The vocabulary's
token table is built when first needed; a worker builds it at start-up
(``LLMEngine.prepare_structured_outputs``), so no request's step pays for it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from tandem.shared.protocol.serving import StructuredOutput
from tandem.shared.structured.grammars import StructuredOutputError, grammar_text, one_line, spec_key
from tandem.shared.structured.output_grammar import OutputGrammar
from tandem.shared.structured.vocabulary import grammar_tokenizer
from tandem.shared.text.tokenizer import Tokenizer

DEFAULT_CAPACITY = 256


@dataclass
class GrammarStats:
    compiled: int = 0  # specs compiled (cache misses)
    reused: int = 0  # requests started from a cached compile
    compile_seconds: float = 0.0  # spent compiling, in total
    mask_fills: int = 0  # steps whose constrained rows had their masks filled
    mask_fill_seconds: float = 0.0  # host time spent filling them, in total


@dataclass
class _Templates:
    """One spec's compiled matchers (each compiled on its own) and whose turn it is."""

    matchers: list
    turn: int = 0


class GrammarCompiler:
    """Structured output specs -> :class:`OutputGrammar` over one vocabulary, cached by spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = DEFAULT_CAPACITY,
                 copies_per_spec: int = 1) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.copies_per_spec = copies_per_spec
        self.stats = GrammarStats()
        self._templates: OrderedDict[str, _Templates] = OrderedDict()
        self._vocabulary = None

    @property
    def vocabulary(self):  # noqa: ANN201 - an llguidance.LLTokenizer
        if self._vocabulary is None:
            try:
                self._vocabulary = grammar_tokenizer(self.tokenizer, self.vocab_size)
            except Exception as exc:  # llguidance's reasons vary: the request gets them as its own error
                raise StructuredOutputError(f"this model's tokenizer cannot be read for structured outputs "
                                            f"({one_line(str(exc))})") from None
        return self._vocabulary

    def output_grammar(self, spec: StructuredOutput) -> OutputGrammar:
        """A fresh matcher for ``spec`` at the start of its output (:class:`StructuredOutputError`
        with llguidance's reason when it does not compile)."""
        key = spec_key(spec)
        entry = self._templates.get(key)
        if entry is None:
            entry = _Templates([self._compile(spec)])
            self._templates[key] = entry
            if len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
            if len(entry.matchers) < self.copies_per_spec:
                entry.matchers.append(self._compile(spec))
            else:
                self.stats.reused += 1
        template = entry.matchers[entry.turn % len(entry.matchers)]
        entry.turn += 1
        return OutputGrammar(template.deep_copy(), spec.start_after)

    def _compile(self, spec: StructuredOutput):  # noqa: ANN202 - an llguidance.LLMatcher
        from llguidance import LLMatcher

        start = time.perf_counter()
        matcher = LLMatcher(self.vocabulary, grammar_text(spec), log_level=0)
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.compiled += 1
        if matcher.is_error():
            raise StructuredOutputError(f"{spec.kind}: {one_line(matcher.get_error())}")
        # The first mask builds lexer state that copies inherit: computed once here, a request's
        # first token does not pay for it on the engine's step.
        matcher.compute_bitmask()
        return matcher
