"""Two constrained-decoding libraries, llguidance and xgrammar, on the workload tandem's engine gives them.

    python benchmarks/grammar_engines.py [--batch 1 32 256] [--steps N] [--vocab byte bpe] [--json out.json]

Measured per library and per vocabulary, with the same thread count for both (``--threads``):

- compile: a mid-size JSON schema (:data:`SCHEMA`: nested objects, an array of objects, enums,
  string patterns, bounded integers, ``additionalProperties: false``), a regex and a small grammar
  (Lark for llguidance, EBNF for xgrammar: each library's own syntax for the same language).
  ``cold`` compiles with nothing cached (xgrammar's cache cleared before each); ``1st mask`` is the
  first bitmask of a fresh matcher right after it (llguidance builds its lexer lazily, xgrammar
  precomputes while compiling, so only their sum compares); ``again`` is the same spec a second
  time through the library's cache (xgrammar: ``GrammarCompiler(cache_enabled=True)``; llguidance,
  which keeps none: a new ``LLMatcher`` from the grammar string kept from the first time); ``per
  request`` is what the engine does per request once the spec is known (llguidance: ``deep_copy()``
  of a template matcher; xgrammar: ``GrammarMatcher(compiled)``), then that matcher's first mask,
  and that first mask again once the template has computed its own (llguidance copies inherit it).
- mask per token: ``B`` independent matchers for the schema, each at its own position (rows join at
  random warm-up steps), each writing JSON documents one after another (a finished row starts a new
  document at once, as the next request would take its slot). Timed steps alternate between the
  batch APIs (llguidance: ``LLExecutor`` with ``llguidance.torch.fill_next_token_bitmask_par`` and
  ``consume_token_par``; xgrammar: ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` and
  ``batch_accept_token``, or per-row calls where a version lacks them: the output says which) and one
  call per row, for the fill of all ``B`` rows' bitmasks and for the advance of each row by its token
  alike (a second fill of the same state would find the first one's work cached). Median and p90 per
  step, and the median per row. Tokens are drawn at random among the allowed ones by one seeded
  generator: printable ones, half the time the longest, and, the longer a string or number runs,
  ones that can close it, so documents end; both libraries walk the same path where their masks
  agree (``same path``). Every finished document is parsed and checked against the schema (with
  ``jsonschema`` where it is installed).
- mask agreement: both libraries fed the same tokens (drawn among those both allow) for
  ``--agree-documents`` documents: at how many steps their masks differ, with examples.
- support: small specs for JSON schema features, regex, Lark and GBNF/EBNF, compiled by each library
  on the byte vocabulary, then fed a valid and an invalid text: ``ok`` (accepts the one, rejects the
  others), ``not enforced`` (accepts an invalid text), ``rejects valid`` or ``error: <first line>``.

Vocabularies: ``byte`` is tandem's ``ByteTokenizer`` (ids 0..255 the bytes, then <bos>, <eos>, <pad>);
``bpe`` is a byte-level BPE of about 128K tokens: a ``tokenizer.json`` given with ``--tokenizer`` or,
by default, one trained here in seconds on a generated corpus of English-like words, compact JSON
and Python (deterministic; the output says which). Both libraries get compact JSON (no free
whitespace). xgrammar gets special tokens other than the stop token as empty strings, which it treats
as special: given their text, it would admit them inside JSON strings.

Needs llguidance (``pip install -e .[serve]``); xgrammar is optional: without it only llguidance is
measured and the output says ``xgrammar: not installed``. Progress goes to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.shared.structured.vocabulary import byte_level_decoder, piece_bytes
from tandem.shared.text.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE

# An order record: the shape of what clients ask tandem for (tool arguments, extraction records).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "created": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "customer": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "name": {"type": "string"},
                "email": {"type": "string", "pattern": "^[a-z0-9._]{1,16}@[a-z0-9]{1,12}\\.[a-z]{2,4}$"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
                        "postcode": {"type": "string"},
                    },
                    "required": ["city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["id", "name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit_price": {"type": "number", "minimum": 0},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
        "total": {"type": "number"},
        "shipping": {
            "type": "object",
            "properties": {
                "method": {"enum": ["ground", "air", "pickup"]},
                "eta_days": {"type": "integer", "minimum": 0, "maximum": 60},
            },
            "required": ["method"],
            "additionalProperties": False,
        },
        "notes": {"type": "string"},
    },
    "required": ["order_id", "status", "customer", "items", "currency", "total"],
    "additionalProperties": False,
}

REGEX = r"[a-z][a-z0-9._%+-]{0,30}@[a-z0-9-]{1,20}(\.[a-z0-9-]{1,20}){0,3}\.(com|org|net|io|[a-z]{2})"

# The same language in each library's own grammar syntax: arithmetic with names and calls.
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | NAME | NAME "(" args? ")" | "(" expr ")"
args: expr ("," expr)*
NUMBER: /[0-9]+(\.[0-9]+)?/
NAME: /[a-z_][a-z0-9_]*/
"""
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | name | name "(" args? ")" | "(" expr ")"
args ::= expr ("," expr)*
number ::= [0-9]+ ("." [0-9]+)?
name ::= [a-z_] [a-z0-9_]*
"""

# Each probe: (feature, kind, spec, a text it must accept, texts it must reject).
PROBES: list[tuple[str, str, Any, str, list[str]]] = [
    ("json: string pattern", "json_schema", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
     '"ABC-12"', ['"abc-12"']),
    ("json: format date-time", "json_schema", {"type": "string", "format": "date-time"},
     '"2024-01-02T03:04:05Z"', ['"yesterday"']),
    ("json: minLength/maxLength", "json_schema", {"type": "string", "minLength": 2, "maxLength": 4},
     '"abc"', ['"a"', '"abcdef"']),
    ("json: number minimum/maximum", "json_schema", {"type": "number", "minimum": 0.5, "maximum": 2.5},
     "1.5", ["3", "0.25"]),
    ("json: string escape \\/", "json_schema", {"type": "string"}, '"a\\/b"', ['"a\\qb"']),
    ("json: string escape \\u00e9", "json_schema", {"type": "string"}, '"caf\\u00e9"', ['"caf\\u00g9"']),
    ("json: number minimum, 8 decimals", "json_schema", {"type": "number", "minimum": 0}, "3.14159265", ["-1"]),
    ("json: number minimum, exponent", "json_schema", {"type": "number", "minimum": 0}, "2.5e3", ["-1"]),
    ("json: minItems/maxItems", "json_schema", {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                                 "maxItems": 3},
     "[1,2]", ["[1]", "[1,2,3,4]"]),
    ("json: uniqueItems", "json_schema", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     "[1,2]", ["[1,1]"]),
    ("json: anyOf", "json_schema", {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 2}]},
     "12", ["5", '"abc"']),
    ("json: oneOf", "json_schema", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"x"', ["true"]),
    ("json: $ref/$defs, recursive", "json_schema", {
        "$defs": {"node": {"type": "object", "required": ["v"], "additionalProperties": False, "properties": {
            "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"},
     '{"v":1,"kids":[{"v":2}]}', ['{"v":1,"kids":[{"w":2}]}']),
    ("json: if/then", "json_schema", {
        "type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
        "required": ["kind", "n"], "additionalProperties": False,
        "if": {"properties": {"kind": {"const": "a"}}}, "then": {"properties": {"n": {"minimum": 10}}}},
     '{"kind":"a","n":12}', ['{"kind":"a","n":1}']),
    ("json: any object", "json_schema", {"type": "object"}, '{"a":[1,{"b":null}]}', ["[1]"]),
    ("regex", "regex", r"[a-z]+@[a-z]+\.(com|org)", "bob@x.org", ["bob@x.net"]),
    ("lark grammar", "lark", LARK, "f(1,x)*(2+3.5)", ["f(1,x)*(2+"]),
    ("gbnf/ebnf grammar", "gbnf", EBNF, "f(1,x)*(2+3.5)", ["f(1,x)*(2+"]),
]

CLOSERS = b'"]},'  # a token holding one of these can end the string, number, array or object it is in
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<|im_end|>", "</s>", "<eos>")


class CompileError(Exception):
    """A spec the library refused; the message is its own."""


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def first_line(error: BaseException | str) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:160]


# --- vocabularies ----------------------------------------------------------------------------------

@dataclass
class Vocab:
    """A token vocabulary as both libraries see it: each id's bytes (a special token's name), its
    stop token, and the masks the token chooser reads."""

    name: str
    source: str
    token_bytes: list[bytes]
    special_ids: set[int]
    eos_id: int
    bos_id: int | None
    tokenizer_json: str | None  # llguidance reads a Hugging Face tokenizer itself; None: the byte vocabulary
    build_s: float = 0.0
    plain: np.ndarray = field(init=False)  # printable ASCII tokens, and the stop token
    closer: np.ndarray = field(init=False)
    quote: np.ndarray = field(init=False)
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.plain = np.array([i not in self.special_ids and bool(b) and all(0x20 <= c < 0x7F for c in b)
                               for i, b in enumerate(self.token_bytes)])
        self.plain[self.eos_id] = True
        self.closer = np.array([i not in self.special_ids and any(c in CLOSERS for c in b)
                                for i, b in enumerate(self.token_bytes)])
        self.quote = np.array([i not in self.special_ids and b'"' in b for i, b in enumerate(self.token_bytes)])
        self.lengths = np.array([0 if i in self.special_ids else len(b) for i, b in enumerate(self.token_bytes)])

    @property
    def size(self) -> int:
        return len(self.token_bytes)

    def text_of(self, token: int) -> bytes:
        return b"" if token in self.special_ids else self.token_bytes[token]


def byte_vocab() -> Vocab:
    names = {BYTE_BOS_ID: b"<bos>", BYTE_EOS_ID: b"<eos>", BYTE_PAD_ID: b"<pad>"}
    tokens = [bytes([i]) for i in range(256)] + [names[i] for i in range(256, BYTE_VOCAB_SIZE)]
    return Vocab("byte", "tandem's ByteTokenizer (256 bytes, <bos>, <eos>, <pad>)", tokens, set(names), BYTE_EOS_ID,
                 BYTE_BOS_ID, None)


def synthetic_corpus(seed: int) -> list[str]:
    """English-like prose over a Zipf-weighted lexicon of made-up words, compact JSON and Python."""
    rng = random.Random(seed)
    onsets = ("b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr bl cl fl gl pl sl sh ch th st sp sk sm "
              "sn qu wh").split()
    vowels = "a e i o u ai ea ee oo ou ie io y".split()
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "rd", "ng", "ck", "sh", "ch", "th", "x", "rk", "lt"]
    lexicon = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                       for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))) for _ in range(200_000)]
    # Precomputed cumulative weights: random.choices with plain weights re-sums them every call.
    cumulative = list(itertools.accumulate(1 / (rank + 10) for rank in range(len(lexicon))))
    lines = []
    for _ in range(60_000):
        w = rng.choices(lexicon, cum_weights=cumulative, k=12)
        kind = rng.random()
        if kind < 0.5:
            lines.append(" ".join(w).capitalize() + ".")
        elif kind < 0.75:
            record = {w[0]: w[1], w[2]: rng.randint(0, 99_999), w[3]: [w[4], w[5]], w[6]: rng.random() < 0.5,
                      w[7]: round(rng.uniform(0, 1000), 2)}
            lines.append(json.dumps(record, separators=(",", ":")))
        else:
            lines.append(f"def {w[0]}_{w[1]}({w[2]}, {w[3]}=None):\n    {w[4]} = self.{w[5]}({w[2]}) + "
                         f"{rng.randint(0, 999)}\n    return {w[4]}")
    return lines


def train_bpe(vocab_size: int, seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(synthetic_corpus(seed), trainer)
    return tokenizer


def bpe_vocab(path: str | None, vocab_size: int, seed: int, eos_name: str | None) -> Vocab:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("grammar_engines.py needs tokenizers for the bpe vocabulary: "
                         "pip install -e .[serve]") from None
    start = time.perf_counter()
    if path:
        tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json" if Path(path).is_dir() else path))
        source = f"tokenizer.json from {path}"
    else:
        progress(f"training a {vocab_size}-token byte-level BPE on a generated corpus (no tokenizer.json given)")
        tokenizer = train_bpe(vocab_size, seed)
        source = f"byte-level BPE trained here (seed {seed}) on generated English-like words, compact JSON, Python"
    spec = json.loads(tokenizer.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder")) or "ByteLevel" in json.dumps(spec.get("pre_tokenizer"))
    pieces = tokenizer.get_vocab(with_added_tokens=True)
    size = max(pieces.values()) + 1
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    special |= set(range(size)) - set(pieces.values())  # holes in the id space: never text
    byte_map = byte_level_decoder()
    tokens = [b""] * size
    for piece, token in pieces.items():
        tokens[token] = piece.encode() if token in special else piece_bytes(piece, byte_level, byte_map)
    names = {piece: token for piece, token in pieces.items() if token in special}
    eos_candidates = [eos_name] if eos_name else [n for n in EOS_NAMES if n in names]
    if not eos_candidates or eos_candidates[0] not in names:
        raise SystemExit(f"no stop token found among the special tokens of {path}: name one with --eos-token")
    bos = next((names[n] for n in ("<|begin_of_text|>", "<s>", "<bos>") if n in names), None)
    return Vocab("bpe", f"{source}; {size} tokens", tokens, special, names[eos_candidates[0]], bos, tokenizer.to_str(),
                 build_s=time.perf_counter() - start)


# --- the two libraries behind one interface --------------------------------------------------------

class LLGuidanceEngine:
    """llguidance as tandem drives it: one ``LLMatcher`` template per spec, ``deep_copy()`` per request,
    masks of the whole batch in one ``LLExecutor`` call."""

    name = "llguidance"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import llguidance
        import llguidance.torch

        self.lib, self.lib_torch = llguidance, llguidance.torch
        start = time.perf_counter()
        if vocab.tokenizer_json is not None:
            self.tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.size, eos_token=vocab.eos_id)
        else:
            self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_WrapperSource(vocab)))
        self.executor = llguidance.LLExecutor(threads)
        self.setup_s = time.perf_counter() - start
        self.fill_api = "LLExecutor + llguidance.torch.fill_next_token_bitmask_par"
        self.fill_each_api = "llguidance.torch.fill_next_token_bitmask"
        self.advance_api = ("LLExecutor.consume_token_par" if hasattr(self.executor, "consume_token_par")
                            else "LLMatcher.consume_token per row (no consume_token_par)")
        self.advance_each_api = "LLMatcher.consume_token"

    def grammar(self, kind: str, spec: Any) -> str:
        matcher = self.lib.LLMatcher
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        if kind == "regex":
            return matcher.grammar_from_regex(spec)
        if kind == "lark":
            return matcher.grammar_from_lark(spec)
        if kind == "gbnf":
            return self.lib.grammar_from("gbnf", spec)
        raise ValueError(kind)

    def compile(self, kind: str, spec: Any) -> LLTemplate:
        try:
            grammar = self.grammar(kind, spec)
        except ValueError as error:
            raise CompileError(first_line(error)) from None
        return self.matcher_from(grammar)

    def matcher_from(self, grammar: str) -> LLTemplate:
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():  # the constructor never raises for a bad grammar: it leaves an error state
            raise CompileError(first_line(matcher.get_error()))
        return LLTemplate(matcher, grammar)

    def clear_cache(self) -> None:
        """Nothing to clear: llguidance caches no compiled grammar between matchers."""

    def compile_again(self, kind: str, spec: Any, compiled: LLTemplate) -> LLTemplate:
        return self.matcher_from(compiled.grammar)

    def new_matcher(self, compiled: LLTemplate) -> Any:
        return compiled.matcher.deep_copy()

    def prime(self, compiled: LLTemplate, bitmask: Any) -> None:
        """Compute the template's own first mask: copies made after it start from that work."""
        self.fill([compiled.matcher], [0], bitmask)

    def fill(self, matchers: Sequence[Any], rows: Sequence[int], bitmask: Any) -> None:
        self.lib_torch.fill_next_token_bitmask_par(self.executor, list(zip(matchers, rows)), bitmask)

    def fill_each(self, matchers: Sequence[Any], rows: Sequence[int], bitmask: Any) -> None:
        for matcher, row in zip(matchers, rows):
            self.lib_torch.fill_next_token_bitmask(matcher, bitmask, row)

    def advance(self, matchers: Sequence[Any], tokens: Sequence[int], batched: bool = True) -> None:
        if batched and hasattr(self.executor, "consume_token_par"):
            accepted = self.executor.consume_token_par(list(zip(matchers, tokens)))
        else:
            accepted = [m.consume_token(t) for m, t in zip(matchers, tokens)]
        if not all(accepted):
            bad = accepted.index(False)
            raise RuntimeError(f"llguidance refused an allowed token: {matchers[bad].get_error()}")

    def accepts(self, compiled: LLTemplate, tokens: Sequence[int], eos: int) -> bool:
        matcher = self.new_matcher(compiled)
        return all(matcher.consume_token(t) for t in tokens) and matcher.consume_token(eos)


