"""The layer rule, checked in fresh interpreters: what runs no model loads no torch.

docs/architecture.md states the rule: the wire protocol imports neither torch nor the engine, and
the router, the KV-store's service side, the HTTP frontend and ``tandem.client`` need no torch. Each case imports its
modules in a new Python process (this one has torch loaded already) and lists what it pulled in.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# The model package's ``config`` and ``meta`` are plain data (the router reads a model's shape and
# tokenizer); every other compute module is forbidden.
FORBIDDEN = ("torch", "triton", "numpy", "safetensors", "tandem.shared.engine", "tandem.shared.kvcache",
             "tandem.shared.train", "tandem.shared.model.llama", "tandem.shared.model.loader",
             "tandem.shared.model.presets", "tandem.shared.model.reference", "tandem.shared.model.triton_ops")

CASES = {
    "protocol": ["tandem.shared.protocol.codec", "tandem.shared.kvtransfer.frames", "tandem.shared.protocol.subjects",
                 "tandem.shared.protocol.block_hashes"],
    "client": ["tandem.client"],
    "router": ["tandem.services.router.service"],
    "kvstore service side": ["tandem.services.kvstore.service"],
    "frontend": ["tandem.services.frontend.service"],
    "text": ["tandem.shared.text.tokenizer", "tandem.shared.text.chat_template"],
}
# What the text layer may load of tandem's own packages: itself and the wire protocol below it.
TEXT_LAYER_MAY_LOAD = ("tandem.shared.text", "tandem.shared.protocol")

PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(modules: list[str]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing {modules} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout)


@pytest.mark.parametrize("case", CASES)
def test_imports_no_torch_and_no_compute_layer(case):
    loaded = loaded_modules(CASES[case])
    bad = sorted({f for f in FORBIDDEN for m in loaded if m == f or m.startswith(f + ".")})
    assert not bad, f"{case} ({', '.join(CASES[case])}) loads {', '.join(bad)}"


def test_text_layer_imports_only_the_layers_below_it():
    """The chat template is shared by the front end and the trainer: it must stay in the text layer."""
    loaded = loaded_modules(CASES["text"])
    ours = [m for m in loaded if m.startswith("tandem.") and m != "tandem.shared"]
    above = sorted(m for m in ours if not m.startswith(TEXT_LAYER_MAY_LOAD))
    assert not above, f"the text layer ({', '.join(CASES['text'])}) loads {', '.join(above)}"


def test_the_probe_sees_torch_where_it_is_used():
    """The check above can fail: a worker's module does load torch."""
    assert "torch" in loaded_modules(["tandem.services.common.worker"])
