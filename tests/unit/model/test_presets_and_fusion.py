"""What the decode fast path builds on and runs everywhere: fused q/k/v and gate/up projections give
the same logits and keep every checkpoint name; random presets build the same weights in every load."""

from __future__ import annotations

import pytest
import torch

from tandem.shared.model.loader import load_model
from tandem.shared.model.meta import load_model_meta
from tandem.shared.model.reference import reference_logits


def test_fused_projections_keep_logits_and_names() -> None:
    loaded = load_model("random:llama-test")
    ids = list(range(40, 90))
    before = reference_logits(loaded.model, ids)
    names = set(loaded.model.state_dict())
    loaded.model.fuse_projections()
    fused_weight = loaded.model.model.layers[0].self_attn.qkv_proj.weight
    loaded.model.fuse_projections()  # a second engine on the same model fuses nothing again
    assert loaded.model.model.layers[0].self_attn.qkv_proj.weight is fused_weight
    torch.testing.assert_close(reference_logits(loaded.model, ids), before, atol=1e-5, rtol=1e-5)
    assert names <= set(loaded.model.state_dict()), "fusing must keep every Hugging Face name loadable"
    attn = loaded.model.model.layers[0].self_attn
    attn.k_proj.weight.mul_(0)  # loading into a view writes through to the fused weight
    q_rows = attn.q_proj.weight.shape[0]
    assert attn.qkv_proj.weight[q_rows : q_rows + attn.k_proj.weight.shape[0]].abs().sum() == 0


def test_random_preset_is_the_same_in_every_load() -> None:
    first, second = load_model("random:llama-test"), load_model("random:llama-test")
    for (name, a), b in zip(first.model.named_parameters(), second.model.parameters()):
        assert torch.equal(a, b), f"{name} differs between two loads of the same preset"
    meta = load_model_meta("random:llama3-8b")
    assert (meta.config.hidden_size, meta.config.num_layers, meta.config.vocab_size) == (4096, 32, 128256)
    assert meta.tokenizer.decode([104, 105, 5000]) == "hi t5000"


@pytest.mark.parametrize("spec", ["random:nope", "random:"])
def test_unknown_preset_is_a_clear_error(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown random model"):
        load_model_meta(spec)
