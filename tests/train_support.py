"""Plain-PyTorch training as the streaming trainer's reference: the repo's own ``LlamaForCausalLM``
modules run with a plain causal forward (``reference_loss``) and trained by ``torch.optim.AdamW``
(decoupled weight decay on matrices, ``reference_optimizer``) with ``clip_grad_norm_``
(``reference_step``, which can also bound how far two fp32 runs may drift apart), on seeded random
``batches``; and for fine-tuning, seeded chat and prompt/completion records (``finetune_records``)
with the masked loss of their examples each run alone (``reference_masked_step``); packed rows' segment
ids (``packed_rows``) and the block mask of their rule evaluated pair by pair (``rule_block_mask``); the
CPU allocator's peak under a profiler (``allocation_peak``). The CPU parity tests and the CUDA ones
share it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from tandem.shared.model.llama import LlamaForCausalLM, apply_rope
from tandem.shared.train.host_state import HostState
from tandem.shared.train.optimizer import BETAS, EPS

LR, WD, CLIP = 3e-3, 0.1, 0.5
# The engine's and the reference's backward each carry rounding of the size gradient_rounding measures,
# in different orders (chunked MLP and loss, slots); this many times that size bounds their difference.
GRAD_ERROR_MARGIN = 4.0


def reference_loss(model: LlamaForCausalLM, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain full-sequence causal forward and mean cross-entropy, with the model's own modules."""
    logits = reference_forward(model, ids)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def reference_forward(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, S, vocab]`` of a plain full-sequence causal forward (positions 0..S-1 in every
    row), with the model's own modules and autograd."""
    inner, cfg = model.model, model.config
    bsz, seq = ids.shape
    cos, sin = inner.rotary_emb(torch.arange(seq, device=ids.device))
    x = inner.embed_tokens(ids)
    group = cfg.num_heads // cfg.num_kv_heads
    for layer in inner.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(bsz, seq, cfg.num_heads, cfg.head_dim)
        k = attn.k_proj(h).view(bsz, seq, cfg.num_kv_heads, cfg.head_dim)
        v = attn.v_proj(h).view(bsz, seq, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             is_causal=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(inner.norm(x))


def reference_model(state: HostState, device: str = "cpu") -> LlamaForCausalLM:
    model = LlamaForCausalLM(state.config)
    model.load_state_dict({k: v.clone() for k, v in state.state_dict().items()}, strict=False)
    model.tie_weights()
    return model.to(device)


def reference_optimizer(model: LlamaForCausalLM) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


def gradient_rounding(model: LlamaForCausalLM, ids: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Per tensor, the largest difference between the fp32 gradients ``model`` holds and float64
    gradients at the same weights: how much rounding an fp32 backward carries, in any order of operations."""
    exact = copy.deepcopy(model).double()
    exact.zero_grad(set_to_none=True)
    reference_loss(exact, ids, targets).backward()
    return {name: (p.grad.double() - p64.grad).abs().max().item()
            for (name, p), p64 in zip(model.named_parameters(), exact.parameters())}


def reference_step(model, opt, lr: float, ids, targets,  # noqa: ANN001
                   slack: dict[str, torch.Tensor] | None = None) -> tuple[float, float]:
    """One plain step. ``slack``, if given, accumulates per element how far two fp32 runs may drift apart:
    Adam divides by sqrt(v), so a gradient error e moves an element's update by up to about
    lr * e / (sqrt(v_hat) + eps), which is large only where that element's gradients are near zero
    (there a last-bit difference can flip the sign of a whole lr-sized step)."""
    opt.zero_grad()
    loss = reference_loss(model, ids, targets)
    loss.backward()
    rounding = gradient_rounding(model, ids, targets) if slack is not None else None
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    coef = min(1.0, CLIP / (norm.item() + 1e-6))
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()
    if slack is not None:
        for name, p in model.named_parameters():
            state = opt.state[p]
            denom = (state["exp_avg_sq"] / (1 - BETAS[1] ** int(state["step"]))).sqrt() + EPS
            # An element whose gradient is exactly zero (an embedding row no token used) sums no terms: no slack.
            slack[name] += GRAD_ERROR_MARGIN * lr * coef * rounding[name] / denom * (p.grad != 0)
    return loss.item(), norm.item()


def batches(n: int, bsz: int, seq: int, vocab: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (bsz, seq + 1), generator=gen)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


FINETUNE_WORDS = "print return import class lambda yield while async await".split()


def finetune_records(count: int, seed: int = 0) -> list[dict]:
    """Seeded fine-tuning records of a few words each: two chats (some with a system turn, some with
    two answers) for every prompt/completion pair."""
    gen = torch.Generator().manual_seed(seed)

    def say(most: int) -> str:
        n = int(torch.randint(1, most + 1, (), generator=gen))
        return " ".join(FINETUNE_WORDS[int(i)] for i in torch.randint(0, len(FINETUNE_WORDS), (n,), generator=gen))

    out: list[dict] = []
    for index in range(count):
        if index % 3 == 2:
            out.append({"prompt": say(3), "completion": say(2)})
        else:
            turns = [{"role": "system", "content": say(2)}] if index % 2 else []
            turns += [{"role": "user", "content": say(3)}, {"role": "assistant", "content": say(2)}]
            if index % 4 == 0:
                turns += [{"role": "user", "content": say(2)}, {"role": "assistant", "content": say(2)}]
            out.append({"messages": turns})
    return out


def write_jsonl(path: Path, records: list) -> Path:
    """One line per record: dicts as JSON, strings as they are (for lines that are not JSON)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def reference_masked_step(model: LlamaForCausalLM, examples) -> tuple[float, dict[str, float]]:  # noqa: ANN001
    """Each example (``finetune_data.Encoded``) alone from position 0: its cross-entropy summed over
    its trained targets; the loss is the sum over all examples over their count. Returns it and the
    squared gradient norm of each trainer unit (``extras``, ``layer.<i>``), gradients left in ``model``."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    total, count = torch.zeros((), device=device), 0
    for example in examples:
        ids = torch.tensor(example.ids[:-1], device=device)[None]
        targets = torch.tensor([t if m else -100 for t, m in zip(example.ids[1:], example.trained[1:])],
                               device=device)
        logits = reference_forward(model, ids)
        total = total + F.cross_entropy(logits[0].float(), targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    loss = total / count
    loss.backward()
    norms: dict[str, float] = {}
    for name, p in model.named_parameters():
        unit = f"layer.{name.split('.')[2]}" if name.startswith("model.layers.") else "extras"
        norms[unit] = norms.get(unit, 0.0) + p.grad.double().pow(2).sum().item()
    return loss.item(), norms


def allocation_peak(prof) -> int:  # noqa: ANN001 - a finished torch.profiler.profile(profile_memory=True)
    """The most bytes the CPU allocator held at once over ``prof``'s window (its memory events in order)."""
    live = peak = 0
    for event in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def packed_rows(seq: int, rows: int, seed: int) -> torch.Tensor:
    """``rows`` packed rows of ``seq`` segment ids: examples of lengths around and across the 128-token
    tiles (1 to 700 tokens), some rows ending in padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 3, 50, 127, 128, 129, 200, 256, 300, 700])
    out = []
    for _ in range(rows):
        row, example = [], 0
        while len(row) < seq:
            if torch.rand((), generator=gen) < 0.1:
                row += [-1] * (seq - len(row))
                break
            row += [example] * int(lengths[torch.randint(len(lengths), (), generator=gen)])
            example += 1
        out.append(row[:seq])
    return torch.tensor(out)


def rule_block_mask(segments: torch.Tensor) -> BlockMask:
    """The block mask FlexAttention makes by evaluating the packed rows' rule (a query sees the keys
    of its own example up to itself) on every (query, key) pair, on the segments' device."""

    def same_example(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return (segments[b, q_idx] == segments[b, kv_idx]) & (kv_idx <= q_idx)

    return create_block_mask(same_example, segments.shape[0], None, segments.shape[1], segments.shape[1],
                             device=segments.device)


def assert_same_block_mask(built: BlockMask, evaluated: BlockMask, segments: torch.Tensor) -> None:
    """Same tiles, partial and full, on both sides (the backward's), in the same order."""
    assert built.seq_lengths == evaluated.seq_lengths
    for side in ("kv", "full_kv", "q", "full_q"):
        for part in ("num_blocks", "indices"):
            got, want = getattr(built, f"{side}_{part}"), getattr(evaluated, f"{side}_{part}")
            assert torch.equal(got, want), f"{side}_{part} differ at seq {segments.shape[1]}: {segments.tolist()}"
