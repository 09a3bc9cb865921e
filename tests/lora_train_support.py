"""PEFT as the LoRA trainer's reference: ``get_peft_model`` on transformers' model of a Hugging Face
directory, started from the trainer's own initial adapter (``peft_model``), trained by
``torch.optim.AdamW`` after ``clip_grad_norm_`` (``peft_step``, which like train_support's
``reference_step`` can also bound how far two fp32 runs may drift apart), and the adapter read back
in ``peft_format``'s keys (``peft_adapter``). Used by tests/unit/train/test_lora_training.py."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.nn.functional as F
from train_support import GRAD_ERROR_MARGIN

from tandem.shared.lora.peft_format import AdapterConfig, LoraWeights
from tandem.shared.train.optimizer import BETAS, EPS


def peft_key(name: str) -> tuple[int, str, str]:
    """(layer, target, "A"|"B") of a PEFT parameter name (``...layers.3.self_attn.q_proj.lora_A.default.weight``)."""
    parts = name.split(".")
    at = parts.index("layers")
    return int(parts[at + 1]), parts[at + 3], "A" if "lora_A" in parts else "B"


def peft_model(hf_dir: Path, adapter: AdapterConfig, start: LoraWeights):  # noqa: ANN201 - peft.PeftModel
    """transformers' model of ``hf_dir`` in fp32 with a PEFT LoRA of ``adapter``'s shape, its A and B
    set to ``start`` (PEFT draws its own initial A from the global RNG)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, target_modules=list(adapter.targets),
                             lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                layer, target, side = peft_key(name)
                p.copy_((start.a if side == "A" else start.b)[(layer, target)])
    return model


def peft_adapter(model) -> dict[tuple[int, str, str], torch.Tensor]:  # noqa: ANN001
    """The LoRA tensors of a PEFT model (trainable or loaded for inference) by (layer, target, "A"|"B")."""
    return {peft_key(name): p.detach() for name, p in model.named_parameters() if ".lora_" in name}


def peft_optimizer(model, lr: float, weight_decay: float) -> torch.optim.AdamW:  # noqa: ANN001
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=BETAS, eps=EPS,
                             weight_decay=weight_decay)


def peft_loss(model, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Mean cross-entropy of the model's logits at ``ids`` against ``targets`` (-100 skipped), as the trainer."""
    logits = model(input_ids=ids).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def peft_step(model, opt, lr: float, clip: float, ids: torch.Tensor, targets: torch.Tensor,  # noqa: ANN001
              slack: dict[tuple[int, str, str], torch.Tensor] | None = None) -> tuple[float, float]:
    """One step of PEFT + AdamW; returns (loss, gradient norm before clipping). ``slack`` as in
    train_support.reference_step: per element, how far an fp32 run in another order of operations
    may have drifted, from the rounding an fp32 backward carries (against float64)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt.zero_grad()
    loss = peft_loss(model, ids, targets)
    loss.backward()
    rounding = None
    if slack is not None:
        exact = copy.deepcopy(model).double()
        exact.zero_grad(set_to_none=True)
        peft_loss(exact, ids, targets).backward()
        grads64 = {peft_key(n): p.grad for n, p in exact.named_parameters() if p.requires_grad}
        rounding = {peft_key(n): (p.grad.double() - grads64[peft_key(n)]).abs().max().item()
                    for n, p in model.named_parameters() if p.requires_grad}
    norm = torch.nn.utils.clip_grad_norm_(params, clip)
    coef = min(1.0, clip / (norm.item() + 1e-6))
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    if slack is not None:
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            state = opt.state[p]
            denom = (state["exp_avg_sq"] / (1 - BETAS[1] ** int(state["step"]))).sqrt() + EPS
            key = peft_key(name)
            slack[key] = slack.get(key, torch.zeros_like(p)) + (
                GRAD_ERROR_MARGIN * lr * coef * rounding[key] / denom * (p.grad != 0))
    return loss.item(), norm.item()
