"""PEFT's LoRA format on disk (``adapter_config.json`` + ``adapter_model.safetensors``), read and written.

What tandem serves and trains: plain LoRA (no DoRA, no bias, no extra saved modules) on the decoder
layers' seven projections. Reading the config and checking the tensors' shapes needs no torch (the
safetensors header is JSON), so the router and front end refuse a bad adapter with the workers' rules;
loading the tensors does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from tandem.shared.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on its JSON header
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may sit before .weight)
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[\w-]+)?\.weight$")
# Config keys whose non-default values change what the adapter computes, with the value tandem computes.
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
                "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "layer_replication": None,
                "lora_bias": False, "use_qalora": False}


class AdapterError(ValueError):
    """An adapter tandem cannot load or serve; the message is one line naming what to change."""


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says that serving and training need."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # of TARGETS, in TARGETS' order
    use_rslora: bool = False
    base_model: str = ""  # base_model_name_or_path, as written (informational)

    @property
    def scaling(self) -> float:
        """The factor on B·A: alpha/r, or alpha/√r with rank-stabilized LoRA (as PEFT computes it)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def to_peft_dict(self) -> dict[str, Any]:
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": list(self.targets), "use_rslora": self.use_rslora, "lora_dropout": 0.0,
                "bias": "none", "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
                "init_lora_weights": True, "base_model_name_or_path": self.base_model, "inference_mode": True}


def read_adapter_config(path: str | os.PathLike) -> AdapterConfig:
    """The adapter directory's config; :class:`AdapterError` when it is missing or asks for what
    tandem does not compute."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"adapter directory {folder} does not exist")
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder} has no {CONFIG_FILE}: give a PEFT LoRA adapter directory") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{folder / CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{folder / CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder} is a {raw.get('peft_type')} adapter; tandem serves LoRA adapters only")
    for key, plain in _UNSUPPORTED.items():
        value = raw.get(key, plain)
        if value != plain and not (plain in (None, {}) and not value):
            raise AdapterError(f"{folder}: {key}={value!r} is not supported; tandem serves plain LoRA "
                               f"({key}={plain!r})")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{folder}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # PEFT also takes a regex over module names, or "all-linear"
        targets = TARGETS if targets == "all-linear" else [t for t in TARGETS if re.search(targets, t)]
    if not isinstance(targets, list) or not targets:
        raise AdapterError(f"{folder}: target_modules must name some of {', '.join(TARGETS)}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise AdapterError(f"{folder}: target {unknown[0]!r} is not a projection of this model; "
                           f"targets are {', '.join(TARGETS)}")
    return AdapterConfig(rank=rank, alpha=float(alpha), targets=tuple(t for t in TARGETS if t in targets),
                         use_rslora=bool(raw.get("use_rslora", False)),
                         base_model=str(raw.get("base_model_name_or_path") or ""))


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target's (out features, in features) in the base model (one rank's share is not asked)."""
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q_out, hidden), "k_proj": (kv_out, hidden), "v_proj": (kv_out, hidden),
            "o_proj": (hidden, q_out), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def _safetensors_header(file: Path) -> dict[str, Any]:
    try:
        with open(file, "rb") as handle:
            size_bytes = handle.read(8)
            if len(size_bytes) != 8:
                raise AdapterError(f"{file} is not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", size_bytes)
            if size > MAX_HEADER_BYTES:
                raise AdapterError(f"{file} is not a safetensors file (header of {size} bytes)")
            header = json.loads(handle.read(size))
    except FileNotFoundError:
        raise AdapterError(f"{file.parent} has no {WEIGHTS_FILE}: give a PEFT LoRA adapter directory") from None
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file} is not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{file} is not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    return header


def _adapter_keys(file: Path, names: list[str]) -> dict[tuple[int, str, str], str]:
    """(layer, target, "A"|"B") -> tensor name, for every tensor of ``file``; AdapterError on others."""
    keys: dict[tuple[int, str, str], str] = {}
    for name in names:
        match = _KEY.match(name)
        if match is None:
            raise AdapterError(f"{file}: tensor {name!r} is not a LoRA weight of a decoder projection")
        layer, _, target, side = match.groups()
        keys[(int(layer), target, side)] = name
    return keys


