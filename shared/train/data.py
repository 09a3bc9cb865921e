"""Training data: a token stream and deterministic batches of random windows from it.

``stdlib`` is the Python standard library's own sources (every machine with Python has them),
read in sorted path order; a path is a text file or a folder of them; ``random`` is uniform random
tokens (for benchmarks). Batch ``k`` depends only on ``(seed, k)``, so the data position of a run is
its step count and a resumed run sees exactly the batches an unbroken one would.

    data = TokenData.load("stdlib", ByteTokenizer(), vocab_size=259)
    batch = data.batch(step=0, batch_size=8, seq_len=256, seed=0)   # batch.inputs, batch.targets: [8, 256]

Fine-tuning records (chat and prompt/completion JSONL, packed) are ``finetune_data.py``; both kinds
of data hand the trainer a :class:`Batch`.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.text.tokenizer import ByteTokenizer, Tokenizer

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".toml", ".cfg", ".c", ".h", ".js", ".html", ".css"}
SEPARATOR = "\n\n"


IGNORE = -100  # a target the loss skips (cross_entropy's ignore_index)


@dataclass(frozen=True)
class Batch:
    """One step's batch, each tensor ``[batch_size, seq_len]`` on the host.

    ``targets`` holds :data:`IGNORE` where no loss is taken. ``segments`` is None for rows that are
    one causal sequence each (text windows); packed rows number their examples 0, 1, ... from the
    row's start and their padding -1: a position attends only within its own segment, and RoPE
    positions restart at 0 with each one (``functional.packed_positions``)."""

    inputs: torch.Tensor  # int64
    targets: torch.Tensor  # int64
    segments: torch.Tensor | None = None  # int32


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files (not site-packages), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


def text_files(path: Path) -> list[Path]:
    """The files a text dataset at ``path`` is read from: the file itself, or every text file below the folder."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def dataset_files(spec: str) -> list[Path]:
    """The files a text dataset ``spec`` (``stdlib`` or a path) is read from, in reading order;
    ``invalid_request`` when there are none."""
    files = stdlib_files() if spec == "stdlib" else text_files(Path(spec)) if Path(spec).exists() else []
    if not files:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"dataset {spec!r}: no text files found "
                            "(use 'stdlib', 'random', a text file or a folder of them)")
    return files


def _subword_ids(files: list[Path], tokenizer: Tokenizer) -> list[int]:
    """The files' ids, one after another. A tokenizer with an end-of-text token separates them with
    it (a model learns where a document ends, and a served completion can stop there); one without
    gets a blank line. Encoded in batches on the tokenizer's threads where it has them."""
    eos = list(tokenizer.eos_token_ids[:1])
    texts = [f.read_text(errors="replace") + ("" if eos else SEPARATOR) for f in files]
    batch = getattr(tokenizer, "encode_batch", None)
    encoded = batch(texts) if batch is not None else [tokenizer.encode(t) for t in texts]
    ids: list[int] = []
    for piece in encoded:
        ids += piece + eos
    return ids


class TokenData:
    def __init__(self, tokens: torch.Tensor | None, vocab_size: int, description: str) -> None:
        self.tokens = tokens  # 1-D (uint8 for bytes, int32 otherwise); None: random tokens
        self.vocab_size = vocab_size
        self.description = description
        self.packed = False  # windows of one stream: plain causal rows

    @property
    def nbytes(self) -> int:
        """Host bytes the data holds (the memory plan counts them)."""
        return self.tokens.nbytes if self.tokens is not None else 0

    @classmethod
    def load(cls, spec: str, tokenizer: Tokenizer, vocab_size: int) -> TokenData:
        """Read and tokenize ``spec``; raises ProtocolError(INVALID_REQUEST) when it cannot."""
        if spec == "random":
            return cls(None, vocab_size, "random tokens")
        files = dataset_files(spec)
        if isinstance(tokenizer, ByteTokenizer):
            blob = bytearray()
            for f in files:
                blob += f.read_bytes() + SEPARATOR.encode()
            tokens = torch.frombuffer(blob, dtype=torch.uint8).clone()
        else:
            tokens = torch.tensor(_subword_ids(files, tokenizer), dtype=torch.int32)
        if int(tokens.max()) >= vocab_size:
            raise ProtocolError(ErrorCode.INVALID_REQUEST, f"dataset {spec!r} has token ids beyond the vocabulary")
        return cls(tokens, vocab_size, f"{spec}: {len(files)} files, {tokens.numel():,} tokens")

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> Batch:
        """Inputs and targets, each ``[batch_size, seq_len]`` int64: windows at offsets drawn from a
        generator seeded by ``(seed, step)``; targets are the inputs shifted by one token."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if self.tokens is None:
            window = torch.randint(0, self.vocab_size, (batch_size, seq_len + 1), generator=gen)
        else:
            span = self.tokens.numel() - seq_len - 1
            if span <= 0:
                raise ProtocolError(ErrorCode.INVALID_REQUEST,
                                    f"dataset has {self.tokens.numel()} tokens, fewer than seq_len + 1")
            offsets = torch.randint(0, span, (batch_size,), generator=gen)
            window = self.tokens[offsets[:, None] + torch.arange(seq_len + 1)].long()
        return Batch(window[:, :-1].contiguous(), window[:, 1:].contiguous())
