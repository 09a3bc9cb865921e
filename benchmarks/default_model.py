"""How good is a served model as a code model: the figures the default model is chosen and judged by.

For each model spec given (``tiny``, ``coder``, a checkpoint directory), measured the same way:

- **heads**: greedy completions (up to ``--max-new-tokens``) of the function heads in
  :data:`HEADS`, cut where the function ends (the first line indented no deeper than the head);
  a head passes when head + completion parses as Python and its body holds a statement other than
  a docstring, ``pass`` or ``...``.
- **bits per byte** on held-out Python source: files of packages tandem depends on (none of them in
  the standard library, the trainer's data), scored in windows of the model's training context;
  the summed negative log-likelihood of every token after a window's first, in bits, over the bytes
  those tokens cover.
- **CPU decode tokens/s**: one greedy request of ``--decode-tokens`` through the serving engine on
  this machine's CPU, with ``--threads`` torch threads (2: the CI machine's cores).
- **size**: the weights' bytes on disk.

    python benchmarks/default_model.py tiny coder
    python benchmarks/default_model.py /tmp/run/coder-m --device cuda --skip-decode --json out.json

Prints one table row per model and each head's completion with ``--show``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tandem.shared.model.loader import LoadedModel, load_model
from tandem.shared.model.meta import load_model_meta
from tandem.shared.model.reference import reference_generate

# Files of tandem's own dependencies: Python outside the standard library, present wherever tandem
# is installed; their versions are printed with the figures.
HELDOUT_FILES = (
    ("jinja2", "lexer.py"), ("jinja2", "utils.py"),
    ("click", "termui.py"),
    ("rich", "text.py"), ("rich", "table.py"),
    ("httpx", "_models.py"), ("httpx", "_urls.py"),
    ("msgpack", "fallback.py"),
)
# Distribution names where they differ from the import name.
_DISTRIBUTIONS = {"msgpack": "msgpack"}

# Written for this benchmark: common small functions, named and typed the way people write them.
HEADS = (
    "def factorial(n):",
    "def fibonacci(n):",
    "def reverse_string(s):",
    "def count_words(text):",
    "def read_lines(path):",
    "def flatten(items):",
    "def merge_dicts(a, b):",
    "def gcd(a, b):",
    "def mean(values):",
    "def clamp(value, low, high):",
    "def chunks(seq, size):",
    "def unique(items):",
    "def is_palindrome(text):",
    "def to_snake_case(name):",
    "def binary_search(items, target):",
    "def read_json(path):",
    "def file_size(path):",
    "def max_index(values):",
    "def strip_comments(line):",
    "def histogram(data):",
    "def parse_int(value, default=0):",
    "def quote(s):",
    "def transpose(matrix):",
    "def dedupe_lines(lines):",
)


@dataclass
class Figures:
    model: str
    parameters: int
    size_bytes: int
    heads_passed: int
    heads_total: int
    bits_per_byte: float
    heldout_bytes: int
    window: int
    decode_tokens_per_s: float | None
    threads: int | None


def heldout_texts() -> tuple[list[str], dict[str, str]]:
    """The held-out files' texts and the versions of the packages they come from."""
    texts, versions = [], {}
    for package, name in HELDOUT_FILES:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise SystemExit(f"held-out package {package!r} is not installed; install tandem's extras first")
        texts.append((Path(spec.origin).parent / name).read_text(encoding="utf-8"))
        versions[package] = importlib.metadata.version(_DISTRIBUTIONS.get(package, package))
    return texts, versions


def training_context(loaded: LoadedModel) -> int:
    """Tokens per window: the length the model was trained at (the byte-level tiny model's default
    job trains 256-byte windows; others train at their max_position_embeddings)."""
    if loaded.config.byte_tokenizer:
        from tandem.cli.train import DEFAULT_JOB

        return int(DEFAULT_JOB["seq_len"])
    return loaded.config.max_position_embeddings


@torch.no_grad()
def bits_per_byte(loaded: LoadedModel, texts: list[str], window: int) -> tuple[float, int]:
    """(bits per byte, bytes scored) over ``texts`` in non-overlapping windows of ``window`` tokens;
    each window's first token is context only, and its bytes are not counted."""
    tokenizer, model = loaded.tokenizer, loaded.model
    device = model.model.embed_tokens.weight.device
    nll_bits, scored_bytes = 0.0, 0
    for text in texts:
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - 1, window):
            piece = ids[start:start + window]
            if len(piece) < 2:
                continue
            logits = model_logits(model, piece, device)
            targets = torch.tensor(piece[1:], device=device)
            nll = F.cross_entropy(logits[:-1].float(), targets, reduction="sum")
            nll_bits += float(nll) / math.log(2)
            scored_bytes += len(tokenizer.decode(piece[1:]).encode("utf-8"))
    return nll_bits / scored_bytes, scored_bytes


def model_logits(model, ids: list[int], device: torch.device) -> torch.Tensor:  # noqa: ANN001
    from tandem.shared.model.reference import reference_logits

    return reference_logits(model, torch.tensor(ids, device=device))


