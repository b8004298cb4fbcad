"""Loading a local Hugging Face checkpoint: config and tokenizer via transformers, weights via safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..errors import ModelLoadError
from .gguf_weights import QuantizedRows
from .quantization import Int8Slot
from .registry import Architecture, architecture_for, supported_architectures
from .source import ModelSource

SUPPORTED_ARCHITECTURES = tuple(supported_architectures())
_PROGRESS_MIN_BYTES = 512 * 2**20  # show a progress bar only for checkpoints worth waiting on


def load_hf_config(root: Path, model_impl: str = "auto"):
    """The transformers config, refusing architectures (and variants) this engine cannot run."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) or _asks_for_remote_code(root):
            raise ModelLoadError(f"{root}: this checkpoint's architecture is defined by code shipped with it "
                                 "(trust_remote_code), which asyncllm does not run; use a checkpoint whose "
                                 "architecture transformers implements") from exc
        raise ModelLoadError(f"cannot read the config of {root}: {exc}") from exc
    architecture_for(config, model_impl)
    return config


def _asks_for_remote_code(root: Path) -> bool:
    try:
        return "auto_map" in json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return False


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


def iter_safetensors(root: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint, by name, one at a time."""
    files = safetensors_files(root)
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
              disable=total < _PROGRESS_MIN_BYTES) as progress:
        for file in files:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    tensor = reader.get_tensor(name)
                    yield name, tensor
                    progress.update(tensor.numel() * tensor.element_size())


def checkpoint_tensors(model, source: ModelSource, keep_q8_0: bool = False,
                       shape=None) -> Iterator[tuple[str, object]]:
    """The tensors of ``source`` by Hugging Face name: safetensors files, or a GGUF file
    (``shape``: the whole model's, when ``model`` is one rank's shard)."""
    if source.gguf_file is None:
        return iter_safetensors(source.root)
    from .gguf_weights import iter_gguf_tensors
    from .source import gguf_tensor_table

    shape = shape or model.shape
    return iter_gguf_tensors(source.gguf_file, gguf_tensor_table(source), shape.num_heads, shape.num_kv_heads,
                             keep_q8_0, type(model).gguf_architectures, type(model).gguf_names)


def load_weights(model, source: ModelSource | Path, arch: Architecture, keep_q8_0: bool = False,
                 sharding=None) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter, as ``arch.fused`` places
    them; every parameter (and every slice of a fused one) must be covered. Projections replaced by
    int8 slots (model/quantization.py) take float tensors (quantized as they arrive) or int8 rows.
    ``sharding`` (distributed/sharding.py): a tensor-parallel rank's cut, applied to each tensor
    as it arrives, so no rank holds more than its shard plus one checkpoint tensor."""
    if isinstance(source, Path):
        source = ModelSource(source)
    targets = _load_targets(model)
    filled: set[str] = set()
    shape = sharding.shape if sharding is not None else None
    for name, tensor in checkpoint_tensors(model, source, keep_q8_0, shape):
        target = _copy_tensor(model, targets, name, tensor, arch.fused, sharding, source.is_gguf)
        if target:
            filled.add(target)
    missing = sorted(_expected_pieces(targets, arch.fused) - filled)
    if missing:
        raise ModelLoadError(f"checkpoint {source.name or source.root} lacks weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _load_targets(model) -> dict:
    """Parameter name -> parameter, plus ``<slot>.weight`` -> the int8 slot for quantized projections."""
    targets: dict = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, Int8Slot):
            targets[f"{name}.weight"] = module
    return targets


def _renamed(name: str, renames: dict[str, str]) -> str:
    """``name`` with each dotted segment the family renames replaced (one pass: renames do not chain)."""
    if not renames:
        return name
    return ".".join(renames.get(part, part) for part in name.split("."))


def _copy_tensor(model, params: dict, name: str, tensor, fused_map: dict, sharding=None,
                 from_gguf: bool = False) -> str | None:
    if "rotary_emb" in name or (name == "lm_head.weight" and model.shape.tie_word_embeddings):
        return None
    name = _renamed(name, getattr(model, "renamed", {}))
    if isinstance(tensor, torch.Tensor):
        tensor = model.prepare_weight(name, tensor, from_gguf)
    for hf_name, (fused, part) in fused_map.items():
        if f".{hf_name}." in name:
            target = name.replace(hf_name, fused)
            _check_known(params, target, name)
            if sharding is not None:
                tensor = sharding.shard(target, part, tensor)
            param = params[target]
            start, size = _slice_of(model, fused, part, _rows(param))
            _assign_rows(param, start, size, tensor, name)
            return f"{target}:{part}"
    _check_known(params, name, name)
    if sharding is not None:
        tensor = sharding.shard(name, None, tensor)
    _assign_rows(params[name], 0, _rows(params[name]), tensor, name)
    return name


def _rows(target) -> int:
    return target.out_features if isinstance(target, Int8Slot) else target.shape[0]


def _assign_rows(target, start: int, size: int, tensor, name: str) -> None:
    if isinstance(target, Int8Slot):
        target.assign_rows(start, size, tensor, name)
        return
    if isinstance(tensor, QuantizedRows):
        tensor = tensor.dequantize()
    _assign(target.data[start:start + size], tensor, name)


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
