"""A from-scratch ``coder-*`` job: its BPE is trained on the job's own data first, documents end with
the end-of-text id, and the checkpoint serves as a Hugging Face directory with its tokenizer and
chat template; a resumed job keeps the checkpoint's tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tandem.shared.model.loader import load_model
from tandem.shared.protocol.training import TrainJob
from tandem.shared.text.bpe_trainer import END_OF_TEXT, TURN_START
from tandem.shared.text.chat_template import ChatTemplate
from tandem.shared.text.tokenizer import HFTokenizer
from tandem.shared.train.data import stdlib_files
from tandem.shared.train.loop import TrainLoop, job_tokenizer
from tandem.shared.train.presets import CODER_VOCAB, preset_config


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for index, source in enumerate(stdlib_files()[:12]):
        shutil.copyfile(source, folder / f"{index:02d}_{source.name}")
    return folder


def coder_job(dataset: Path, out: Path, steps: int, resume: bool = False) -> TrainJob:
    return TrainJob(model="coder-s", dataset=str(dataset), steps=steps, batch_size=2, seq_len=64, lr=1e-3,
                    device="cpu", output_dir=str(out), resume=resume)


def test_job_trains_its_tokenizer_and_saves_a_servable_checkpoint(dataset, tmp_path):
    out = tmp_path / "coder"
    runner = TrainLoop(coder_job(dataset, out, steps=2), "coder", tmp_path)
    files = len(list(dataset.iterdir()))
    assert int((runner.data.tokens == 0).sum()) == files, "each document must end with the end-of-text id"
    summary = runner.run()
    assert summary.state == "finished" and summary.step == 2
    loaded = load_model(str(out))
    assert isinstance(loaded.tokenizer, HFTokenizer)
    assert loaded.config.vocab_size == CODER_VOCAB == preset_config("coder-s").vocab_size
    assert loaded.tokenizer.vocab_size <= loaded.config.vocab_size
    assert loaded.tokenizer.token_to_id(END_OF_TEXT) in loaded.config.eos_token_ids
    template = ChatTemplate.from_model_dir(out)
    assert template is not None and TURN_START in template.render([{"role": "user", "content": "hi"}])
    text = "def add(a, b):\n    return a + b\n"
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(text)) == text


def test_resume_keeps_the_checkpoints_tokenizer(dataset, tmp_path):
    out = tmp_path / "coder"
    TrainLoop(coder_job(dataset, out, steps=1), "first", tmp_path).run()
    before = (out / "tokenizer.json").read_bytes()
    assert job_tokenizer(str(dataset), CODER_VOCAB, out, resume=True) == out
    resumed = TrainLoop(coder_job(dataset, out, steps=2, resume=True), "again", tmp_path)
    assert resumed.start_step == 1
    resumed.run()
    assert (out / "tokenizer.json").read_bytes() == before


def test_reruns_train_the_same_model(dataset, tmp_path):
    """The whole recipe (tokenizer, data, initial weights, steps) is a function of the job."""
    weights = []
    for name in ("a", "b"):
        TrainLoop(coder_job(dataset, tmp_path / name, steps=2), name, tmp_path).run()
        weights.append(load_model(str(tmp_path / name)).model.state_dict())
    for key, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][key]), f"{key} differs between two runs of the same job"


def test_coder_names_the_users_own_run_and_refuses_in_one_line_without_one(dataset, tmp_path, monkeypatch):
    from tandem.shared.model import meta as model_meta
    from tandem.shared.model.config import ModelLoadError

    monkeypatch.setattr(model_meta, "_WEIGHTS", "no-such-weights")  # as in an install without shipped weights
    with pytest.raises(ModelLoadError, match="weights are missing from this install") as info:
        model_meta.load_model_meta("coder", data_dir=tmp_path)
    assert "\n" not in str(info.value)
    TrainLoop(coder_job(dataset, tmp_path / "models" / "coder", steps=1), "mine", tmp_path).run()
    meta = model_meta.load_model_meta("coder", data_dir=tmp_path)
    assert meta.source == "data-dir" and meta.name == "coder" and isinstance(meta.tokenizer, HFTokenizer)
