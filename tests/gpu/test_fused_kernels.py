"""The fused CUDA forward's Triton kernels against the PyTorch modules they stand in for.

``shared/model/triton_ops.py`` replaces RoPE plus the K/V cache write, residual add plus RMSNorm and
SiLU times up with one kernel each; the whole fused forward is checked against Hugging Face by
tests/gpu/test_gpu_parity.py. These check each kernel alone, over the head layouts and block sizes
a model can bring, so a change to a kernel's tiling is caught at the kernel.
"""

from __future__ import annotations

import pytest
import torch

from tandem.shared.kvcache.attention import write_kv_cache
from tandem.shared.kvcache.cache import allocate_kv_cache
from tandem.shared.kvcache.triton_attention import HAS_TRITON
from tandem.shared.model.config import ModelConfig
from tandem.shared.model.llama import RotaryEmbedding, apply_rope

requires_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("tokens", [1, 37, 4096])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (8, 8, 64), (14, 2, 64),
                                                                       (12, 4, 96)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_rope_and_cache_is_the_modules_rope_and_cache_write(tokens: int, num_q_heads: int, num_kv_heads: int,
                                                            head_dim: int, block_size: int) -> None:
    from tandem.shared.model.triton_ops import rope_and_cache

    torch.manual_seed(0)
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=num_q_heads * head_dim,
                         intermediate_size=64, num_layers=2, num_heads=num_q_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, max_position_embeddings=8192)
    cos, sin = (t.cuda() for t in RotaryEmbedding.build_tables(config))
    qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=torch.bfloat16, device="cuda")
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    num_blocks = -(-tokens // block_size) + 3
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    fused_cache = allocate_kv_cache(num_blocks, 2, block_size, num_kv_heads, head_dim, torch.bfloat16, "cuda")
    module_cache = fused_cache.clone()

    q = rope_and_cache(qkv, positions, cos, sin, num_q_heads, num_kv_heads, fused_cache, 1, slots)

    q_ref, k_ref, v_ref = qkv.float().split([num_q_heads * head_dim, num_kv_heads * head_dim,
                                             num_kv_heads * head_dim], -1)
    rotate = [apply_rope(x.view(tokens, -1, head_dim), cos[positions], sin[positions]) for x in (q_ref, k_ref)]
    write_kv_cache(rotate[1], v_ref.view(tokens, num_kv_heads, head_dim), module_cache, 1, slots)
    # The kernel rotates in float32 and rounds once; the reference rotates bf16 inputs in float32 too.
    torch.testing.assert_close(q.float(), rotate[0], atol=1e-2, rtol=1e-2,
                               msg="rotated q differs from apply_rope's")
    torch.testing.assert_close(fused_cache.float(), module_cache.float(), atol=1e-2, rtol=1e-2,
                               msg="the cache's K/V differ from apply_rope + write_kv_cache's")
    assert torch.equal(fused_cache[:, 0], module_cache[:, 0]), "another layer's cache was written"
    assert torch.equal(fused_cache[:, 1, 1], module_cache[:, 1, 1]), "V is copied, never rounded"
