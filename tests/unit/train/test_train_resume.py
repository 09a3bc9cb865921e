"""Checkpoints: 2N unbroken steps equal N steps, stop, resume, N more (bit for bit), and a trainer
checkpoint loads as a served model with the trained weights.

Run: ``python -m pytest -q tests/unit/train/test_train_resume.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tandem.shared.model.loader import load_model
from tandem.shared.model.meta import load_model_meta
from tandem.shared.protocol.training import TrainJob
from tandem.shared.train.loop import TrainLoop

STEPS = 6
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                        reason="needs CUDA")])


def job(tmp_path, name: str, **extra) -> TrainJob:  # noqa: ANN001
    fields = dict(model="tiny", dataset="stdlib", steps=STEPS, batch_size=2, seq_len=48, lr=2e-3, warmup_steps=2,
                  output_dir=str(tmp_path / name), device="cpu")
    return TrainJob(**(fields | extra))


@pytest.mark.parametrize("device", ["cpu", CUDA])
# slow: the layouts between the plainest and the one with every part (about 3 s each on 2 cores)
@pytest.mark.parametrize("device_layers,split,resident", [(0, False, None),
                                                          pytest.param(2, False, None, marks=pytest.mark.slow),
                                                          pytest.param(2, True, None, marks=pytest.mark.slow),
                                                          (3, True, 2)])
def test_resume_continues_bit_exactly(tmp_path, device, device_layers, split, resident):
    """``split``: the host optimizer previews working copies and commits state later (optimizer.py);
    ``resident``: that many of the device-updated layers keep their state on the device, so the
    checkpoint must copy it back and the resumed run load it again (device_update.py). On CUDA the
    rows are 512 tokens, so flash attention's backward splits over key blocks, and the byte vocabulary
    repeats ids within a batch: both reductions race unless the step is deterministic (determinism.py)."""
    how = dict(device_update_layers=device_layers, device_resident_layers=resident, split_update=split, device=device)
    if device == "cuda":
        how |= dict(seq_len=512, batch_size=4)
    unbroken: list[float] = []
    TrainLoop(job(tmp_path, "a", **how), "a", tmp_path).run(
        on_step=lambda m: unbroken.append(m.loss))

    broken: list[float] = []
    first = TrainLoop(job(tmp_path, "b", **how), "b", tmp_path).run(
        on_step=lambda m: broken.append(m.loss), should_stop=lambda: len(broken) >= STEPS // 2)
    assert first.state == "stopped" and first.step == STEPS // 2
    resumed = TrainLoop(job(tmp_path, "b", resume=True, **how), "b", tmp_path)
    assert resumed.placement.resident == (resident or 0)
    assert resumed.start_step == STEPS // 2
    second = resumed.run(on_step=lambda m: broken.append(m.loss))
    assert second.state == "finished" and second.step == STEPS

    assert broken == unbroken, "a resumed run must see the same losses as an unbroken one"
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = load_file(tmp_path / "a" / "optimizer.safetensors")
    ob = load_file(tmp_path / "b" / "optimizer.safetensors")
    assert all(torch.equal(oa[k], ob[k]) for k in oa if not k.startswith("rng"))


def test_checkpoint_serves_as_the_tiny_model(tmp_path):
    out = tmp_path / "models" / "tiny"
    runner = TrainLoop(job(tmp_path, "unused", steps=2, output_dir=str(out)), "t", tmp_path)
    runner.run()
    meta = load_model_meta("tiny", data_dir=tmp_path)
    assert meta.checkpoint == out and meta.config.byte_tokenizer
    served = load_model("tiny", data_dir=tmp_path)
    trained = runner.state.state_dict()
    for name, tensor in served.model.state_dict().items():
        torch.testing.assert_close(tensor, trained["model.embed_tokens.weight" if name == "lm_head.weight" else name],
                                   rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_packed_fine_tuning_resumes_bit_exactly(tmp_path, device):
    """Chat records packed several to a row: the block-diagonal mask takes SDPA off the flash kernel
    onto the memory-efficient one on CUDA, whose backward races too unless deterministic."""
    records = tmp_path / "chat.jsonl"
    with records.open("w") as f:
        for i in range(64):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                                             {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]}) + "\n")
    how = dict(dataset=str(records), device=device, seq_len=256, batch_size=2)
    unbroken: list[float] = []
    TrainLoop(job(tmp_path, "a", **how), "a", tmp_path).run(on_step=lambda m: unbroken.append(m.loss))
    broken: list[float] = []
    TrainLoop(job(tmp_path, "b", **how), "b", tmp_path).run(
        on_step=lambda m: broken.append(m.loss), should_stop=lambda: len(broken) >= STEPS // 2)
    TrainLoop(job(tmp_path, "b", resume=True, **how), "b", tmp_path).run(on_step=lambda m: broken.append(m.loss))
    assert broken == unbroken, "a resumed packed run must see the same losses as an unbroken one"
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed packed run's weights differ from the unbroken run's"
