"""Reading a PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``).

Only safetensors are read (never pickle). Every problem is a LoRAError that says what is wrong:
missing files, a rank above ``max_lora_rank``, modules the base model lacks, shapes that do not fit.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import LoRAError
from ..model.registry import architecture_named
from ..model.shape import DecoderShape

_VISION_MODULES = ("vision_tower", "vision_model", "multi_modal_projector", "visual")  # vision-language models
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT's ``target_parameters`` on a stacked experts module: one ParamWrapper per parameter, nested (the
# innermost behind the most ``base_layer.``); which parameter a pair adapts is read from its shapes
_EXPERT_KEY = re.compile(r"layers\.(\d+)\.\w+\.experts\.((?:base_layer\.)*)lora_([AB])\.weight$")
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")  # the stacked [E, out, in] expert parameters
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save", "layers_to_transform": "layers_to_transform"}
_ids = itertools.count(1)


@dataclass
class LoRAWeights:
    """One adapter in CPU memory: per (layer, target) an ``A`` [rank, in] and a pre-scaled ``B`` [out, rank]."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    adapter_id: int = field(default_factory=lambda: next(_ids))  # unique per load: the prefix-cache key

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


# the engine's fused module -> the PEFT targets it holds, in column order (native families)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass(frozen=True)
class LoRALayout:
    """Where adapters go in a model: the PEFT targets it takes, each one's (in, out) size, and which
    module applies which targets (a fused projection several, in column order)."""

    targets: tuple[str, ...]
    shapes: dict[str, tuple[int, int]]
    parts: dict[str, tuple[str, ...]]
    # PEFT ``target_parameters`` on the experts: each one's (experts, in, out) as PEFT sees it, whole model
    experts: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    experts_interleaved: bool = False  # gate/up output columns alternate (gpt-oss) where the engine has gate, then up
    # the experts stored [E, in, out] without transformers saying so (Llama 4): PEFT takes the parameter's last
    # two dims as (out, in), so its A/B pairs are the projection's transposed product (B^T A^T)
    experts_swapped: bool = False

    @classmethod
    def of(cls, shape: DecoderShape) -> "LoRALayout":
        """A native family's layout: its declared targets on the engine's fused projections, and the
        experts' parameters where the family takes LoRA on them."""
        model_class = architecture_named(shape.architecture).model_class()
        experts, expert_lora = {}, getattr(model_class, "expert_lora", False)
        swapped = expert_lora == "swapped"
        if shape.moe is not None and expert_lora:
            e, h, i = shape.moe.num_experts, shape.hidden_size, shape.moe.intermediate_size
            experts = ({"experts.gate_up_proj": (e, 2 * i, h), "experts.down_proj": (e, h, i)} if swapped
                       else {"experts.gate_up_proj": (e, h, 2 * i), "experts.down_proj": (e, i, h)})
        interleaved = bool(shape.moe is not None and shape.moe.gate_up_interleaved)
        if shape.mla is not None:  # latent attention: each projection its own module
            shapes = latent_module_shapes(shape)
            return cls(model_class.lora_targets, shapes, {t: (t,) for t in shapes}, experts, interleaved, swapped)
        return cls(model_class.lora_targets, module_shapes(shape), FUSED_PARTS, experts, interleaved, swapped)


def module_shapes(shape: DecoderShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every LoRA-able projection of the base model."""
    q, kv, h, i = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.hidden_size, \
        shape.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def latent_module_shapes(shape: DecoderShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the LoRA-able projections of a latent-attention model (DeepSeek): the
    query (``q_proj``, or ``q_a_proj`` then ``q_b_proj``), ``kv_a_proj_with_mqa`` and ``o_proj``."""
    mla, h, heads = shape.mla, shape.hidden_size, shape.num_heads
    q_out = heads * mla.qk_head_dim
    shapes = ({"q_proj": (h, q_out)} if mla.q_lora_rank is None
              else {"q_a_proj": (h, mla.q_lora_rank), "q_b_proj": (mla.q_lora_rank, q_out)})
    shapes.update(kv_a_proj_with_mqa=(h, mla.cache_dim), o_proj=(heads * mla.v_head_dim, h))
    return shapes


def load_peft_adapter(name: str, path: str | Path, shape: DecoderShape, max_rank: int,
                      layout: LoRALayout | None = None) -> LoRAWeights:
    """Load and validate a PEFT adapter for a base model of ``shape`` (``layout``: where adapters go;
    default: the native family's)."""
    layout = layout or LoRALayout.of(shape)
    allowed = layout.targets
    if not allowed:
        raise LoRAError(f"adapter {name!r}: LoRA adapters are not supported for this architecture "
                        f"({shape.architecture}) yet (docs/models.md)")
    root = _checked_dir(path)
    config = _read_config(root)
    rank = int(config.get("r", 0))
    if not 0 < rank <= max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, above max_lora_rank={max_rank}" if rank > 0
                        else f"adapter {name!r}: invalid rank {rank}")
    targets = _targets(name, config, allowed) + _expert_targets(name, config, layout)
    pairs, expert_pairs = _read_tensors(name, root / "adapter_model.safetensors", set(layout.shapes))
    weights = _build(name, config, pairs, shape, max_rank, layout.shapes)
    weights.update(_build_experts(name, config, expert_pairs, shape, max_rank, layout))
    found = tuple(sorted({t for _, t in weights}))
    if not found:
        raise LoRAError(f"adapter {name!r} holds no LoRA weights for {', '.join(targets)}")
    return LoRAWeights(name, str(root), rank, found, weights)


