"""Fine-tuning data: chat and prompt/completion records from JSONL, the loss on the answers only,
short examples packed into rows of ``seq_len`` without attention across them.

A JSONL file holds one record per line (blank lines are skipped), either kind, mixed or not:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}

(other keys beside these are ignored, so records may carry ids or sources).

**Chat records** render with the model's chat template, the code the HTTP front end renders prompts
with (``shared/text/chat_template.py``), so a model is trained on the text it is served with. Which
tokens are the assistant's is found by rendering incrementally: for the assistant message ``i``,

    head = render(messages[:i], add_generation_prompt=True)     # the prompt the front end would send
    turn = render(messages[:i + 1], add_generation_prompt=False)  # through the end of that turn

and the assistant's text is ``turn[len(head):]``: its content and whatever the template closes the
turn with (``<|im_end|>``, ``<|eot_id|>``; the tiny template's newline). Whitespace after the
template's ``eos_token`` (ChatML's newline after ``<|im_end|>``) is not trained: the model stops at
that token. Both renders must be prefixes of the whole conversation's render, which holds for
templates that render earlier turns the same whatever follows (Llama 3, ChatML, the tiny one); one
that does not (a template that drops earlier turns' reasoning) is refused for that record, as is a
conversation that opens with the assistant (there is no prompt before it). The conversation is then
tokenized piece by piece, untrained text and trained text in turn, each piece as the front end
encodes a prompt (``add_special_tokens=False``: the template writes its own BOS): no token ever
straddles the boundary, so the mask is exact by construction, and the text before each assistant
turn is the very token sequence the server sends the model. Everything else (system, user and tool
turns, headers, BOS) is context only.

**Prompt/completion records**: the prompt tokenized as ``/v1/completions`` tokenizes one (the
tokenizer's own special tokens, Llama 3's BOS), then the completion's tokens and the model's EOS
(``eos_token_ids[0]``); the loss is on the completion and the EOS.

**Lengths.** An example of ``n`` tokens takes ``n - 1`` positions (inputs ``t[:-1]``, targets
``t[1:]``). One longer than ``seq_len + 1`` tokens is cut to its first ``seq_len + 1`` (counted in
:attr:`FinetuneData.description`); one left with nothing to train (a single token, or every trained
token past the cut) is dropped and counted. A file left with no example is refused.

**Packing.** Examples are packed into rows of ``seq_len`` positions by best-fit decreasing (longest
first, each into the row with the least room that takes it), once, at load; the rest of a row is
padding (no loss). A row numbers its examples in ``Batch.segments`` (padding -1): the trainer's
attention keeps each query inside its example and RoPE positions restart at 0 with each, so an
example trains exactly as it would alone (functional.py). Targets come from each example's own
tokens, so no position predicts the next example's first token. With ``pack=False`` every example has
a row of its own (more padding, the plain causal attention). Batch ``k`` takes rows ``k·B .. k·B+B-1``
of an endless sequence of epochs, each epoch every row once in an order seeded by ``(seed, epoch)``:
a batch depends only on ``(seed, step)``, as with text data, so resume sees the same batches.

**Errors.** A bad record is a :class:`FinetuneDataError` (a ``ProtocolError``, ``invalid_request``)
naming the file, the line and what to change, in one line.

    data = FinetuneData.load(Path("chat.jsonl"), "any", tokenizer, template, eos_id=257, vocab_size=259,
                             seq_len=256)
    batch = data.batch(step=0, batch_size=8, seq_len=256, seed=0)  # inputs, targets, segments [8, 256]
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError, field_validator

from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.text.chat_template import ChatTemplate, ChatTemplateError, tiny_template
from tandem.shared.text.tokenizer import HFTokenizer, Tokenizer
from tandem.shared.train.data import IGNORE, Batch

DATA_FORMATS = ("auto", "text", "chat", "completion")
RecordKind = Literal["any", "chat", "completion"]
JSONL_SUFFIX = ".jsonl"
SHAPES = 'each line is {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": ..., "completion": ...}'


class FinetuneDataError(ProtocolError):
    """A fine-tuning file or one of its records cannot be used; the message names the line and the fix."""

    def __init__(self, path: Path | str, line: int | None, problem: str) -> None:
        where = f"{path} line {line}" if line is not None else str(path)
        super().__init__(ErrorCode.INVALID_REQUEST, f"{where}: {problem}", param="dataset")
        self.path, self.line = str(path), line


def records_kind(dataset: str, data_format: str) -> RecordKind | None:
    """Which records ``dataset`` holds under ``data_format``; None: it is text (``data.TokenData``).
    ``auto``: a ``.jsonl`` file holds records of either kind, anything else is text."""
    if data_format not in DATA_FORMATS:
        raise ProtocolError(ErrorCode.INVALID_REQUEST, f"data format {data_format!r} is not one of {DATA_FORMATS}")
    if data_format == "text":
        return None
    if data_format == "chat":
        return "chat"
    if data_format == "completion":
        return "completion"
    return "any" if Path(dataset).suffix == JSONL_SUFFIX else None


# --- records ------------------------------------------------------------------------------------


class _Message(BaseModel):
    # name, tool_calls, tool_call_id, reasoning_content ...: what the template reads of them is its business
    model_config = ConfigDict(extra="allow")
    role: StrictStr = Field(min_length=1)
    content: Any = None  # a string or text parts (the template code joins them; it names a bad part)

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        if value is None or isinstance(value, str | list):
            return value
        raise ValueError(f"must be a string or a list of text parts, not {_json_type(value)}")


class _Chat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[_Message] = Field(min_length=1)


class _Completion(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr
    completion: StrictStr


@dataclass(frozen=True)
class Record:
    """One validated line: ``messages`` (as read, for the template) or ``prompt`` and ``completion``."""

    line: int
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    completion: str | None = None

    @property
    def kind(self) -> Literal["chat", "completion"]:
        return "chat" if self.messages is not None else "completion"


def _json_type(value: Any) -> str:
    """What JSON calls ``value``'s type, with its article."""
    if isinstance(value, bool):
        return "a boolean"
    return {int: "a number", float: "a number", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def _field(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    return f"{_field(error['loc'])}: {message}"


def _parse(raw: bytes, line: int, path: Path, kind: RecordKind) -> Record:
    try:
        obj = json.loads(raw)
    except UnicodeDecodeError:
        raise FinetuneDataError(path, line, "is not UTF-8 text; save the file as UTF-8") from None
    except json.JSONDecodeError as exc:
        raise FinetuneDataError(path, line, f"is not JSON ({exc.msg} at column {exc.colno}); {SHAPES}") from None
    if not isinstance(obj, dict):
        raise FinetuneDataError(path, line, f"is {_json_type(obj)} in JSON, not an object; {SHAPES}")
    chat, completion = "messages" in obj, "prompt" in obj or "completion" in obj
    if chat and completion:
        raise FinetuneDataError(path, line, "has both messages and prompt/completion; keep one of the two")
    if not (chat or completion):
        keys = ", ".join(sorted(obj)) or "none"
        raise FinetuneDataError(path, line, f"has neither messages nor prompt/completion (its keys: {keys}); {SHAPES}")
    found = "chat" if chat else "completion"
    if kind != "any" and found != kind:
        shown = "a chat (messages)" if chat else "a prompt/completion"
        raise FinetuneDataError(path, line, f"is {shown} record but the data format is {kind}; "
                                "use --data-format auto to mix the two")
    try:
        if chat:
            messages = _Chat.model_validate(obj).messages
        else:
            pair = _Completion.model_validate(obj)
            return Record(line, prompt=pair.prompt, completion=pair.completion)
    except ValidationError as exc:
        raise FinetuneDataError(path, line, f"{_validation_problem(exc)}; {SHAPES}") from None
    roles = [m.role for m in messages]
    if "assistant" not in roles:
        raise FinetuneDataError(path, line, "has no assistant message, so nothing to train on; add one "
                                "(or write the record as prompt/completion)")
    if roles[0] == "assistant":
        raise FinetuneDataError(path, line, "opens with the assistant's message; start with a system or user "
                                "message (the prompt the answer follows)")
    for index, message in enumerate(messages):
        if message.role == "assistant" and message.content is None and not getattr(message, "tool_calls", None):
            raise FinetuneDataError(path, line, f"messages[{index}] is the assistant's without content or "
                                    "tool_calls; give it a content")
    # The template gets the record's own dicts (None-valued keys are the template code's to drop).
    return Record(line, messages=[dict(m) for m in obj["messages"]])


def read_records(path: Path, kind: RecordKind = "any") -> list[Record]:
    """Every record of the JSONL file at ``path``, validated (not yet tokenized)."""
    path = Path(path)
    if path.is_dir():
        raise FinetuneDataError(path, None, "is a folder; fine-tuning records are one JSONL file (or use "
                                "--data-format text for a folder of text)")
    if not path.is_file():
        raise FinetuneDataError(path, None, "no such file; give a JSONL file of chat or prompt/completion records")
    records = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.strip():
                records.append(_parse(raw, number, path, kind))
    if not records:
        raise FinetuneDataError(path, None, f"holds no records; {SHAPES}")
    return records


# --- tokens and masks ---------------------------------------------------------------------------


def training_template(init_from: Path | None, byte_tokenizer: bool) -> ChatTemplate | None:
    """The template chat records render with: the checkpoint's own (what the front end serves it
    with), else the tiny model's built-in one for tandem's byte-level models (the tiny model and the
    presets: the front end serves a checkpoint of one with it because the trainer writes it in, see
    runner.py); None where the model has none."""
    if init_from is not None:
        template = ChatTemplate.from_model_dir(init_from)
        if template is not None:
            return template
    return tiny_template() if byte_tokenizer else None


def chat_pieces(template: ChatTemplate, messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool]]:
    """The whole conversation's render cut into ``(text, trained)`` pieces, untrained and trained in
    turn (see the module docstring); raises ChatTemplateError where the template is not incremental."""
    full = template.render(messages, add_generation_prompt=False)
    pieces: list[tuple[str, bool]] = []
    done = 0
    eos = template.eos_token
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        head = template.render(messages[:index], add_generation_prompt=True)
        turn = template.render(messages[:index + 1], add_generation_prompt=False)
        if not (full.startswith(turn) and turn.startswith(head) and len(head) >= done):
            raise ChatTemplateError(
                f"the chat template does not render messages[{index}] (the assistant's) as the generation "
                "prompt followed by the turn, with earlier turns unchanged, so its tokens cannot be told apart; "
                "write the record as prompt/completion")
        answer = turn[len(head):]
        core = answer.rstrip()
        if eos and core.endswith(eos):
            answer = core  # the newline after the end-of-turn token is the template's, not the answer's
        pieces.append((full[done:len(head)], False))
        pieces.append((answer, True))
        done = len(head) + len(answer)
    pieces.append((full[done:], False))
    return [(text, trained) for text, trained in pieces if text]


@dataclass(frozen=True)
class Encoded:
    """One example: its token ids and, per token, whether it is a target of the loss."""

    ids: list[int]
    trained: list[bool]


class Encoder:
    """Records to :class:`Encoded` examples with ``tokenizer`` and ``template`` (None: chat records
    are refused, with ``template_problem`` as the reason where the model's template did not load),
    and the EOS completions end with (None: completion records are refused)."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, eos_id: int | None,
                 model_name: str = "the model", template_problem: str | None = None) -> None:
        self.tokenizer, self.template, self.eos_id, self.model_name = tokenizer, template, eos_id, model_name
        self.template_problem = template_problem
        self._hf = isinstance(tokenizer, HFTokenizer)

    def _text(self, text: str) -> list[int]:
        """A piece of rendered text as the front end encodes a rendered prompt: no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False) if self._hf else self.tokenizer.encode(text)

    def encode(self, record: Record, path: Path) -> Encoded:
        if record.messages is not None:
            if self.template is None and self.template_problem:
                raise FinetuneDataError(path, record.line, f"{self.model_name}'s chat template, which chat records "
                                        f"need, does not load: {self.template_problem}")
            if self.template is None:
                raise FinetuneDataError(path, record.line, f"{self.model_name} has no chat template, which chat "
                                        "records need; add chat_template.jinja to its directory, or write the "
                                        "records as prompt/completion")
            try:
                pieces = chat_pieces(self.template, record.messages)
            except ChatTemplateError as exc:
                raise FinetuneDataError(path, record.line, str(exc)) from None
            ids: list[int] = []
            trained: list[bool] = []
            for text, is_answer in pieces:
                piece = self._text(text)
                ids += piece
                trained += [is_answer] * len(piece)
            return Encoded(ids, trained)
        if self.eos_id is None:
            raise FinetuneDataError(path, record.line, f"{self.model_name} has no eos_token_id, which "
                                    "prompt/completion records end with; set eos_token_id in its config.json")
        prompt = self.tokenizer.encode(record.prompt)  # as /v1/completions: the tokenizer's own BOS included
        completion = self._text(record.completion) + [self.eos_id]
        return Encoded(prompt + completion, [False] * len(prompt) + [True] * len(completion))


