"""What bringing a preempted sequence back costs, by recompute or by swap: the rule by which the
scheduler picks one for each victim (``preemption_mode`` "auto", see the scheduler's docstring).

- Recompute re-prefills the tokens the victim had computed, except those of its blocks the prefix
  cache keeps: 2 FLOPs per decoder weight per token (the LM head runs for the last token only and
  the embedding is a lookup, so neither counts) plus attention, 4 · layers · query heads · head_dim
  FLOPs per (query, key) pair of the causal triangle, at the device's compute rate.
- Swap copies the victim's private, uncached blocks to host memory and back: 2 · their bytes at
  the host link's rate.

So a short sequence recomputes (a few tokens cost less to run again than a whole block costs to
copy twice) and a long one swaps (recompute grows with every token, quadratically through
attention; the copy only with its blocks). Both rates are effective, not peak, and fixed per
device type (``ModelRunner.compute_flops_per_s`` / ``copy_bytes_per_s``): nothing is measured.
The scheduler gets :meth:`PreemptionCosts.swap_is_cheaper`, not the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.model.config import ModelConfig


@dataclass(frozen=True)
class PreemptionCosts:
    """Seconds to bring a preempted sequence back, by re-prefilling it or by a swap out and in."""

    flops_per_token: float  # the decoder's matmuls, per token
    attention_flops_per_pair: float  # scores and weighted values, per (query, key) pair
    block_bytes: int  # one KV block, every layer, K and V
    compute_flops_per_s: float
    copy_bytes_per_s: float

    @classmethod
    def for_model(cls, config: ModelConfig, block_bytes: int, compute_flops_per_s: float,
                  copy_bytes_per_s: float) -> PreemptionCosts:
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        per_layer = (config.hidden_size * (2 * q_width + 2 * kv_width)  # q, k, v and o projections
                     + 3 * config.hidden_size * config.intermediate_size)  # gate, up and down
        return cls(flops_per_token=2.0 * config.num_layers * per_layer,
                   attention_flops_per_pair=4.0 * config.num_layers * q_width,
                   block_bytes=block_bytes, compute_flops_per_s=compute_flops_per_s,
                   copy_bytes_per_s=copy_bytes_per_s)

    def recompute_s(self, num_tokens: int, num_cached_tokens: int = 0) -> float:
        """Seconds to prefill ``num_tokens`` tokens after ``num_cached_tokens`` cached ones (token
        ``p`` attends to ``p + 1`` positions)."""
        end = num_cached_tokens + num_tokens
        pairs = (end * (end + 1) - num_cached_tokens * (num_cached_tokens + 1)) // 2
        return (self.flops_per_token * num_tokens + self.attention_flops_per_pair * pairs) / self.compute_flops_per_s

    def swap_s(self, num_blocks: int) -> float:
        """Seconds to copy ``num_blocks`` blocks to the host and back."""
        return 2.0 * num_blocks * self.block_bytes / self.copy_bytes_per_s

    def swap_is_cheaper(self, num_recompute_tokens: int, num_cached_tokens: int, num_copy_blocks: int) -> bool:
        """Whether copying ``num_copy_blocks`` blocks out and back costs less than re-prefilling
        ``num_recompute_tokens`` tokens after ``num_cached_tokens`` cached ones (a tie recomputes:
        it holds no host memory)."""
        return self.swap_s(num_copy_blocks) < self.recompute_s(num_recompute_tokens, num_cached_tokens)
