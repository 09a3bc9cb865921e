"""LoRA adapters for tests: PEFT adapters (made by the ``peft`` package itself) over the small Hugging
Face checkpoints of ``model_support``, with random B so their products are not zero, and the logits
``peft`` computes for a sequence, to compare served logits against."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(hf_model, directory: Path, rank: int, targets: list[str], seed: int,  # noqa: ANN001
                      alpha: float | None = None, use_rslora: bool = False) -> Path:
    """Save a PEFT LoRA adapter of ``hf_model`` (a transformers model; left unchanged) whose A and B
    are both random, so that it changes the logits."""
    peft = pytest.importorskip("peft")
    import copy

    config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                             lora_dropout=0.0, init_lora_weights=False, use_rslora=use_rslora)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return directory


def served_adapters(root: Path, adapters: dict[str, tuple[int, list[str], int]]):  # noqa: ANN201
    """A Llama 3 checkpoint under ``root/base`` and a PEFT adapter of it per ``name: (rank, targets,
    seed)``: (the transformers model, the checkpoint's directory, each adapter's ``AdapterRef``)."""
    from model_support import make_hf_checkpoint

    from tandem.shared.protocol.adapters import AdapterRef

    hf_model = make_hf_checkpoint("llama3", root / "base")
    refs = {}
    for name, (rank, targets, seed) in adapters.items():
        make_peft_adapter(hf_model, root / name, rank, targets, seed)
        refs[name] = AdapterRef(name=name, version="1", path=str(root / name))
    return hf_model, root / "base", refs


def peft_logits(hf_model, adapter_dir: Path | None, token_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """float32 logits ``[len(token_ids), vocab]`` of ``hf_model`` with the adapter (None: without)."""
    peft = pytest.importorskip("peft")
    import copy

    model = hf_model if adapter_dir is None else peft.PeftModel.from_pretrained(copy.deepcopy(hf_model), adapter_dir)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()