def _checked_dir(path: str | Path) -> Path:
    root = Path(path).expanduser()
    try:
        root = root.resolve(strict=True)
    except (OSError, RuntimeError):
        raise LoRAError(f"LoRA adapter path {str(path)!r} does not exist") from None
    if not root.is_dir():
        raise LoRAError(f"LoRA adapter path {str(root)!r} is not a directory")
    for needed in ("adapter_config.json", "adapter_model.safetensors"):
        if not (root / needed).is_file():
            raise LoRAError(f"LoRA adapter {str(root)!r} lacks {needed} (only safetensors adapters are read)")
    return root


def _read_config(root: Path) -> dict:
    try:
        config = json.loads((root / "adapter_config.json").read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise LoRAError(f"cannot read {root / 'adapter_config.json'}: {exc}") from None
    _check_config_types(root, config)
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{root}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise LoRAError(f"{root}: {what} adapters are not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise LoRAError(f"{root}: LoRA biases are not supported")
    return config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# adapter_config.json fields this loader reads, and what each must be (PEFT writes these types)
_CONFIG_FIELDS = {
    "r": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "lora_alpha": ("a finite number", _is_number),
    "target_modules": ("a module name or a list of module names",
                       lambda v: v is None or isinstance(v, str) or (isinstance(v, list)
                                                                     and all(isinstance(t, str) for t in v))),
    "alpha_pattern": ("an object of module names to numbers",
                      lambda v: v is None or (isinstance(v, dict) and all(_is_number(a) for a in v.values()))),
    "use_rslora": ("a boolean", lambda v: isinstance(v, bool)),
    "peft_type": ("a string", lambda v: isinstance(v, str)),
    "bias": ("a string", lambda v: isinstance(v, str)),
}


def _check_config_types(root: Path, config: object) -> None:
    """A malformed adapter_config.json is a LoRAError naming the field, not a TypeError deep in the loader."""
    if not isinstance(config, dict):
        raise LoRAError(f"{root}: adapter_config.json must hold a JSON object")
    for key, (what, ok) in _CONFIG_FIELDS.items():
        if key in config and not ok(config[key]):
            raise LoRAError(f"{root}: adapter_config.json field {key!r} must be {what}, got {config[key]!r:.60}")


def _targets(name: str, config: dict, allowed: tuple[str, ...]) -> list[str]:
    """The adapter's target modules, each one the architecture takes LoRA on (model/registry.py)."""
    raw = config.get("target_modules") or []
    if isinstance(raw, str) and not re.fullmatch(r"[\w.]+", raw):
        return [raw]  # PEFT's regex form (".*language_model.*(q_proj|v_proj)"): the tensors are checked one by one
    targets = [raw] if isinstance(raw, str) else list(raw)
    unknown = [t for t in targets if t.split(".")[-1] not in allowed]
    if unknown:
        raise LoRAError(f"adapter {name!r} targets modules the base model lacks or that cannot take LoRA: "
                        f"{', '.join(unknown)} (supported: {', '.join(allowed)})")
    return targets


def _expert_targets(name: str, config: dict, layout: LoRALayout) -> list[str]:
    """The adapter's ``target_parameters`` (PEFT's LoRA on stacked expert weights), each one the model takes."""
    raw = config.get("target_parameters") or []
    if isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
        raise LoRAError(f"adapter {name!r}: adapter_config.json field 'target_parameters' must be a list of "
                        f"parameter names, got {raw!r:.60}")
    wanted = [t for t in raw if not any(t == e or t.endswith("." + e) for e in layout.experts)]
    if wanted:
        what = ", ".join(layout.experts) if layout.experts else "none on this model"
        raise LoRAError(f"adapter {name!r} targets parameters this model cannot take LoRA on: {', '.join(wanted)} "
                        f"(supported target_parameters: {what}; docs/moe.md)")
    return list(raw)


def _read_tensors(name: str, file: Path, modules: set[str]) -> tuple[dict, dict]:
    """The adapter's A/B tensors: per (layer, module) for projections, and per (layer, nesting depth) for
    ``target_parameters`` wrappers on the experts."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    expert_pairs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(file, framework="pt") as reader:
            for key in reader.keys():
                if any(part in key.split(".") for part in _VISION_MODULES):
                    raise LoRAError(f"adapter {name!r}: {key!r} adapts the vision side; adapters go on the language "
                                    "model only (target_modules like '.*language_model.*(q_proj|v_proj)')")
                match = _EXPERT_KEY.search(key)
                if match is not None:
                    depth = match[2].count("base_layer.")
                    expert_pairs.setdefault((int(match[1]), depth), {})[match[3]] = reader.get_tensor(key)
                    continue
                match = _KEY.search(key)
                if match is None:
                    raise LoRAError(f"adapter {name!r}: unexpected tensor {key!r}")
                layer, target, which = int(match[1]), match[2], match[3]
                if target not in modules:
                    raise LoRAError(f"adapter {name!r}: the base model has no module {target!r} ({key})")
                pairs.setdefault((layer, target), {})[which] = reader.get_tensor(key)
    except LoRAError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise LoRAError(f"adapter {name!r}: cannot read {file}: {exc}") from exc
    return pairs, expert_pairs


def _build(name, config, pairs, shape: DecoderShape, max_rank: int, shapes: dict) -> dict:
    """Check every A/B pair against the base model and fold the LoRA scale into B."""
    alpha = float(config.get("lora_alpha", config.get("r", 1)))
    weights = {}
    for (layer, target), pair in sorted(pairs.items()):
        if layer >= shape.num_layers:
            raise LoRAError(f"adapter {name!r} has weights for layer {layer}; the base model has {shape.num_layers}")
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {target} lacks lora_{'AB'[len(pair) % 2]}")
        a, b = pair["A"].float(), pair["B"].float()
        rank = a.shape[0]
        in_features, out_features = shapes[target]
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRAError(f"adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                            f"but the base model needs A [r, {in_features}] and B [{out_features}, r]")
        if rank > max_rank:
            raise LoRAError(f"adapter {name!r}: rank {rank} of layer {layer} {target} exceeds max_lora_rank={max_rank}")
        module_alpha = float((config.get("alpha_pattern") or {}).get(target, alpha))
        scale = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        weights[(layer, target)] = (a.contiguous(), (b * scale).contiguous())
    return weights


def _build_experts(name, config, pairs, shape: DecoderShape, max_rank: int, layout: LoRALayout) -> dict:
    """Per (layer, expert target): A [E, rank, in] and pre-scaled B [E, out, rank], from PEFT's ParamWrapper
    tensors (``lora_A`` [rank * E, in] expert-major; ``lora_B`` [out, rank * E] rank-major). PEFT's in/out are
    the projection's whatever way the family stores the parameter ([E, out, in], or [E, in, out] for gpt-oss)."""
    experts = layout.experts
    if pairs and not experts:
        raise LoRAError(f"adapter {name!r} holds LoRA weights for experts, which this model does not take "
                        "LoRA on (docs/moe.md)")
    alpha = float(config.get("lora_alpha", config.get("r", 1)))
    weights = {}
    # the wrappers' nesting order is PEFT's; the shapes say which parameter a pair adapts
    for (layer, _depth), pair in sorted(pairs.items()):
        if layer >= shape.num_layers or not shape.is_moe(layer):
            raise LoRAError(f"adapter {name!r} has expert weights for layer {layer}, which has no experts")
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} experts lack lora_{'AB'[len(pair) % 2]}")
        a, b = pair["A"].float(), pair["B"].float()
        target = next((t for t, (e, i, o) in experts.items() if a.dim() == 2 and b.dim() == 2 and a.shape[1] == i
                       and b.shape[0] == o and a.shape[0] == b.shape[1] and a.shape[0] % e == 0), None)
        if target is None:
            needs = "; ".join(f"{t}: A [r * {e}, {i}] and B [{o}, r * {e}]" for t, (e, i, o) in experts.items())
            raise LoRAError(f"adapter {name!r}: layer {layer} has expert LoRA tensors A {tuple(a.shape)} and "
                            f"B {tuple(b.shape)}, which fit no expert parameter ({needs})")
        if (layer, target) in weights:
            raise LoRAError(f"adapter {name!r}: layer {layer} adapts {target} twice")
        e, i, o = experts[target]
        rank = a.shape[0] // e
        if rank > max_rank:
            raise LoRAError(f"adapter {name!r}: rank {rank} of layer {layer} {target} exceeds max_lora_rank={max_rank}")
        short = target.rpartition(".")[2]
        module_alpha = float((config.get("alpha_pattern") or {}).get(short, alpha))
        scale = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        a, b = a.reshape(e, rank, i), b.reshape(o, rank, e).permute(2, 0, 1)
        if layout.experts_swapped:  # PEFT's delta is (B A)^T of the projection's: A' = B^T, B' = A^T
            a, b = b.transpose(1, 2), a.transpose(1, 2)
        if layout.experts_interleaved and target == "experts.gate_up_proj":  # the engine's rows: gate, then up
            b = torch.cat([b[:, 0::2], b[:, 1::2]], dim=1)
        weights[(layer, target)] = (a.contiguous(), (b * scale).contiguous())
    return weights
