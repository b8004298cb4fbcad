"""Loading a local Hugging Face checkpoint: config and tokenizer via transformers, weights via safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..errors import ModelLoadError
from .registry import Architecture, architecture_for, supported_architectures

SUPPORTED_ARCHITECTURES = tuple(supported_architectures())
_PROGRESS_MIN_BYTES = 512 * 2**20  # show a progress bar only for checkpoints worth waiting on


def check_model_dir(path: str | Path) -> Path:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory (only local checkpoints are loaded)")
    if not (root / "config.json").is_file():
        raise ModelLoadError(f"{root} has no config.json: not a Hugging Face checkpoint directory")
    return root.resolve()


def load_hf_config(root: Path):
    """The transformers config, refusing architectures this engine does not implement."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(root, local_files_only=True)
    architecture_for(config)  # refuses architectures (and variants) this engine does not implement
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {config.hidden_act!r} (only silu)")
    return config


def load_tokenizer(root: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(root, local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"cannot load the tokenizer from {root}: {exc}") from exc


def safetensors_files(root: Path) -> list[Path]:
    """The weight files of a checkpoint: from the shard index if there is one."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{root} holds no *.safetensors weights (pickled .bin files are not read)")
    return files


def load_weights(model, root: Path, arch: Architecture) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter, as ``arch.fused`` places
    them; every parameter (and every slice of a fused one) must be covered."""
    params = dict(model.named_parameters())
    filled: set[str] = set()
    files = safetensors_files(root)
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
              disable=total < _PROGRESS_MIN_BYTES) as progress:
        for file in files:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    target = _copy_tensor(model, params, name, tensor, arch.fused)
                    if target:
                        filled.add(target)
                    progress.update(tensor.numel() * tensor.element_size())
    missing = sorted(_expected_pieces(params, arch.fused) - filled)
    if missing:
        raise ModelLoadError(f"checkpoint {root} lacks weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _copy_tensor(model, params: dict, name: str, tensor: torch.Tensor, fused_map: dict) -> str | None:
    if "rotary_emb" in name or (name == "lm_head.weight" and model.shape.tie_word_embeddings):
        return None
    for hf_name, (fused, part) in fused_map.items():
        if f".{hf_name}." in name:
            target = name.replace(hf_name, fused)
            _check_known(params, target, name)
            param = params[target]
            start, size = _slice_of(model, fused, part, param.shape[0])
            _assign(param.data[start:start + size], tensor, name)
            return f"{target}:{part}"
    _check_known(params, name, name)
    _assign(params[name].data, tensor, name)
    return name


def _expected_pieces(params: dict, fused_map: dict) -> set[str]:
    """Names every checkpoint must fill: one per plain parameter, one per slice of a parameter the
    checkpoint stores in pieces (``fused_map``), one for a parameter it stores fused already."""
    parts: dict[str, list] = {}
    for fused, part in fused_map.values():
        parts.setdefault(fused, []).append(part)
    pieces = set()
    for name in params:
        module = name.split(".")[-2] if "." in name else ""
        if module in parts:
            pieces.update(f"{name}:{part}" for part in parts[module])
        else:
            pieces.add(name)
    return pieces


def _slice_of(model, fused: str, part, rows: int) -> tuple[int, int]:
    shape = model.shape
    if fused == "gate_up_proj":
        half = rows // 2
        return part * half, half
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[part]


def _check_known(params: dict, target: str, name: str) -> None:
    if target not in params:
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (no matching parameter)")


def _assign(destination: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if destination.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
    destination.copy_(tensor)
