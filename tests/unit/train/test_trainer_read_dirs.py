"""What a job from the bus may read and write (services/trainer/service.py ``confine_job``): its
paths made absolute, its dataset and model only under ``--trainer-read-dirs`` (unset: the data
dir), names that are no paths untouched. ``tandem train`` is not confined (tests/e2e/test_train_cli.py)."""

from __future__ import annotations

import os

import pytest

from tandem.services.trainer.service import READ_DIRS_SETTING, confine_job, read_roots
from tandem.shared.infra.config import ENV_PREFIX, Settings
from tandem.shared.protocol.base import ErrorCode, ProtocolError
from tandem.shared.protocol.training import TrainJob


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


@pytest.fixture
def dirs(tmp_path):
    data, extra, outside = tmp_path / "data", tmp_path / "extra", tmp_path / "outside"
    for folder in (data, extra, outside):
        folder.mkdir()
    for folder in (data, extra, outside):
        (folder / "notes.txt").write_text("x")
    return data, extra, outside


def test_unset_reads_from_the_data_dir_only(dirs):
    data, extra, outside = dirs
    settings = Settings(data_dir=data)
    assert settings.trainer.read_dirs is None and read_roots(settings) == [data]
    job = confine_job(TrainJob(dataset=str(data / "notes.txt")), "j", settings)
    assert job.dataset == str(data / "notes.txt")
    for place in (extra, outside):
        with pytest.raises(ProtocolError) as caught:
            confine_job(TrainJob(dataset=str(place / "notes.txt")), "j", settings)
        assert caught.value.code == ErrorCode.INVALID_REQUEST and caught.value.param == "job.dataset"
        assert READ_DIRS_SETTING == "--trainer-read-dirs / TANDEM_TRAINER_READ_DIRS"
        assert READ_DIRS_SETTING in caught.value.message


def test_the_setting_names_the_roots_from_its_variable(dirs, monkeypatch):
    data, extra, outside = dirs
    monkeypatch.setenv("TANDEM_DATA_DIR", str(data))
    monkeypatch.setenv("TANDEM_TRAINER_READ_DIRS", f"{extra}{os.pathsep}")
    settings = Settings()
    assert read_roots(settings) == [extra]  # given: these folders only
    assert confine_job(TrainJob(dataset=str(extra / "notes.txt")), "j", settings).dataset == str(extra / "notes.txt")
    with pytest.raises(ProtocolError, match="job.dataset"):
        confine_job(TrainJob(dataset="notes.txt"), "j", settings)  # the data dir is no longer listed
    monkeypatch.setenv("TANDEM_TRAINER_READ_DIRS", "")
    assert Settings().trainer.read_dirs is None


@pytest.mark.parametrize("fields", [
    dict(),  # tiny on stdlib
    dict(dataset="random", model="3b"),
    dict(dataset="stdlib", data_format="text", model="1b"),
])
def test_names_that_are_no_paths_pass_untouched(dirs, fields):
    data, _, _ = dirs
    settings = Settings(data_dir=data, trainer_read_dirs=[])  # not even a folder may be read
    job = confine_job(TrainJob(**fields), "j-1", settings)
    assert (job.model, job.dataset) == (TrainJob(**fields).model, TrainJob(**fields).dataset)
    assert job.output_dir == str(data.resolve() / "train" / "j-1")  # the default, absolute


def test_relative_paths_count_from_the_data_dir(dirs, monkeypatch, tmp_path):
    data, _, outside = dirs
    monkeypatch.chdir(outside)  # the service's working directory plays no part
    job = confine_job(TrainJob(dataset="notes.txt", output_dir="train/x"), "j", Settings(data_dir=data))
    assert job.dataset == str(data.resolve() / "notes.txt") and job.output_dir == str(data.resolve() / "train" / "x")
    # as records, "stdlib" is a file (in the data dir), not the standard library
    records = confine_job(TrainJob(dataset="stdlib", data_format="chat"), "j", Settings(data_dir=data))
    assert records.dataset == str(data.resolve() / "stdlib")


def test_a_dataset_link_keeps_its_name(dirs):
    """With format auto the name says records or text: a .jsonl link to a file of another name stays records."""
    data, _, _ = dirs
    (data / "chat.jsonl").symlink_to(data / "notes.txt")
    assert confine_job(TrainJob(dataset="chat.jsonl"), "j", Settings(data_dir=data)).dataset.endswith("chat.jsonl")


def test_the_model_directory_is_resolved_and_walked(dirs):
    data, _, outside = dirs
    (data / "m").mkdir()
    (data / "m" / "config.json").write_text("{}")
    (data / "m-link").symlink_to(data / "m")
    assert confine_job(TrainJob(model="m-link"), "j", Settings(data_dir=data)).model == str((data / "m").resolve())
    (data / "m" / "tokenizer.json").symlink_to(outside / "notes.txt")
    with pytest.raises(ProtocolError, match=r"job.model .*its entry 'tokenizer.json' leads outside") as caught:
        confine_job(TrainJob(model=str(data / "m")), "j", Settings(data_dir=data))
    assert caught.value.param == "job.model"


def test_output_dir_stays_under_the_data_dir_whatever_may_be_read(dirs):
    data, extra, _ = dirs
    with pytest.raises(ProtocolError, match="outside the data dir") as caught:
        confine_job(TrainJob(output_dir=str(extra / "out")), "j", Settings(data_dir=data, trainer_read_dirs=[extra]))
    assert caught.value.param == "job.output_dir"
