"""Fine-tuning records (shared/train/finetune_data.py): which tokens the loss is on, for known chat
templates token by token (the tiny model's byte-level one, Llama 3 and ChatML on trained BPE
tokenizers, and transformers' own assistant mask); prompt/completion records; bad lines refused in
one line naming them; cutting and dropping; packing and the batches made from it.

Run: ``python -m pytest -q tests/unit/train/test_finetune_data.py``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from chat_support import FAMILIES, write_byte_bpe
from train_support import write_jsonl

from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.text.chat_template import ChatTemplate, tiny_template
from tandem.shared.text.tokenizer import BYTE_EOS_ID, ByteTokenizer, HFTokenizer
from tandem.shared.train.data import IGNORE
from tandem.shared.train.finetune_data import (
    Encoded,
    Encoder,
    FinetuneData,
    FinetuneDataError,
    Record,
    chat_pieces,
    pack_rows,
    read_records,
    records_kind,
)
from tandem.shared.train.functional import packed_positions

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Italy?"},
    {"role": "assistant", "content": "Rome."},
]


@pytest.fixture(scope="module")
def bpe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {}
    for name, family in FAMILIES.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        write_byte_bpe(dirs[name], family)
    return dirs


def hf_encoder(directory: Path, eos: str) -> Encoder:
    tokenizer = HFTokenizer(directory)
    return Encoder(tokenizer, ChatTemplate.from_model_dir(directory), tokenizer.token_to_id(eos))


def runs(example: Encoded) -> list[list[int]]:
    """The trained token ids as maximal runs of consecutive positions."""
    out, current = [], []
    for token, trained in zip(example.ids, example.trained):
        if trained:
            current.append(token)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def with_specials(directory: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).decode(ids, skip_special_tokens=False)


# --- chat: which tokens are the assistant's ------------------------------------------------------


def test_tiny_template_masks_exactly_the_answers_and_their_newline():
    """Byte tokenizer: one token per byte, so the mask can be written out by hand."""
    example = Encoder(ByteTokenizer(), tiny_template(), BYTE_EOS_ID).encode(Record(1, messages=CHAT), Path("x"))
    text = ("<|system|>\nBe brief.\n<|user|>\nCapital of France?\n<|assistant|>\n" "Paris.\n"
            "<|user|>\nAnd Italy?\n<|assistant|>\n" "Rome.\n")
    assert example.ids == list(text.encode()), "the conversation is not the tiny template's render"
    first, second = text.index("Paris.\n"), text.index("Rome.\n")
    expected = [first <= i < first + 7 or second <= i < second + 6 for i in range(len(text))]
    shown = "".join(ch if t else "." for ch, t in zip(text, example.trained))
    assert example.trained == expected, f"trained bytes (others as .): {shown!r}"


@pytest.mark.parametrize("family,eos,answers", [
    ("qwen2", "<|im_end|>", ["Paris.<|im_end|>", "Rome.<|im_end|>"]),
    ("llama3", "<|eot_id|>", ["Paris.<|eot_id|>", "Rome.<|eot_id|>"]),
])
def test_bpe_templates_mask_content_and_end_of_turn_token(family, eos, answers, bpe_dirs):
    directory = bpe_dirs[family]
    encoder = hf_encoder(directory, eos)
    example = encoder.encode(Record(1, messages=CHAT), Path("x"))
    got = [with_specials(directory, run) for run in runs(example)]
    assert got == answers, f"{family}: trained runs {got}, expected the answers and their end-of-turn token"
    full = encoder.template.render(CHAT, add_generation_prompt=False)
    whole = encoder.tokenizer.encode(full, add_special_tokens=False)
    assert example.ids == whole, f"{family}: piecewise tokens differ from the whole render's tokens"
    assert not example.trained[0], "the first token (BOS or the system header) must not be trained"


def test_chatml_newline_after_end_of_turn_is_not_trained(bpe_dirs):
    pieces = chat_pieces(ChatTemplate.from_model_dir(bpe_dirs["qwen2"]), CHAT[1:3])
    assert pieces[-2:] == [("Paris.<|im_end|>", True), ("\n", False)], pieces


# ChatML with transformers' {% generation %} block around what the assistant says, as templates
# written for assistant-only loss mark it: transformers' assistant mask is then an outside oracle.
GENERATION_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}{%- else %}{{- message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("messages", [CHAT[1:], CHAT[1:3], [*CHAT[1:3], {"role": "user", "content": "Thanks"}]],
                         ids=["two answers", "one answer", "ends on the user"])
def test_mask_matches_transformers_assistant_mask(messages, bpe_dirs):
    transformers = pytest.importorskip("transformers")
    directory = bpe_dirs["qwen2"]
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    theirs = hf.apply_chat_template(messages, chat_template=GENERATION_CHATML, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
    tokenizer = HFTokenizer(directory)
    special = ChatTemplate.from_model_dir(directory).special_tokens
    encoder = Encoder(tokenizer, ChatTemplate(GENERATION_CHATML, special), tokenizer.token_to_id("<|im_end|>"))
    ours = encoder.encode(Record(1, messages=messages), Path("x"))
    assert ours.ids == list(theirs["input_ids"]), "token ids differ from transformers'"
    assert [int(t) for t in ours.trained] == list(theirs["assistant_masks"]), "mask differs from transformers'"


# --- prompt/completion ------------------------------------------------------------------------------


def test_completion_trains_completion_and_eos_only_bytes():
    example = Encoder(ByteTokenizer(), None, BYTE_EOS_ID).encode(Record(1, prompt="2+2=", completion="4"), Path("x"))
    assert example.ids == [*b"2+2=", *b"4", BYTE_EOS_ID]
    assert example.trained == [False] * 4 + [True, True]


def test_completion_prompt_gets_the_tokenizers_bos_untrained(bpe_dirs):
    directory = bpe_dirs["llama3"]
    encoder = hf_encoder(directory, "<|eot_id|>")
    example = encoder.encode(Record(1, prompt="The quick brown fox", completion=" jumps"), Path("x"))
    bos, eos = encoder.tokenizer.token_to_id("<|begin_of_text|>"), encoder.eos_id
    prompt = encoder.tokenizer.encode("The quick brown fox")  # as /v1/completions tokenizes it
    assert prompt[0] == bos and example.ids[:len(prompt)] == prompt
    assert example.ids[-1] == eos and with_specials(directory, runs(example)[0]) == " jumps<|eot_id|>"
    assert example.trained == [False] * len(prompt) + [True] * (len(example.ids) - len(prompt))


# --- bad records --------------------------------------------------------------------------------

GOOD = {"prompt": "a", "completion": "b"}
BAD_LINES = {
    "not JSON": ('{"prompt": "a", ', "is not JSON"),
    "a list": ("[1, 2]", "is a list in JSON, not an object"),
    "neither kind": ({"text": "hi"}, "has neither messages nor prompt/completion (its keys: text)"),
    "both kinds": ({"messages": CHAT, "prompt": "x", "completion": "y"}, "has both messages and prompt/completion"),
    "empty messages": ({"messages": []}, "messages: list should have at least 1 item"),
    "messages not a list": ({"messages": "hi"}, "messages: input should be a valid list"),
    "no role": ({"messages": [{"content": "hi"}]}, "messages[0].role: field required"),
    "content a number": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
                         "messages[0].content: must be a string or a list of text parts, not a number"),
    "no assistant": ({"messages": CHAT[:2]}, "has no assistant message"),
    "assistant first": ({"messages": CHAT[2:]}, "opens with the assistant's message"),
    "assistant without content": ({"messages": [CHAT[1], {"role": "assistant"}]},
                                  "messages[1] is the assistant's without content"),
    "no completion": ({"prompt": "a"}, "completion: field required"),
    "prompt a number": ({"prompt": 1, "completion": "x"}, "prompt: input should be a valid string"),
    "image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                                 CHAT[2]]}, "messages[0].content[0] is type 'image_url'"),
}


@pytest.mark.parametrize("bad,expected", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_bad_line_is_one_typed_line_naming_it(bad, expected, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [GOOD, "", bad])  # the bad record is on line 3
    with pytest.raises(FinetuneDataError) as caught:
        FinetuneData.load(path, "any", ByteTokenizer(), tiny_template(), eos_id=BYTE_EOS_ID, vocab_size=259,
                          seq_len=64)
    error = caught.value
    assert isinstance(error, ProtocolError) and error.code == ErrorCode.INVALID_REQUEST
    assert error.line == 3, f"blamed line {error.line}: {error}"
    assert f"{path} line 3: " in error.message and expected in error.message, error.message
    assert "\n" not in str(error), f"the error is not one line: {error!r}"


def test_not_utf8_is_named(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff", "completion": "x"}\n')
    with pytest.raises(FinetuneDataError, match=r"line 2: is not UTF-8"):
        read_records(path)


@pytest.mark.parametrize("kind,record,expected", [
    ("chat", GOOD, "is a prompt/completion record but the data format is chat"),
    ("completion", {"messages": CHAT}, "is a chat (messages) record but the data format is completion"),
])
def test_data_format_refuses_the_other_kind(kind, record, expected, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [record])
    with pytest.raises(FinetuneDataError, match=re.escape(f"line 1: {expected}; use --data-format auto")):
        read_records(path, kind)


TEMPLATE_PROBLEMS = {
    "the template refuses": ("{% if messages[0].role != 'user' %}{{ raise_exception('Start with the user') }}"
                             "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}", "Start with the user"),
    "not incremental": ("{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}"
                        "{% endif %}{% endfor %}", "does not render messages[2] (the assistant's)"),
}


@pytest.mark.parametrize("source,expected", TEMPLATE_PROBLEMS.values(), ids=TEMPLATE_PROBLEMS.keys())
def test_template_problems_name_the_line(source, expected, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": CHAT[:3]}])
    with pytest.raises(FinetuneDataError, match=r"line 1: ") as caught:
        FinetuneData.load(path, "any", ByteTokenizer(), ChatTemplate(source), eos_id=None, vocab_size=259, seq_len=64)
    assert expected in caught.value.message and "\n" not in caught.value.message


@pytest.mark.parametrize("records,template,eos,expected", [
    ([{"messages": CHAT[1:3]}], None, BYTE_EOS_ID, "has no chat template"),
    ([GOOD], None, None, "has no eos_token_id"),
    ([], None, BYTE_EOS_ID, "holds no records"),
], ids=["chat without template", "completion without eos", "empty file"])
def test_what_the_model_lacks_is_named(records, template, eos, expected, tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", records)
    with pytest.raises(FinetuneDataError, match=expected):
        FinetuneData.load(path, "any", ByteTokenizer(), template, eos_id=eos, vocab_size=259, seq_len=64)


def test_missing_file(tmp_path):
    with pytest.raises(FinetuneDataError, match="no such file"):
        read_records(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("dataset,data_format,expected", [
    ("chat.jsonl", "auto", "any"), ("notes.txt", "auto", None), ("stdlib", "auto", None),
    ("chat.jsonl", "text", None), ("chat.jsonl", "chat", "chat"), ("pairs.data", "completion", "completion"),
])
def test_records_kind(dataset, data_format, expected):
    assert records_kind(dataset, data_format) == expected


# --- lengths ------------------------------------------------------------------------------------


def test_long_examples_are_cut_and_counted_and_empty_ones_dropped(tmp_path):
    seq = 16
    path = write_jsonl(tmp_path / "data.jsonl", [
        {"prompt": "ab", "completion": "x" * 40},  # cut to 17 tokens, still 14 trained
        {"prompt": "p" * 30, "completion": "late"},  # every trained token past the cut: dropped
        {"prompt": "", "completion": ""},  # one token (the EOS), which nothing predicts: dropped
        {"prompt": "q", "completion": "ok"},
    ])
    data = FinetuneData.load(path, "any", ByteTokenizer(), None, eos_id=BYTE_EOS_ID, vocab_size=259, seq_len=seq)
    assert data.stats.truncated == 2 and data.stats.dropped == 2, data.description
    assert data.lengths.tolist() == [seq + 1, 4]
    assert data.stats.trained_tokens == 15 + 3, data.description
    assert "2 longer than 17 tokens cut to that" in data.description
    assert "2 dropped with nothing left to train" in data.description


def test_nothing_left_to_train_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "p" * 30, "completion": "late"}])
    with pytest.raises(FinetuneDataError, match="no record has anything to train on within --seq-len 8"):
        FinetuneData.load(path, "any", ByteTokenizer(), None, eos_id=BYTE_EOS_ID, vocab_size=259, seq_len=8)


# --- packing and batches ------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_pack_rows_places_every_example_once_within_capacity(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 64) for _ in range(rng.randint(1, 200))]
    rows = pack_rows(lengths, 64)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths))), "an example is missing or placed twice"
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert len(rows) <= -(-sum(lengths) // 64) * 1.25 + 1, f"{len(rows)} rows for {sum(lengths)} positions"


def test_pack_rows_best_fit():
    assert pack_rows([5, 5, 3, 3, 2, 2], 10) == [[0, 1], [2, 3, 4, 5]]


def random_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    records = []
    for index in range(count):
        say = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
        if index % 3:
            records.append({"messages": [{"role": "user", "content": say(rng.randint(1, 4))},
                                         {"role": "assistant", "content": say(rng.randint(1, 3))}]})
        else:
            records.append({"prompt": say(rng.randint(1, 3)), "completion": say(rng.randint(1, 2))})
    return records


@pytest.fixture
def packed(tmp_path) -> tuple[FinetuneData, list[Encoded]]:
    records = random_records(30)
    path = write_jsonl(tmp_path / "data.jsonl", records)
    data = FinetuneData.load(path, "any", ByteTokenizer(), tiny_template(), eos_id=BYTE_EOS_ID, vocab_size=259,
                             seq_len=96)
    encoder = Encoder(ByteTokenizer(), tiny_template(), BYTE_EOS_ID)
    examples = [encoder.encode(r, path) for r in read_records(path)]
    return data, examples


def test_batch_rows_hold_each_example_as_it_is_alone(packed):
    """Every row: segments 0, 1, ... then padding; each segment's inputs are its example's tokens but
    the last, its targets the next tokens where trained: no target crosses into the next example."""
    data, examples = packed
    assert data.packed and any(len(row) > 1 for row in data.rows)
    batch = data.batch(0, len(data.rows), data.seq_len, seed=0)  # epoch 0: every row once
    seen = []
    for row in range(batch.inputs.shape[0]):
        segments = batch.segments[row].tolist()
        count = max(segments) + 1
        assert segments == sorted(segments, key=lambda s: (s < 0, s)), f"row {row}: segments out of order"
        for number in range(count):
            where = batch.segments[row] == number
            ids, targets = batch.inputs[row][where].tolist(), batch.targets[row][where].tolist()
            match = [e for e in examples if e.ids[:-1] == ids]
            assert match, f"row {row} segment {number} is no example's tokens"
            example = match[0]
            expected = [t if m else IGNORE for t, m in zip(example.ids[1:], example.trained[1:])]
            assert targets == expected, f"row {row} segment {number}: targets are not the example's own"
            seen.append(tuple(ids))
        pad = batch.segments[row] < 0
        assert (batch.targets[row][pad] == IGNORE).all(), f"row {row}: padding has targets"
    assert sorted(seen) == sorted(tuple(e.ids[:-1]) for e in examples), "epoch 0 does not hold every example once"


def test_positions_restart_at_every_example(packed):
    data, _ = packed
    batch = data.batch(0, 4, data.seq_len, seed=0)
    positions = packed_positions(batch.segments)
    for row in range(4):
        for number in range(int(batch.segments[row].max()) + 1):
            got = positions[row][batch.segments[row] == number]
            assert got.tolist() == list(range(got.numel())), f"row {row} segment {number}: positions {got.tolist()}"


def test_batches_depend_only_on_seed_and_step(packed, tmp_path):
    data, _ = packed
    in_order = [data.batch(step, 4, data.seq_len, seed=7) for step in range(12)]  # more than an epoch
    fresh = FinetuneData.load(tmp_path / "data.jsonl", "any", ByteTokenizer(), tiny_template(), eos_id=BYTE_EOS_ID,
                              vocab_size=259, seq_len=96)
    for step in (11, 3, 0, 8):
        again = fresh.batch(step, 4, data.seq_len, seed=7)
        assert torch.equal(again.inputs, in_order[step].inputs) and torch.equal(again.segments, in_order[step].segments)
    assert not torch.equal(data.batch(0, 4, data.seq_len, seed=8).inputs, in_order[0].inputs), "seed has no effect"


def test_no_pack_gives_each_example_a_row(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", random_records(10))
    data = FinetuneData.load(path, "any", ByteTokenizer(), tiny_template(), eos_id=BYTE_EOS_ID, vocab_size=259,
                             seq_len=96, pack=False)
    assert len(data.rows) == 10 and not data.packed
    batch = data.batch(0, 10, 96, seed=0)
    assert int(batch.segments.max()) == 0, "an unpacked row holds a second example"
