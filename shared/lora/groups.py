"""How adapter targets map onto the serving model's matmuls: one group per matmul (q/k/v and
gate/up run fused on a GPU), each group's output being its targets' outputs end to end."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.shared.lora.peft_format import projection_shapes
from tandem.shared.model.config import ModelConfig


@dataclass(frozen=True)
class LoraGroup:
    name: str  # "qkv", "o", "gate_up", "down"
    targets: tuple[str, ...]  # PEFT target names, in the order their outputs are concatenated
    in_features: int
    out_sizes: tuple[int, ...]  # each target's out features

    @property
    def out_features(self) -> int:
        return sum(self.out_sizes)

    def out_offsets(self) -> tuple[int, ...]:
        """Where each target's columns start in the group's output."""
        offsets, start = [], 0
        for size in self.out_sizes:
            offsets.append(start)
            start += size
        return tuple(offsets)


GROUP_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}


def lora_groups(config: ModelConfig) -> dict[str, LoraGroup]:
    shapes = projection_shapes(config)
    return {name: LoraGroup(name, targets, shapes[targets[0]][1], tuple(shapes[t][0] for t in targets))
            for name, targets in GROUP_TARGETS.items()}