# --- packing ------------------------------------------------------------------------------------


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: example indices grouped into rows whose lengths sum to at most
    ``capacity``; longest first (ties in index order), each into the fullest row it still fits."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free positions, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        need = lengths[index]
        at = bisect.bisect_left(room, (need, -1))
        if at == len(room):
            rows.append([index])
            free, row = capacity - need, len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(index)
            free -= need
        if free > 0:
            bisect.insort(room, (free, row))
    return rows


@dataclass(frozen=True)
class DataStats:
    examples: int
    chat: int
    completion: int
    truncated: int  # cut to seq_len + 1 tokens
    dropped: int  # nothing left to train
    trained_tokens: int
    rows: int
    seq_len: int

    def describe(self, path: Path, packed: bool) -> str:
        filled = "packed" if packed else "one example a row"
        text = (f"{path}: {self.examples:,} examples ({self.chat:,} chat, {self.completion:,} prompt/completion), "
                f"{filled} into {self.rows:,} rows of {self.seq_len}, {self.trained_tokens:,} trained tokens")
        if self.truncated:
            text += f"; {self.truncated:,} longer than {self.seq_len + 1} tokens cut to that"
        if self.dropped:
            text += f"; {self.dropped:,} dropped with nothing left to train"
        return text


class FinetuneData:
    """Tokenized, packed fine-tuning examples and their deterministic batches (module docstring)."""

    def __init__(self, tokens: torch.Tensor, targets: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                 rows: list[list[int]], seq_len: int, pad_id: int, stats: DataStats, description: str,
                 packed: bool) -> None:
        self.tokens, self.targets = tokens, targets  # flat int32: every example's ids; ids where trained, else IGNORE
        self.starts, self.lengths = starts, lengths  # per example, into the flat tensors
        self.rows, self.seq_len, self.pad_id = rows, seq_len, pad_id
        self.stats, self.description = stats, description
        self.packed = packed and any(len(row) > 1 for row in rows)  # some row needs the segment mask
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, row order) last used
        self.chat_template: ChatTemplate | None = None  # the template chat records rendered with, if any

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.tokens, self.targets, self.starts, self.lengths))

    @classmethod
    def load(cls, path: Path, kind: RecordKind, tokenizer: Tokenizer, template: ChatTemplate | None, *,
             eos_id: int | None, vocab_size: int, seq_len: int, pack: bool = True, pad_id: int = 0,
             model_name: str = "the model", template_problem: str | None = None) -> FinetuneData:
        """Read, validate, tokenize and pack ``path``; a bad record raises FinetuneDataError.
        ``template`` None: the model has no chat template (``template_problem``: why it did not load)."""
        path = Path(path)
        records = read_records(path, kind)
        encoder = Encoder(tokenizer, template, eos_id, model_name, template_problem)
        ids: list[int] = []
        trained: list[bool] = []
        starts, lengths = [], []
        truncated = dropped = targets_count = 0
        for record in records:
            example = encoder.encode(record, path)
            if example.ids and max(example.ids) >= vocab_size:
                raise FinetuneDataError(path, record.line, f"encodes to token id {max(example.ids)}, beyond the "
                                        f"model's vocabulary of {vocab_size}: the tokenizer is not this model's")
            keep = min(len(example.ids), seq_len + 1)
            truncated += keep < len(example.ids)
            if keep < 2 or not any(example.trained[1:keep]):
                dropped += 1  # the first token is never a target: it has no context to be predicted from
                continue
            targets_count += sum(example.trained[1:keep])
            starts.append(len(ids))
            lengths.append(keep)
            ids += example.ids[:keep]
            trained += example.trained[:keep]
        if not lengths:
            raise FinetuneDataError(path, None, f"no record has anything to train on within --seq-len {seq_len}; "
                                    "give longer answers or a longer --seq-len")
        tokens = torch.tensor(ids, dtype=torch.int32)
        targets = torch.where(torch.tensor(trained), tokens, torch.full_like(tokens, IGNORE))
        positions = [n - 1 for n in lengths]
        rows = pack_rows(positions, seq_len) if pack else [[i] for i in range(len(lengths))]
        chat = sum(r.kind == "chat" for r in records)
        stats = DataStats(len(records), chat, len(records) - chat, truncated, dropped, targets_count, len(rows),
                          seq_len)
        data = cls(tokens, targets, torch.tensor(starts), torch.tensor(lengths), rows, seq_len, pad_id, stats, "",
                   pack)
        data.description = stats.describe(path, pack)
        data.chat_template = template if chat else None
        return data

    def _row(self, index: int, seed: int) -> list[int]:
        """Row ``index`` of the endless sequence of epochs, each a seeded order of every row."""
        epoch, within = divmod(index, len(self.rows))
        if self._order is None or self._order[0] != epoch:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(len(self.rows), generator=gen))
        return self.rows[int(self._order[1][within])]

    def batch(self, step: int, batch_size: int, seq_len: int, seed: int) -> Batch:
        """Rows ``step·batch_size ..`` as inputs, targets and segments, each ``[batch_size, seq_len]``."""
        if seq_len != self.seq_len:
            raise ValueError(f"the data was packed for seq_len {self.seq_len}, not {seq_len}")
        inputs = torch.full((batch_size, seq_len), self.pad_id, dtype=torch.int64)
        targets = torch.full((batch_size, seq_len), IGNORE, dtype=torch.int64)
        segments = torch.full((batch_size, seq_len), -1, dtype=torch.int32)
        for slot in range(batch_size):
            at = 0
            for number, example in enumerate(self._row(step * batch_size + slot, seed)):
                start, length = int(self.starts[example]), int(self.lengths[example])
                span = slice(at, at + length - 1)
                inputs[slot, span] = self.tokens[start:start + length - 1]
                targets[slot, span] = self.targets[start + 1:start + length]  # the example's own next tokens
                segments[slot, span] = number
                at += length - 1
        return Batch(inputs, targets, segments)