class LLGuidanceNewEngine(LLGuidanceEngine):
    """llguidance with a new ``LLMatcher`` per request instead of a ``deep_copy()`` of the template:
    copies share state with their template, matchers built apart share nothing, and the two scale
    differently with the executor's threads."""

    name = "llguidance/new"

    def __init__(self, base: LLGuidanceEngine) -> None:  # the same tokenizer and executor as ``base``
        self.__dict__.update(base.__dict__)

    def new_matcher(self, compiled: LLTemplate) -> Any:
        return self.matcher_from(compiled.grammar).matcher


@dataclass
class LLTemplate:
    """A compiled llguidance spec: the matcher each request copies, and the grammar text it came from."""

    matcher: Any
    grammar: str


@dataclass
class _WrapperSource:
    """What ``llguidance.TokenizerWrapper`` reads: a tokenizer's ids, bytes and special tokens."""

    vocab: Vocab

    @property
    def eos_token_id(self) -> int:
        return self.vocab.eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def tokens(self) -> list[bytes]:
        return self.vocab.token_bytes

    @property
    def special_token_ids(self) -> list[int]:
        return sorted(self.vocab.special_ids)

    def __call__(self, text: bytes) -> list[int]:
        return list(text)  # only the byte vocabulary comes here


class XGrammarEngine:
    """xgrammar as vLLM and SGLang drive it: a ``GrammarCompiler`` with its cache, one
    ``GrammarMatcher`` per request, masks of the whole batch through ``BatchGrammarMatcher``."""

    name = "xgrammar"

    def __init__(self, vocab: Vocab, threads: int) -> None:
        import xgrammar

        self.lib = xgrammar
        # Special tokens as empty strings: xgrammar takes a non-empty entry for text it may emit.
        encoded = [b"" if i in vocab.special_ids else b for i, b in enumerate(vocab.token_bytes)]
        start = time.perf_counter()
        self.info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.RAW, vocab_size=vocab.size,
                                           stop_token_ids=[vocab.eos_id])
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=threads, cache_enabled=True)
        self.setup_s = time.perf_counter() - start
        batch = getattr(xgrammar, "BatchGrammarMatcher", None)
        self.batch = batch(max_threads=threads) if hasattr(batch, "batch_fill_next_token_bitmask") else None
        self.batch_accept = getattr(batch, "batch_accept_token", None)
        self.fill_api = ("BatchGrammarMatcher.batch_fill_next_token_bitmask" if self.batch is not None
                         else "GrammarMatcher.fill_next_token_bitmask per row (no BatchGrammarMatcher)")
        self.fill_each_api = "GrammarMatcher.fill_next_token_bitmask"
        self.advance_api = ("BatchGrammarMatcher.batch_accept_token" if self.batch_accept is not None
                            else "GrammarMatcher.accept_token per row (no BatchGrammarMatcher)")
        self.advance_each_api = "GrammarMatcher.accept_token"

    def compile(self, kind: str, spec: Any) -> Any:
        compiler = self.compiler
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "lark":
                if not hasattr(compiler, "compile_lark"):
                    raise CompileError("no Lark front end in this xgrammar")
                return compiler.compile_lark(spec)
            if kind == "gbnf":
                return compiler.compile_grammar(spec)
        except CompileError:
            raise
        except Exception as error:  # each front end raises its own types (RuntimeError, ValueError, ...)
            raise CompileError(first_line(error)) from None
        raise ValueError(kind)

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def compile_again(self, kind: str, spec: Any, compiled: Any) -> Any:
        return self.compile(kind, spec)

    def new_matcher(self, compiled: Any) -> Any:
        return self.lib.GrammarMatcher(compiled)

    def prime(self, compiled: Any, bitmask: Any) -> None:
        """Nothing to do: every matcher starts from the compiled grammar's precomputed masks."""

    def fill(self, matchers: Sequence[Any], rows: Sequence[int], bitmask: Any) -> None:
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(rows))
        else:
            self.fill_each(matchers, rows, bitmask)

    def fill_each(self, matchers: Sequence[Any], rows: Sequence[int], bitmask: Any) -> None:
        for matcher, row in zip(matchers, rows):
            matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, matchers: Sequence[Any], tokens: Sequence[int], batched: bool = True) -> None:
        if batched and self.batch_accept is not None:
            accepted = self.batch_accept(list(matchers), list(tokens))
        else:
            accepted = [m.accept_token(t) for m, t in zip(matchers, tokens)]
        if not all(accepted):
            raise RuntimeError("xgrammar refused an allowed token")

    def accepts(self, compiled: Any, tokens: Sequence[int], eos: int) -> bool:
        matcher = self.new_matcher(compiled)
        return all(matcher.accept_token(t) for t in tokens) and matcher.accept_token(eos)