def check_adapter(path: str | os.PathLike, config: ModelConfig, max_rank: int | None = None) -> AdapterConfig:
    """The adapter's config once its tensors are known to fit ``config``'s model (names, shapes, every
    layer of every target present) and its rank ``max_rank``; reads only the safetensors header."""
    adapter = read_adapter_config(path)
    folder = Path(path)
    if max_rank is not None and adapter.rank > max_rank:
        raise AdapterError(f"{folder}: rank {adapter.rank} is above the limit {max_rank}; raise --max-lora-rank")
    header = _safetensors_header(folder / WEIGHTS_FILE)
    keys = _adapter_keys(folder / WEIGHTS_FILE, list(header))
    shapes = projection_shapes(config)
    for (layer, target, side), name in keys.items():
        if layer >= config.num_layers:
            raise AdapterError(f"{folder}: tensor {name!r} is for layer {layer}; the model has {config.num_layers}")
        if target not in adapter.targets:
            raise AdapterError(f"{folder}: tensor {name!r} is for {target}, which target_modules does not list")
        out_features, in_features = shapes[target]
        want = [adapter.rank, in_features] if side == "A" else [out_features, adapter.rank]
        if list(header[name].get("shape", [])) != want:
            raise AdapterError(f"{folder}: {name} has shape {header[name].get('shape')}, the model needs {want}")
    for target in adapter.targets:
        for layer in range(config.num_layers):
            for side in "AB":
                if (layer, target, side) not in keys:
                    raise AdapterError(f"{folder}: no lora_{side} for {target} of layer {layer}")
    return adapter


def adapter_digest(path: str | os.PathLike) -> str:
    """A short content hash of the adapter's files: its version when none is given, so two different
    adapters published under one name never share cached KV."""
    digest = hashlib.blake2b(digest_size=8)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            digest.update((Path(path) / file).read_bytes())
        except OSError as exc:
            raise AdapterError(f"cannot read {Path(path) / file} ({exc.strerror})") from None
    return digest.hexdigest()


@dataclass
class LoraWeights:
    """One adapter's tensors: ``a[(layer, target)]`` is ``[rank, in]``, ``b[(layer, target)]``
    ``[out, rank]``, as PEFT stores them (the scaling is not folded in)."""

    config: AdapterConfig
    a: dict[tuple[int, str], torch.Tensor]
    b: dict[tuple[int, str], torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a.values(), *self.b.values()))


def load_adapter(path: str | os.PathLike, config: ModelConfig, max_rank: int | None = None,
                 dtype: torch.dtype | None = None) -> LoraWeights:
    """Check the adapter against ``config`` (see :func:`check_adapter`) and read its tensors on CPU."""
    from safetensors import safe_open

    adapter = check_adapter(path, config, max_rank)
    file = Path(path) / WEIGHTS_FILE
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for (layer, target, side), name in _adapter_keys(file, list(handle.keys())).items():
                tensor = handle.get_tensor(name)
                (a if side == "A" else b)[(layer, target)] = tensor if dtype is None else tensor.to(dtype)
    except (OSError, RuntimeError, ValueError) as exc:  # a truncated file passes the header check
        raise AdapterError(f"{file} cannot be read ({str(exc).splitlines()[0]})") from None
    return LoraWeights(adapter, a, b)


PUBLISHED_DIR = "published"


def snapshot_adapter(path: str | os.PathLike, version: str) -> Path:
    """A copy of the adapter in ``path`` under ``path/published/<version>``, for serving: a training run
    overwrites its adapter at every checkpoint, while a published version must stay as it was."""
    import shutil

    folder = Path(path) / PUBLISHED_DIR / version
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        shutil.copyfile(Path(path) / name, staging / name)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(staging, folder)
    return folder


def save_adapter(path: str | os.PathLike, weights: LoraWeights) -> Path:
    """Write ``weights`` in PEFT's format: the tensors first, the config last, each through a rename,
    so a reader that finds the config finds whole tensors."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for (layer, target), tensor in weights.a.items():
        group = "self_attn" if target in ATTENTION_TARGETS else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{group}.{target}"
        tensors[f"{prefix}.lora_A.weight"] = tensor.detach().cpu().contiguous()
        tensors[f"{prefix}.lora_B.weight"] = weights.b[(layer, target)].detach().cpu().contiguous()
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / WEIGHTS_FILE)
    tmp = folder / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(weights.config.to_peft_dict(), indent=2) + "\n")
    os.replace(tmp, folder / CONFIG_FILE)
    return folder
