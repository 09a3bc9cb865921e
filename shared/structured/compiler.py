"""Compiling structured output specs over one worker's vocabulary, once per spec.

A compiled grammar is kept as a template matcher, keyed by the spec's hash: a request whose spec
was seen before starts from a copy of it (llguidance shares the compiled grammar between copies),
so a schema costs its compile once per worker, never per request or per token. The cache is an LRU
of ``capacity`` specs. The vocabulary's token table is built on the first structured request, not
at start-up: a worker that serves none never pays for it.
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
class CompileStats:
    compiled: int = 0  # specs compiled (cache misses)
    reused: int = 0  # requests started from a cached compile
    compile_seconds: float = 0.0  # spent compiling, in total


class GrammarCompiler:
    """Structured output specs -> :class:`OutputGrammar` over one vocabulary, cached by spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.stats = CompileStats()
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._vocabulary = None

    @property
    def vocabulary(self):  # noqa: ANN201 - an llguidance.LLTokenizer
        if self._vocabulary is None:
            self._vocabulary = grammar_tokenizer(self.tokenizer, self.vocab_size)
        return self._vocabulary

    def output_grammar(self, spec: StructuredOutput) -> OutputGrammar:
        """A fresh matcher for ``spec`` at the start of its output (:class:`StructuredOutputError`
        with llguidance's reason when it does not compile)."""
        key = spec_key(spec)
        template = self._templates.get(key)
        if template is None:
            template = self._compile(spec)
            self._templates[key] = template
            if len(self._templates) > self.capacity:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(key)
            self.stats.reused += 1
        return OutputGrammar(template.deep_copy(), spec.start_after)

    def _compile(self, spec: StructuredOutput):  # noqa: ANN202 - an llguidance.LLMatcher
        from llguidance import LLMatcher

        start = time.perf_counter()
        matcher = LLMatcher(self.vocabulary, grammar_text(spec), log_level=0)
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.compiled += 1
        if matcher.is_error():
            raise StructuredOutputError(f"{spec.kind}: {one_line(matcher.get_error())}")
        return matcher
