"""Loading a local Hugging Face checkpoint: config and tokenizer via transformers, weights via safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..errors import ModelLoadError
from .llama import LlamaFamilyModel

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_PROGRESS_MIN_BYTES = 512 * 2**20  # show a progress bar only for checkpoints worth waiting on

# Hugging Face projection name -> (our fused parameter, which slice of it)
_FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


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
    architectures = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in architectures):
        raise ModelLoadError(
            f"unsupported architecture {architectures or getattr(config, 'model_type', '?')}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
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


def load_weights(model: LlamaFamilyModel, root: Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; all must be covered."""
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
                    target = _copy_tensor(model, params, name, tensor)
                    if target:
                        filled.add(target)
                    progress.update(tensor.numel() * tensor.element_size())
    missing = sorted(_expected_pieces(params) - filled)
    if missing:
        raise ModelLoadError(f"checkpoint {root} lacks weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _copy_tensor(model: LlamaFamilyModel, params: dict, name: str, tensor: torch.Tensor) -> str | None:
    if "rotary_emb" in name or (name == "lm_head.weight" and model.shape.tie_word_embeddings):
        return None
    for hf_name, (fused, part) in _FUSED.items():
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


def _expected_pieces(params: dict) -> set[str]:
    """Names every checkpoint must fill: one per plain parameter, one per slice of a fused one."""
    pieces = set()
    for name in params:
        if ".qkv_proj." in name:
            pieces.update(f"{name}:{part}" for part in ("q", "k", "v"))
        elif ".gate_up_proj." in name:
            pieces.update(f"{name}:{part}" for part in (0, 1))
        else:
            pieces.add(name)
    return pieces


def _slice_of(model: LlamaFamilyModel, fused: str, part, rows: int) -> tuple[int, int]:
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
