"""Tokenizers: the `Tokenizer` protocol, the byte-level tokenizer of the tiny model, a Hugging Face
`tokenizer.json` wrapper, and the synthetic tokenizer of random preset models.

Tokenizers only encode and decode whole id lists. Streaming text is produced by the engine,
which decodes the growing id list and emits only the stable suffix (text not ending in U+FFFD),
so neither tokenizer keeps any incremental state.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258
BYTE_VOCAB_SIZE = 259


@runtime_checkable
class Tokenizer(Protocol):
    eos_token_ids: list[int]
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus <bos>=256, <eos>=257, <pad>=258.

    encode never adds <bos>: the tiny model is trained and served on raw bytes. decode drops the
    special ids and replaces invalid or incomplete UTF-8 with U+FFFD.
    """

    def __init__(self) -> None:
        self.bos_token_id: int | None = BYTE_BOS_ID
        self.eos_token_ids: list[int] = [BYTE_EOS_ID]
        self.pad_token_id = BYTE_PAD_ID
        self.vocab_size = BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from tokenizer.json with the `tokenizers` library.

    encode applies the tokenizer's own post-processor (add_special_tokens=True), which is what
    `AutoTokenizer(text)` and vLLM's completions endpoint do: Llama 3 gets <|begin_of_text|>
    prepended, Qwen gets nothing. Pass add_special_tokens=False for raw pieces (e.g. stop strings).
    decode skips special tokens. EOS ids come from the model config, not the tokenizer file.
    """

    def __init__(
        self,
        path: str | Path,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        self._tokenizer = _HFTokenizer.from_file(str(path))
        self.eos_token_ids: list[int] = list(eos_token_ids)
        self.bos_token_id: int | None = bos_token_id
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """``encode`` of each text, on the tokenizer's own threads."""
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer.json text (what a grammar library builds its token table from)."""
        return self._tokenizer.to_str()


class SyntheticTokenizer:
    """For random models of real shapes (``random:<preset>``), whose benchmarks send token ids: ids
    0..255 are UTF-8 bytes (so any text encodes); every other id decodes to `` t<id>``."""

    def __init__(self, vocab_size: int, bos_token_id: int | None, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                pending.append(i)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            if i != self.bos_token_id and i not in self.eos_token_ids:
                out.append(f" t{i}")
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)


def load_tokenizer(
    spec: str | Path,
    eos_token_ids: Sequence[int] = (),
    bos_token_id: int | None = None,
) -> Tokenizer:
    """"tiny"/"byte" -> ByteTokenizer; a directory or tokenizer.json path -> HFTokenizer."""
    if str(spec) in ("tiny", "byte"):
        return ByteTokenizer()
    path = Path(spec)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    return HFTokenizer(file, eos_token_ids=eos_token_ids, bos_token_id=bos_token_id)