def function_text(head: str, completion: str) -> str:
    """The head and its completion up to where the function ends: the first non-blank line
    indented no deeper than the head; a completion cut off by the token limit loses its last,
    possibly partial, line."""
    lines = completion.split("\n")
    body, ended = [lines[0]], False
    for line in lines[1:]:
        if line.strip() and not line[:1].isspace():
            ended = True
            break
        body.append(line)
    if not ended and len(body) > 1:
        body = body[:-1]
    return head + "\n".join(body)


def has_real_body(source: str) -> bool:
    """``source`` parses and its first function or class has a statement beyond a docstring/pass/...."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    if not defs:
        return False
    for stmt in defs[0].body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring or a bare ...
        return True
    return False


def complete_heads(loaded: LoadedModel, heads: tuple[str, ...], max_new_tokens: int) -> list[tuple[str, str, bool]]:
    """(head, function text, passed) per head, greedy."""
    results = []
    for head in heads:
        prompt = loaded.tokenizer.encode(head + "\n")
        ids, _ = reference_generate(loaded.model, prompt, max_new_tokens, loaded.config.eos_token_ids)
        completion = loaded.tokenizer.decode(ids)
        text = function_text(head + "\n", completion)
        results.append((head, text, has_real_body(text)))
    return results


def cpu_decode_rate(spec: str, tokens: int, threads: int, data_dir: str | None) -> float:
    """Tokens/s of one greedy request through the serving engine on the CPU (after a warm-up request),
    counted from its first token to its last (the prompt's prefill left out)."""
    from tandem.shared.engine.engine import EngineConfig, LLMEngine
    from tandem.shared.engine.sampling import SamplingParams
    from tandem.shared.engine.sequence import EngineRequest

    torch.set_num_threads(threads)
    loaded = load_model(spec, device="cpu", data_dir=data_dir)
    config = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=2048,
                          max_model_len=1024, enable_prefix_caching=False)
    engine = LLMEngine(loaded.model, loaded.tokenizer, config, "cpu")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    stamps = []
    for index, prompt in enumerate(("def main():\n", "import os\n\n\ndef walk(root):\n")):  # warm-up, then timed
        engine.add_request(EngineRequest(f"r{index}", loaded.tokenizer.encode(prompt), params))
        stamps = []
        while engine.has_unfinished():
            for out in engine.step():
                stamps += [time.perf_counter()] * len(out.new_token_ids)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def weights_bytes(spec: str, data_dir: str | None) -> int:
    meta = load_model_meta(spec, data_dir)
    if meta.checkpoint is None:
        return 0
    return sum(f.stat().st_size for f in Path(meta.checkpoint).glob("model*.safetensors"))


def measure(spec: str, args: argparse.Namespace, texts: list[str]) -> tuple[Figures, list[tuple[str, str, bool]]]:
    loaded = load_model(spec, device=args.device, dtype=torch.float32, data_dir=args.data_dir)
    window = args.window or training_context(loaded)
    bpb, scored = bits_per_byte(loaded, texts, window)
    heads = complete_heads(loaded, HEADS, args.max_new_tokens)
    rate = None if args.skip_decode else cpu_decode_rate(spec, args.decode_tokens, args.threads, args.data_dir)
    params = sum(p.numel() for p in {id(p): p for p in loaded.model.parameters()}.values())
    figures = Figures(loaded.name, params, weights_bytes(spec, args.data_dir), sum(ok for *_, ok in heads), len(heads),
                      bpb, scored, window, rate, None if args.skip_decode else args.threads)
    return figures, heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model specs: tiny, coder, or checkpoint directories")
    parser.add_argument("--device", default="cpu", help="where the quality figures run (decode is always CPU)")
    parser.add_argument("--data-dir", default=None, help="tandem's data dir (where a user-trained tiny model lives)")
    parser.add_argument("--window", type=int, default=0, help="tokens per scoring window (0: the training context)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-decode", action="store_true", help="leave out the CPU decode rate")
    parser.add_argument("--show", action="store_true", help="print every head's completion")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    texts, versions = heldout_texts()
    print(f"held-out source: {len(texts)} files, {sum(len(t.encode()) for t in texts):,} bytes, from "
          + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    rows = []
    for spec in args.models:
        figures, heads = measure(spec, args, texts)
        rows.append(asdict(figures) | {"spec": spec, "heads": [dict(head=h, text=t, passed=ok) for h, t, ok in heads]})
        rate = (f"{figures.decode_tokens_per_s:7.1f} tok/s ({figures.threads} threads)"
                if figures.decode_tokens_per_s else "-")
        print(f"{spec:>24}  {figures.parameters / 1e6:6.2f}M params  {figures.size_bytes / 1e6:6.2f} MB  "
              f"heads {figures.heads_passed:2d}/{figures.heads_total}  {figures.bits_per_byte:.3f} bits/byte "
              f"(window {figures.window})  decode {rate}", flush=True)
        if args.show:
            for head, text, ok in heads:
                print(f"--- {'PASS' if ok else 'FAIL'} {head}\n{text}\n")
    if args.json:
        args.json.write_text(json.dumps({"heldout_versions": versions, "models": rows}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