Engine = LLGuidanceEngine | LLGuidanceNewEngine | XGrammarEngine


def new_bitmask(rows: int, vocab: Vocab) -> Any:
    import torch

    return torch.full((rows, (vocab.size + 31) // 32), -1, dtype=torch.int32)


# --- compile ---------------------------------------------------------------------------------------

def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter_ns()
    result = call()
    return (time.perf_counter_ns() - start) / 1e6, result


def compile_figures(engine: Engine, vocab: Vocab, kind: str, spec: Any, repeats: int) -> dict[str, Any]:
    """Milliseconds (medians over ``repeats``) to compile ``spec`` cold and through the cache, to make a
    per-request matcher, and each one's first mask."""
    bitmask = new_bitmask(1, vocab)

    def first_mask(matcher: Any) -> float:
        return timed(lambda: engine.fill([matcher], [0], bitmask))[0]

    cold, cold_first = [], []
    compiled = None
    try:
        for _ in range(repeats):
            engine.clear_cache()
            ms, compiled = timed(lambda: engine.compile(kind, spec))
            cold.append(ms)
            cold_first.append(first_mask(engine.new_matcher(compiled)))
        again = [timed(lambda: engine.compile_again(kind, spec, compiled))[0] for _ in range(repeats)]
    except CompileError as error:
        return {"error": str(error)}
    per_request, per_request_first = [], []
    for _ in range(max(repeats, 10)):
        ms, matcher = timed(lambda: engine.new_matcher(compiled))
        per_request.append(ms)
        per_request_first.append(first_mask(matcher))
    engine.prime(compiled, bitmask)
    primed_first = [first_mask(engine.new_matcher(compiled)) for _ in range(max(repeats, 10))]
    med = statistics.median
    return {"cold_ms": med(cold), "cold_first_mask_ms": med(cold_first), "again_ms": med(again),
            "per_request_ms": med(per_request), "per_request_first_mask_ms": med(per_request_first),
            "primed_first_mask_ms": med(primed_first)}


# --- mask per token --------------------------------------------------------------------------------

def choose(allowed: np.ndarray, vocab: Vocab, run: int, rng: np.random.Generator) -> int:
    """One allowed token at random: printable where any is; with a chance growing with ``run`` (bytes
    since the last quote) one that can close the value, so documents stay short and end; half the time
    the longest such token."""
    candidates = allowed & vocab.plain
    if not candidates.any():
        candidates = allowed
    if rng.random() < min(0.9, run / 16):
        # Half the time a token with a quote: inside a string, the other closers are just text.
        closing = candidates & (vocab.quote if rng.random() < 0.5 else vocab.closer)
        if closing.any():
            candidates = closing
    ids = np.flatnonzero(candidates)
    if not len(ids):
        raise RuntimeError("a matcher allows no token at all")
    if rng.random() < 0.5:
        # Half the time the longest allowed token: text a model writes comes mostly in whole words, and
        # uniform picks would spell forced keys and enums one character at a time.
        lengths = vocab.lengths[ids]
        ids = ids[lengths == lengths.max()]
    return int(ids[rng.integers(len(ids))])


def check_document(text: bytes, validator: Any) -> str | None:
    """None when ``text`` is JSON valid for :data:`SCHEMA`, else why not."""
    try:
        value = json.loads(text)
    except ValueError as error:
        return f"not JSON: {first_line(error)}"
    if validator is not None:
        error = next(iter(validator.iter_errors(value)), None)
        if error is not None:
            return f"schema: {first_line(error.message)}"
    return None


def schema_validator() -> Any:
    try:
        import jsonschema
    except ImportError:
        return None  # documents are still parsed as JSON
    return jsonschema.Draft202012Validator(SCHEMA)


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def drive(engine: Engine, template: Any, vocab: Vocab, batch: int, steps: int, warmup: int,
          seed: int, validator: Any) -> dict[str, Any]:
    """``batch`` rows generating documents for ``template``'s schema; the last ``steps`` steps timed.

    Timed steps alternate between the batch APIs and per-row calls, for the fill and the advance
    alike: a second fill of the same state would find the first one's work cached."""
    rng = np.random.default_rng(seed)
    matchers = [engine.new_matcher(template) for _ in range(batch)]
    joins = rng.integers(0, warmup, batch) if warmup else np.zeros(batch, dtype=np.int64)
    texts = [bytearray() for _ in range(batch)]
    runs, counts = [0] * batch, [0] * batch
    bitmask = new_bitmask(batch, vocab)
    path = hashlib.sha256()
    times: dict[str, list[float]] = {"fill": [], "fill_each": [], "advance": [], "advance_each": []}
    lengths, invalid, samples = [], [], []

    for step in range(warmup + steps):
        timing = step >= warmup
        rows = list(range(batch)) if timing else [i for i in range(batch) if joins[i] <= step]
        if not rows:
            continue
        active = [matchers[i] for i in rows]
        batched = not timing or step % 2 == 0
        fill = engine.fill if batched else engine.fill_each
        start = time.perf_counter_ns()
        fill(active, rows, bitmask)
        if timing:
            times["fill" if batched else "fill_each"].append((time.perf_counter_ns() - start) / 1e3)
        allowed = unpack(bitmask, vocab)
        tokens = [choose(allowed[i], vocab, runs[i], rng) for i in rows]
        path.update(np.asarray(tokens, dtype=np.int32).tobytes())
        start = time.perf_counter_ns()
        engine.advance(active, tokens, batched)
        if timing:
            times["advance" if batched else "advance_each"].append((time.perf_counter_ns() - start) / 1e3)
        for i, token in zip(rows, tokens):
            counts[i] += 1
            if token == vocab.eos_id:
                lengths.append(counts[i])
                why = check_document(texts[i], validator)
                if why:
                    invalid.append({"document": texts[i].decode(errors="replace")[:400], "why": why})
                if len(samples) < 2:
                    samples.append(texts[i].decode(errors="replace"))
                texts[i], runs[i], counts[i] = bytearray(), 0, 0
                matchers[i] = engine.new_matcher(template)  # the next request in this slot
                continue
            piece = vocab.text_of(token)
            texts[i] += piece
            # Counted from the last quote: a string's own length, or what follows one (a number, a literal).
            quote = piece.rfind(b'"')
            runs[i] = len(piece) - 1 - quote if quote >= 0 else runs[i] + len(piece)
    figures: dict[str, Any] = {}
    for name, values in times.items():
        figures[f"{name}_median_us"] = statistics.median(values) if values else None
        figures[f"{name}_p90_us"] = percentile(values, 90) if values else None
        figures[f"{name}_per_row_us"] = statistics.median(values) / batch if values else None
    return {
        "library": engine.name, "vocab": vocab.name, "batch": batch, "steps": steps, "warmup_steps": warmup,
        "fill_api": engine.fill_api, "fill_each_api": engine.fill_each_api,
        "advance_api": engine.advance_api, "advance_each_api": engine.advance_each_api, **figures,
        "documents": len(lengths), "valid_documents": len(lengths) - len(invalid),
        "validated_with": "jsonschema" if validator is not None else "json.loads only",
        "tokens_per_document": statistics.median(lengths) if lengths else None,
        "invalid": invalid[:3], "sample_documents": samples, "path_sha256": path.hexdigest(),
    }


def unpack(bitmask: Any, vocab: Vocab) -> np.ndarray:
    """A ``[rows, vocab]`` bool array from a bitmask of 32 tokens an int32, lowest bit first."""
    return np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab.size] != 0


def shown(tokens: np.ndarray, vocab: Vocab, most: int = 6) -> str:
    pieces = [repr(vocab.token_bytes[t])[1:] for t in tokens[:most]]
    return " ".join(pieces) + (f" (+{len(tokens) - most})" if len(tokens) > most else "")


def category(token: bytes) -> str:
    """A coarse kind of token, so that the agreement examples show different kinds of disagreement."""
    if not token or not all(0x20 <= c < 0x7F for c in token):
        return "other"
    return "digits" if token.isdigit() else "letters" if token.isalpha() else "punctuation"


def agreement(engines: Sequence[Engine], vocab: Vocab, documents: int, seed: int) -> dict[str, Any]:
    """The two libraries fed the same tokens (drawn among those both allow), one document after another:
    at how many steps their masks differ, and a few examples of how."""
    templates = [engine.compile("json_schema", SCHEMA) for engine in engines]
    masks = [new_bitmask(1, vocab) for _ in engines]
    rng = np.random.default_rng(seed)
    names = [engine.name for engine in engines]
    steps = differ = 0
    only = dict.fromkeys(names, 0)
    examples: list[dict[str, str]] = []
    kinds: set[tuple[str, ...]] = set()
    for _ in range(documents):
        matchers = [engine.new_matcher(template) for engine, template in zip(engines, templates)]
        text, run = bytearray(), 0
        for _ in range(8192):  # a bound, never reached by the chooser's documents
            for engine, matcher, mask in zip(engines, matchers, masks):
                engine.fill_each([matcher], [0], mask)
            first, second = (unpack(mask, vocab)[0] for mask in masks)
            steps += 1
            if (first != second).any():
                differ += 1
                extra = {names[0]: np.flatnonzero(first & ~second), names[1]: np.flatnonzero(second & ~first)}
                for name, tokens in extra.items():
                    only[name] += bool(len(tokens))
                kind = tuple(category(vocab.token_bytes[tokens[0]]) if len(tokens) else "" for tokens in extra.values())
                if kind not in kinds and len(examples) < 6:
                    kinds.add(kind)
                    examples.append({"after": text[-48:].decode(errors="replace"),
                                     **{f"only_{name}": shown(tokens, vocab) for name, tokens in extra.items()}})
            token = choose(first & second, vocab, run, rng)
            for engine, matcher in zip(engines, matchers):
                engine.advance([matcher], [token], batched=False)
            if token == vocab.eos_id:
                break
            piece = vocab.text_of(token)
            text += piece
            quote = piece.rfind(b'"')
            run = len(piece) - 1 - quote if quote >= 0 else run + len(piece)
    return {"vocab": vocab.name, "documents": documents, "steps": steps, "steps_differing": differ,
            **{f"steps_only_{name}_allows": count for name, count in only.items()}, "examples": examples}


# --- support ---------------------------------------------------------------------------------------

def probe(engine: Engine, vocab: Vocab, kind: str, spec: Any, valid: str, invalid: list[str]) -> str:
    try:
        compiled = engine.compile(kind, spec)
    except CompileError as error:
        return f"error: {error}"
    except Exception as error:  # a front end that raises outside its documented errors still gets a row
        return f"error: {first_line(error)}"
    encode = vocab_encoder(vocab)
    if not engine.accepts(compiled, encode(valid), vocab.eos_id):
        return f"rejects valid {valid}"
    let_through = [text for text in invalid if engine.accepts(compiled, encode(text), vocab.eos_id)]
    return f"not enforced: accepts {', '.join(let_through)}" if let_through else "ok"


def vocab_encoder(vocab: Vocab) -> Callable[[str], list[int]]:
    if vocab.name != "byte":
        raise ValueError("probes feed text byte by byte: byte vocabulary only")
    return lambda text: list(text.encode())


def support_table(engines: dict[str, Engine], vocab: Vocab) -> list[dict[str, str]]:
    rows = []
    for feature, kind, spec, valid, invalid in PROBES:
        row = {"feature": feature, "kind": kind}
        for name, engine in engines.items():
            row[name] = probe(engine, vocab, kind, spec, valid, invalid)
        rows.append(row)
    return rows


# --- output ----------------------------------------------------------------------------------------

def table(head: list[str], body: list[list[str]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first ``left`` columns left-aligned, the rest right."""
    widths = [max(len(cell) for cell in column) for column in zip(head, *body)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def fmt(value: float | None, digits: int = 2) -> str:
    """``digits`` decimals, more below 1 so that small figures keep two significant ones."""
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value:,.0f}"
    if 0 < value < 1:
        digits = max(digits, min(6, 1 - int(np.floor(np.log10(value)))))
    return f"{value:.{digits}f}"


def report(result: dict[str, Any]) -> str:
    out = []
    versions = result["versions"]
    xgr = versions["xgrammar"] or result["xgrammar"]
    out.append(f"grammar engines: llguidance {versions['llguidance']}, xgrammar {xgr}; threads {result['threads']}, "
               f"{result['machine']['cpus']} CPUs, Python {versions['python']}, torch {versions['torch']}")
    if versions["xgrammar"] is None:
        out.append(f"xgrammar: {result['xgrammar']} (only llguidance measured)")
    for name, vocab in result["vocabularies"].items():
        built = f", built in {vocab['build_s']:.1f} s" if vocab["build_s"] >= 0.05 else ""
        out.append(f"vocabulary {name}: {vocab['source']}{built}")
    for entry in result["tokenizer_setup"]:
        out.append(f"tokenizer setup, {entry['vocab']}, {entry['library']}: {fmt(entry['ms'])} ms")

    out.append("\ncompile (ms, medians): cold = nothing cached; again = the same spec through the library's cache;\n"
               "per request = deep_copy of the template / GrammarMatcher; primed 1st = a request's first mask once "
               "the template has computed its own")
    body = []
    for row in result["compile"]:
        if "error" in row:
            body.append([row["vocab"], row["library"], row["spec"], f"error: {row['error']}", *["-"] * 6])
            continue
        body.append([row["vocab"], row["library"], row["spec"], fmt(row["cold_ms"]), fmt(row["cold_first_mask_ms"]),
                     fmt(row["cold_ms"] + row["cold_first_mask_ms"]), fmt(row["again_ms"]),
                     fmt(row["per_request_ms"], 3), fmt(row["per_request_first_mask_ms"], 3),
                     fmt(row["primed_first_mask_ms"], 3)])
    out.append(table(["vocab", "library", "spec", "cold", "1st mask", "cold+1st", "again", "per request",
                      "its 1st mask", "primed 1st"], body, left=3))

    out.append("\nmask per step (µs, median; p90 of the batch fill): fill = the bitmasks of all B rows, "
               "advance = one token into each row;\nbatch = the library's batch call, rows = one call per row "
               "(alternate timed steps)")
    body = []
    for row in result["mask"]:
        same = row.get("same_path")  # against the first library measured at this batch
        body.append([row["vocab"], row["library"], str(row["batch"]),
                     fmt(row["fill_median_us"], 1), fmt(row["fill_p90_us"], 1), fmt(row["fill_per_row_us"], 2),
                     fmt(row["fill_each_median_us"], 1), fmt(row["fill_each_per_row_us"], 2),
                     fmt(row["advance_median_us"], 1), fmt(row["advance_per_row_us"], 2),
                     fmt(row["advance_each_median_us"], 1), fmt(row["advance_each_per_row_us"], 2),
                     fmt(row["tokens_per_document"], 0), f"{row['valid_documents']}/{row['documents']}",
                     "-" if same is None else ("yes" if same else "no")])
    out.append(table(["vocab", "library", "B", "fill batch", "p90", "/row", "fill rows", "/row", "adv batch", "/row",
                      "adv rows", "/row", "tok/doc", "valid", "same path"], body, left=2))
    apis = sorted({(row["library"], row["fill_api"], row["fill_each_api"], row["advance_api"], row["advance_each_api"])
                   for row in result["mask"] if row["library"] != LLGuidanceNewEngine.name})
    if any(row["library"] == LLGuidanceNewEngine.name for row in result["mask"]):
        out.append(f"  {LLGuidanceNewEngine.name}: the llguidance calls, with a new LLMatcher per request instead of "
                   "a deep_copy() of the template")
    for library, fill_api, fill_each_api, advance_api, advance_each_api in apis:
        out.append(f"  {library} fill: batch {fill_api}; rows {fill_each_api}")
        out.append(f"  {' ' * len(library)} advance: batch {advance_api}; rows {advance_each_api}")
    for row in result["mask"]:
        for bad in row["invalid"]:
            out.append(f"  invalid document ({row['library']}, {row['vocab']}, B={row['batch']}): {bad['why']}: "
                       f"{bad['document'][:120]}")

    for entry in result["agreement"]:
        a, b = result["libraries"][:2]
        out.append(f"\nmask agreement, {entry['vocab']} vocabulary (both fed the same tokens, {entry['documents']} "
                   f"documents, {entry['steps']} steps): masks differ at {entry['steps_differing']} steps; "
                   f"{a} allows a token {b} refuses at {entry[f'steps_only_{a}_allows']}, the reverse at "
                   f"{entry[f'steps_only_{b}_allows']}")
        for example in entry["examples"]:
            out.append(f"  after {example['after']!r}: only {a} allows [{example[f'only_{a}']}], "
                       f"only {b} [{example[f'only_{b}']}]")

    out.append("\nsupport (byte vocabulary; ok = accepts a valid text and rejects the invalid ones)")
    names = list(result["libraries"])
    out.append(table(["feature", *names], [[row["feature"], *[row[n] for n in names]] for row in result["support"]],
                     left=1 + len(names)))
    return "\n".join(out)


# --- main ------------------------------------------------------------------------------------------

def default_threads() -> int:
    # llguidance's own default for its executor (most of the cores, at most 32), given to both libraries.
    return max(1, min(32, (os.cpu_count() or 1) * 4 // 5))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256], help="batch sizes of the mask figures")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per batch size (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=100,
                        help="untimed steps first; rows join at random ones, so each is at its own position")
    parser.add_argument("--vocab", nargs="+", choices=("byte", "bpe"), default=["byte", "bpe"],
                        help="vocabularies to measure (the support probes always use byte)")
    parser.add_argument("--tokenizer", help="a tokenizer.json (or its folder) for the bpe vocabulary "
                                            "(default: train a byte-level BPE here)")
    parser.add_argument("--eos-token", help="the stop token's name in --tokenizer (default: a usual one found there)")
    parser.add_argument("--bpe-size", type=int, default=128_000, help="vocabulary size of the trained BPE")
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="mask and compile threads, the same for both libraries (default: %(default)s here)")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per figure; medians are reported")
    parser.add_argument("--agree-documents", type=int, default=20,
                        help="documents fed to both libraries in lockstep to compare their masks (0: skip)")
    parser.add_argument("--seed", type=int, default=0, help="token choices and the trained BPE's corpus")
    parser.add_argument("--no-xgrammar", action="store_true", help="measure llguidance only")
    parser.add_argument("--llguidance-per-request", choices=("copy", "new", "both"), default="both",
                        help="mask figures with a deep_copy() of the template per request (what tandem does), "
                             "a new LLMatcher per request (llguidance/new), or both")
    parser.add_argument("--json", metavar="PATH", help="also write every figure here as JSON")
    return parser.parse_args(argv)


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import llguidance  # noqa: F401
        import llguidance.torch  # noqa: F401
    except ImportError as error:
        raise SystemExit(f"grammar_engines.py needs llguidance (and torch): pip install -e .[serve] "
                         f"({first_line(error)})") from None
    if args.no_xgrammar:
        xgrammar_status = "left out (--no-xgrammar)"
    else:
        xgrammar_status = "measured" if xgrammar_available() else "not installed"
    has_xgrammar = xgrammar_status == "measured"
    classes: list[type[LLGuidanceEngine] | type[XGrammarEngine]] = [LLGuidanceEngine]
    if has_xgrammar:
        classes.append(XGrammarEngine)
    else:
        progress(f"xgrammar: {xgrammar_status}")
    import torch

    result: dict[str, Any] = {
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "llguidance": version_of("llguidance"),
                     "xgrammar": version_of("xgrammar") if has_xgrammar else None},
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "threads": args.threads, "xgrammar": xgrammar_status,
        "libraries": [c.name for c in classes] + ([] if has_xgrammar else ["xgrammar"]),
        "schema": SCHEMA, "vocabularies": {}, "tokenizer_setup": [], "compile": [], "mask": [], "agreement": [],
        "support": [],
    }
    validator = schema_validator()
    byte = byte_vocab()
    vocabs = {"byte": byte}
    if "bpe" in args.vocab:
        vocabs["bpe"] = bpe_vocab(args.tokenizer, args.bpe_size, args.seed, args.eos_token)
    for name, vocab in vocabs.items():
        result["vocabularies"][name] = {"source": vocab.source, "size": vocab.size, "eos_id": vocab.eos_id,
                                        "build_s": round(vocab.build_s, 2)}

    byte_engines: dict[str, Engine] = {}
    for name in args.vocab:
        vocab = vocabs[name]
        engines: list[Engine] = []
        for cls in classes:
            progress(f"{cls.name}, {name} vocabulary ({vocab.size} tokens): tokenizer and compiles")
            engine = cls(vocab, args.threads)
            engines.append(engine)
            result["tokenizer_setup"].append({"vocab": name, "library": cls.name, "ms": engine.setup_s * 1e3})
            # One untimed compile first, so the figures leave out the library's one-time start-up.
            engine.compile("json_schema", {"type": "string"})
            grammar_kind, grammar = ("lark", LARK) if cls is LLGuidanceEngine else ("gbnf", EBNF)
            for spec_name, kind, spec in (("json schema", "json_schema", SCHEMA), ("regex", "regex", REGEX),
                                          (f"grammar ({grammar_kind})", grammar_kind, grammar)):
                figures = compile_figures(engine, vocab, kind, spec, args.repeats)
                result["compile"].append({"vocab": name, "library": cls.name, "spec": spec_name, **figures})
        if name == "byte":
            byte_engines = {engine.name: engine for engine in engines}
        if len(engines) == 2 and args.agree_documents:
            progress(f"mask agreement, {name} vocabulary: {args.agree_documents} documents in lockstep")
            result["agreement"].append(agreement(engines, vocab, args.agree_documents, args.seed))
        mask_engines = list(engines)
        if args.llguidance_per_request != "copy":
            mask_engines.insert(1, LLGuidanceNewEngine(engines[0]))
        if args.llguidance_per_request == "new":
            mask_engines.pop(0)
        for batch in args.batch:
            paths = {}
            for engine in mask_engines:
                progress(f"{engine.name}, {name} vocabulary: batch {batch}, {args.warmup} + {args.steps} steps")
                template = engine.compile("json_schema", SCHEMA)
                row = drive(engine, template, vocab, batch, args.steps, args.warmup, args.seed, validator)
                paths[engine.name] = row["path_sha256"]
                first = mask_engines[0].name
                if engine.name != first:
                    row["same_path_as"] = first
                    row["same_path"] = row["path_sha256"] == paths[first]
                result["mask"].append(row)

    progress("support probes (byte vocabulary)")
    if not byte_engines:
        byte_engines = {cls.name: cls(byte, args.threads) for cls in classes}
    probe_engines: dict[str, Engine] = dict(byte_engines)
    result["support"] = support_table(probe_engines, byte)
    if not has_xgrammar:
        for row in result["support"]:
            row["xgrammar"] = xgrammar_status
    return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    print(report(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        progress(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
