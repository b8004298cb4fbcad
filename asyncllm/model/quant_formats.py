"""Which quantized format a checkpoint is stored in, read from its ``quantization_config``.

A checkpoint says how it was quantized in ``config.json``'s ``quantization_config``. Older GPTQ exports say it
in a separate ``quantize_config.json``. :func:`checkpoint_format` turns that into a :class:`QuantizedFormat`,
or raises ModelLoadError naming a method this engine does not run (bitsandbytes, HQQ, ...).
:func:`check_requested` compares the format with the engine's ``quantization=`` argument.

The formats (docs/quantization.md):

- ``gptq``: 4 or 8 bits, groups of 32/64/128 or one per row (-1), symmetric or with zero points, act-order
  (``desc_act``, a ``g_idx`` per layer). ``checkpoint_format`` "gptq" (v1) stores zero points minus one, and
  "gptq_v2" stores them as they are.
- ``awq``: AWQ GEMM: 4 bits, groups of 64/128, zero points, its interleaved packing.
- ``compressed-tensors``: ``pack-quantized`` W4A16/W8A16 (GPTQ/AWQ made by llm-compressor),
  ``int-quantized``/``naive-quantized`` W8A8 (int8 per-channel weights; the activations are computed in
  float here), and ``float-quantized`` FP8 (per-tensor, per-channel or block scales).
- ``fp8``: fine-grained FP8 as DeepSeek and Qwen ship it (``weight_scale_inv`` per 128x128 block), or
  vLLM's per-tensor FP8 (``weight_scale``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ModelLoadError

SUPPORTED = ("gptq", "awq", "compressed-tensors", "fp8")
# what ``quantization=`` may say, besides None, "int8" and "none": a format (vLLM's kernel-named aliases too)
ALIASES = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
           "compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors", "fp8": "fp8"}


@dataclass(frozen=True)
class QuantizedFormat:
    """How a checkpoint's projections are stored.

    ``kind``: "int" (group-quantized integers, float activations), "int8" (int8 per-channel, W8A8 checkpoints
    run with float activations), or "fp8". ``group_size`` None: one group per row.
    ``ignore``: patterns of module names the checkpoint left in float (``re:`` prefixed ones are regexes)."""

    method: str
    kind: str
    bits: int
    group_size: int | None = None
    sym: bool = True
    desc_act: bool = False
    zero_offset: int = 0          # added to stored zero points (GPTQ v1: 1)
    layout: str = ""              # the tensors' layout: "gptq", "awq", "ct-packed", "ct-int8", "fp8"
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"  # fp8: "weight_scale_inv" for the block format
    dynamic: bool = False         # a float checkpoint quantized at load (quantization="fp8")
    ignore: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def skips(self, module_name: str) -> bool:
        """Whether the checkpoint keeps this module (``model.layers.0.mlp.down_proj``...) in float."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False

    def describe(self) -> str:
        group = f", groups of {self.group_size}" if self.group_size else ""
        return f"{self.method} ({self.kind} {self.bits}-bit{group}{', act-order' if self.desc_act else ''})"


def read_quantization_config(root: Path) -> dict | None:
    """``quantization_config`` of ``config.json``, else ``quantize_config.json`` (older GPTQ exports)."""
    config_file = root / "config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        if isinstance(config.get("quantization_config"), dict):
            return config["quantization_config"]
    legacy = root / "quantize_config.json"
    if legacy.is_file():
        data = json.loads(legacy.read_text())
        if isinstance(data, dict):
            data.setdefault("quant_method", "gptq")
            return data
    return None


def checkpoint_format(root: Path, dequantized: tuple[str, ...] = ()) -> QuantizedFormat | None:
    """The checkpoint's format (None: float weights). ModelLoadError for a method not run here.
    ``dequantized``: methods the model's family turns into float weights as it loads them (gpt-oss: mxfp4),
    which the rest of the engine then sees as a float checkpoint."""
    config = read_quantization_config(root)
    if config is None:
        return None
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    if method in dequantized:
        return None
    if method == "gptq":
        return _gptq(config)
    if method == "awq":
        return _awq(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _fp8(config)
    raise ModelLoadError(f"quantization method {config.get('quant_method')!r} (the checkpoint's quantization_config) "
                         f"is not supported; supported: {', '.join(SUPPORTED)} (docs/quantization.md)")


def check_requested(quantization: str | None, fmt: QuantizedFormat | None) -> None:
    """``quantization=`` must agree with the checkpoint: a format names the checkpoint's, "int8" and "none"
    apply to float checkpoints only."""
    if quantization is None:
        return
    if fmt is None:
        if quantization in ALIASES and quantization != "fp8":  # ("fp8" on float weights: quantized at load)
            raise ConfigError(f"quantization={quantization!r}: this checkpoint is not quantized (its config.json has "
                              "no quantization_config); use None, 'int8' or 'none'")
        return
    if quantization in ("int8", "none"):
        raise ConfigError(f"quantization={quantization!r}: this checkpoint is already quantized as "
                          f"{fmt.describe()}; leave quantization unset (or set it to {fmt.method!r})")
    if ALIASES.get(quantization) != fmt.method:
        raise ConfigError(f"quantization={quantization!r} disagrees with the checkpoint, which is quantized as "
                          f"{fmt.describe()}")


def requested_format(quantization: str | None, stored: QuantizedFormat | None) -> QuantizedFormat | None:
    """The format the projections load in: the checkpoint's, or FP8 with one scale per row for a float
    checkpoint run with ``quantization="fp8"`` (quantized row by row as the weights arrive)."""
    if stored is None and quantization == "fp8":
        return QuantizedFormat("fp8", "fp8", 8, layout="fp8", dynamic=True)
    return stored


# ---- one parser per method --------------------------------------------------------------------------

def _bits(config: dict, allowed: tuple[int, ...], method: str) -> int:
    bits = config.get("bits", config.get("w_bit"))
    if bits not in allowed:
        raise ModelLoadError(f"{method}: {bits}-bit weights are not supported (supported: "
                             f"{', '.join(map(str, allowed))})")
    return bits


def _group(value: Any, method: str) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{method}: group_size {value!r} is not a positive integer or -1")
    return value


def _gptq(config: dict) -> QuantizedFormat:
    bits = _bits(config, (4, 8), "gptq")
    version = str(config.get("checkpoint_format", "gptq")).lower()
    if version not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"gptq: checkpoint_format {version!r} is not supported (gptq, gptq_v2)")
    if config.get("dynamic"):
        raise ModelLoadError("gptq: per-module 'dynamic' overrides are not supported")
    ignore = tuple(config.get("modules_to_not_convert") or ())
    return QuantizedFormat("gptq", "int", bits, _group(config.get("group_size", 128), "gptq"),
                           sym=bool(config.get("sym", True)), desc_act=bool(config.get("desc_act", False)),
                           zero_offset=1 if version == "gptq" else 0, layout="gptq", ignore=ignore, raw=config)


