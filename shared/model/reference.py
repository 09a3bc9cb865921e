"""Reference forward and greedy generation: the parity oracle for the paged serving path.

This re-runs the decoder layer by layer with the model's own projections, norms and RoPE tables,
but keeps K/V in a plain contiguous tensor per layer and attends with torch SDPA and an explicit
causal mask. It never touches paged_attention, block tables or slot mappings, so comparing it
with the engine checks the whole paged KV path. Simplicity over speed: it is for tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tandem.shared.model.llama import LlamaForCausalLM

# Per layer: (keys [Hkv, S, D], values [Hkv, S, D]) for the S tokens seen so far.
LayerCache = list[tuple[torch.Tensor, torch.Tensor]]


def _device(model: LlamaForCausalLM) -> torch.device:
    return model.model.embed_tokens.weight.device


@torch.no_grad()
def _forward_chunk(model: LlamaForCausalLM, input_ids: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """Run tokens [T] that follow the cached ones; extends `cache` in place; returns float32 logits [T, vocab]."""
    return model.compute_logits(_hidden_chunk(model, input_ids, cache))


@torch.no_grad()
def _hidden_chunk(model: LlamaForCausalLM, input_ids: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """As :func:`_forward_chunk`, returning the final norm's output [T, hidden] (what feeds the LM head)."""
    inner = model.model
    num_cached = cache[0][0].shape[1] if cache else 0
    num_new = input_ids.shape[0]
    positions = torch.arange(num_cached, num_cached + num_new, device=input_ids.device)
    cos, sin = inner.rotary_emb(positions)
    # Query i (absolute position num_cached+i) may see keys 0..num_cached+i.
    key_positions = torch.arange(num_cached + num_new, device=input_ids.device)
    mask = key_positions[None, :] <= positions[:, None]
    x = inner.embed_tokens(input_ids)
    for layer_idx, layer in enumerate(inner.layers):
        attn = layer.self_attn
        q, k, v = attn.project_qkv(layer.input_layernorm(x), cos, sin)
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
        if len(cache) > layer_idx:
            old_k, old_v = cache[layer_idx]
            k, v = torch.cat((old_k, k), dim=1), torch.cat((old_v, v), dim=1)
            cache[layer_idx] = (k, v)
        else:
            cache.append((k, v))
        group = attn.num_heads // attn.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(group, dim=0),
            v.repeat_interleave(group, dim=0),
            attn_mask=mask,
            scale=attn.scaling,
        )  # [Hq, T, D]
        x = x + attn.o_proj(out.transpose(0, 1).reshape(num_new, attn.num_heads * attn.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)


@torch.no_grad()
def reference_logits(model: LlamaForCausalLM, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Full-sequence causal forward: token ids [T] -> float32 logits [T, vocab]."""
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=_device(model))
    return _forward_chunk(model, input_ids, [])


@torch.no_grad()
def reference_hidden_states(model: LlamaForCausalLM, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Full-sequence causal forward: token ids [T] -> the final norm's output [T, hidden] (what
    embeddings pool)."""
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=_device(model))
    return _hidden_chunk(model, input_ids, [])


@torch.no_grad()
def reference_generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with a contiguous KV cache.

    Returns (generated ids, per-step logits), where step_logits[i] is the float32 CPU row [vocab]
    from which generated id i was chosen. Stops early only when given eos_token_ids (the EOS token
    is included in the output); by default it runs max_new_tokens steps, like ignore_eos.
    """
    if not prompt_ids:
        raise ValueError("reference_generate needs at least one prompt token")
    device = _device(model)
    cache: LayerCache = []
    logits = _forward_chunk(model, torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device), cache)[-1]
    generated: list[int] = []
    step_logits: list[torch.Tensor] = []
    stop_ids = set(eos_token_ids)
    for _ in range(max_new_tokens):
        token = int(torch.argmax(logits).item())
        generated.append(token)
        step_logits.append(logits.float().cpu())
        if token in stop_ids or len(generated) == max_new_tokens:
            break
        logits = _forward_chunk(model, torch.tensor([token], dtype=torch.long, device=device), cache)[-1]
    return generated, step_logits
