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
from .registry import Architecture, architecture_for
from .source import ModelSource

_PROGRESS_MIN_BYTES = 512 * 2**20  # show a progress bar only for checkpoints worth waiting on


def load_hf_config(root: Path, model_impl: str = "auto"):
    """The transformers config, refusing architectures (and variants) this engine cannot run. A multimodal
    checkpoint whose family runs its text model alone (``language_config``: Llama 4) gives that model's config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(root, local_files_only=True)
    except ValueError as exc:
        if "trust_remote_code" in str(exc) or _asks_for_remote_code(root):
            raise ModelLoadError(f"{root}: this checkpoint's architecture is defined by code shipped with it "
                                 "(trust_remote_code), which asyncllm does not run; use a checkpoint whose "
                                 "architecture transformers implements") from exc
        raise ModelLoadError(f"cannot read the config of {root}: {exc}") from exc
    arch = architecture_for(config, model_impl)
    language = getattr(arch.model_class(), "language_config", None) if arch.native else None
    return language(config) if language is not None else config


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
                             keep_q8_0, type(model).gguf_architectures, type(model).gguf_names,
                             type(model).gguf_permuted_qk)


def load_weights(model, source: ModelSource | Path, arch: Architecture, keep_q8_0: bool = False,
                 shape=None) -> None:
    """Hand every checkpoint tensor to the module it belongs to: a layer that loads its own weights
    (``weight_loader``: model/layers.py, which places a piece of a fused projection and cuts it to
    this tensor-parallel rank, so no rank holds more than its shard plus one checkpoint tensor), or
    a plain parameter copied whole (norms). ``arch.fused`` says which checkpoint projection is which
    part of a fused one; every parameter (and every part of a fused one) must be covered.
    ``shape``: the whole model's, when ``model`` is one rank's shard."""
    if isinstance(source, Path):
        source = ModelSource(source)
    modules = dict(model.named_modules())
    filled: set[str] = set()
    for name, tensor in checkpoint_tensors(model, source, keep_q8_0, shape):
        piece = _load_tensor(model, modules, name, tensor, arch.fused, source.is_gguf)
        if isinstance(piece, set):
            filled |= piece
        elif piece:
            filled.add(piece)
    missing = sorted(_expected_pieces(model, arch.fused) - filled)
    if missing:
        raise ModelLoadError(f"checkpoint {source.name or source.root} lacks weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _renamed(name: str, renames: dict[str, str]) -> str:
    """``name`` with each dotted segment the family renames replaced (one pass: renames do not chain).
    A key with dots (``"router.layer"``) replaces that run of whole segments first."""
    if not renames:
        return name
    for key, value in renames.items():
        if "." in key and f".{key}." in f".{name}.":
            name = f".{name}.".replace(f".{key}.", f".{value}.", 1)[1:-1]
    return ".".join(renames.get(part, part) for part in name.split("."))


def _claiming_module(modules: dict, name: str):
    """(path, module) of the nearest module above ``name`` that loads the tensors under it itself
    (``load_checkpoint_tensor``: the stacked experts of model/moe.py), or None."""
    path = name
    while "." in path:
        path = path.rpartition(".")[0]
        module = modules.get(path)
        if module is not None and hasattr(module, "load_checkpoint_tensor"):
            return path, module
    return None


def _load_tensor(model, modules: dict, name: str, tensor, fused_map: dict, from_gguf: bool) -> set[str] | str | None:
    """Load one checkpoint tensor; the piece(s) it filled (``module.kind:part``), or None if it is not used."""
    if "rotary_emb" in name or (name == "lm_head.weight" and model.shape.tie_word_embeddings):
        return None
    skips = getattr(model, "skips_tensor", None)
    if skips is not None and skips(name):
        return None
    original = name
    name = _renamed(name, getattr(model, "renamed", {}))
    if isinstance(tensor, torch.Tensor):
        tensor = model.prepare_weight(name, tensor, from_gguf)
    claimed = _claiming_module(modules, name)
    if claimed is not None:  # e.g. experts.3.gate_proj.weight, or a stacked experts.gate_up_proj
        path, module = claimed
        return module.load_checkpoint_tensor(path, name[len(path) + 1:], tensor, original)
    path, _, kind = name.rpartition(".")
    parent, _, leaf = path.rpartition(".")
    part = None
    if leaf in fused_map:
        fused, part = fused_map[leaf]
        path = f"{parent}.{fused}" if parent else fused
    module = modules.get(path)
    method = getattr(module, "method", None)
    quantized = hasattr(method, "handles") and kind != "bias" and method.handles(kind)
    if module is None or not (quantized or kind in dict(module.named_parameters(recurse=False))):
        raise ModelLoadError(f"unexpected tensor {original!r} in checkpoint (no matching parameter)")
    if quantized:  # a quantized checkpoint's qweight, scales...: its main tensor stands for the weight
        module.weight_loader(kind, tensor, part, original)
        return f"{path}.{'weight' if method.primary(kind) else kind}:{part}"
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        loader(kind, tensor, part, original)
    else:
        if isinstance(tensor, QuantizedRows):
            tensor = tensor.dequantize()
        _assign(getattr(module, kind).data, tensor, original)
    return f"{path}.{kind}:{part}"


def _expected_pieces(model, fused_map: dict) -> set[str]:
    """What every checkpoint must fill: each parameter once, or once per part for a fused projection
    the checkpoint stores in pieces (``fused_map``)."""
    parts: dict[str, list] = {}
    for fused, part in fused_map.values():
        parts.setdefault(fused, []).append(part)
    pieces, own = set(), []
    for path, module in model.named_modules():
        if any(path.startswith(prefix) for prefix in own):
            continue  # inside a module that loads its own tensors (its quantized experts' layers)
        if hasattr(module, "expected_pieces"):  # loads its own tensors (model/moe.py)
            pieces |= module.expected_pieces(path)
            own.append(path + ".")
            continue
        leaf = path.rpartition(".")[2]
        for kind, _ in module.named_parameters(recurse=False):
            if leaf in parts and hasattr(module, "weight_loader"):
                pieces.update(f"{path}.{kind}:{part}" for part in parts[leaf])
            else:
                pieces.add(f"{path}.{kind}:None")
    return pieces


def _assign(destination: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if destination.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
    destination.copy_(tensor)