def _awq(config: dict) -> QuantizedFormat:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"awq: version {version!r} is not supported (only AWQ GEMM checkpoints are)")
    bits = _bits(config, (4,), "awq")
    ignore = tuple(config.get("modules_to_not_convert") or ())
    return QuantizedFormat("awq", "int", bits, _group(config.get("group_size", config.get("q_group_size", 128)), "awq"),
                           sym=not config.get("zero_point", True), layout="awq", ignore=ignore, raw=config)


def _compressed_tensors(config: dict) -> QuantizedFormat:
    groups = config.get("config_groups") or {}
    linear = [g for g in groups.values() if isinstance(g, dict) and g.get("weights")]
    if len(linear) != 1:
        raise ModelLoadError(f"compressed-tensors: {len(linear)} weight schemes in config_groups; one scheme for "
                             "every quantized layer is supported")
    scheme = linear[0]
    weights = scheme["weights"]
    fmt = str(scheme.get("format") or config.get("format") or "").lower()
    strategy = weights.get("strategy")
    bits, wtype = weights.get("num_bits"), weights.get("type", "int")
    ignore = tuple(config.get("ignore") or ())
    if fmt == "pack-quantized":
        if bits not in (4, 8) or wtype != "int":
            raise ModelLoadError(f"compressed-tensors: {bits}-bit packed weights are not supported (4, 8)")
        group = weights.get("group_size") if strategy == "group" else None
        if strategy not in ("group", "channel"):
            raise ModelLoadError(f"compressed-tensors: weight strategy {strategy!r} is not supported for packed "
                                 "weights (group, channel)")
        return QuantizedFormat("compressed-tensors", "int", bits, _group(group, "compressed-tensors"),
                               sym=bool(weights.get("symmetric", True)),
                               desc_act=weights.get("actorder") not in (None, False, "static"),
                               layout="ct-packed", ignore=ignore, raw=config)
    if fmt in ("int-quantized", "naive-quantized") and wtype == "int" and bits == 8:
        if strategy not in ("channel", "tensor"):
            raise ModelLoadError(f"compressed-tensors: int8 weight strategy {strategy!r} is not supported "
                                 "(channel, tensor)")
        return QuantizedFormat("compressed-tensors", "int8", 8, None, sym=bool(weights.get("symmetric", True)),
                               layout="ct-int8", ignore=ignore, raw=config)
    if fmt in ("float-quantized", "naive-quantized") and wtype == "float" and bits == 8:
        block = None
        if strategy == "block":
            structure = weights.get("block_structure") or [128, 128]
            block = (int(structure[0]), int(structure[1]))
        elif strategy not in ("tensor", "channel"):
            raise ModelLoadError(f"compressed-tensors: fp8 weight strategy {strategy!r} is not supported "
                                 "(tensor, channel, block)")
        return QuantizedFormat("compressed-tensors", "fp8", 8, block=block, layout="fp8", ignore=ignore, raw=config)
    raise ModelLoadError(f"compressed-tensors: format {fmt!r} with {bits}-bit {wtype} weights is not supported "
                         "(pack-quantized W4A16/W8A16, int-quantized W8A8, float-quantized FP8)")


def _fp8(config: dict) -> QuantizedFormat:
    fmt = str(config.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelLoadError(f"fp8: format {fmt!r} is not supported (e4m3)")
    block = config.get("weight_block_size")
    ignore = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    if block is not None:
        return QuantizedFormat("fp8", "fp8", 8, block=(int(block[0]), int(block[1])), layout="fp8",
                               scale_name="weight_scale_inv", ignore=ignore, raw=config)
    return QuantizedFormat("fp8", "fp8", 8, layout="fp8", ignore=ignore, raw=config)
