"""Weight-only int8: which checkpoints run it, and turning the model's projections into int8 layers.

``quantization`` (engine argument):

- ``None`` (default): the checkpoint decides. A GGUF file whose projection weights are Q8_0 runs
  them as int8 as stored (one scale per 32 values); everything else runs in the engine's dtype.
- ``"int8"``: every projection and the LM head run as int8 weights with float activations. Float
  checkpoints are quantized at load, one scale per output channel (symmetric, absmax / 127); GGUF
  files keep groups of 32 (Q8_0 tensors as stored, other types quantized to that grouping).
- ``"none"``: float weights, even from a Q8_0 file (widened at load).

Loading fills each projection's :class:`Int8Slot` row slice by row slice (its ``Int8Weights`` method,
model/layers.py: fused projections arrive in pieces, and float pieces are quantized as they arrive,
so the float model never exists whole); ``finish_layers`` then swaps each projection for the
kernel-backed ``Int8Linear``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, ModelLoadError
from .gguf_weights import Q8_0_GROUP, QuantizedRows

# None, "int8", "none", or a quantized checkpoint's format (model/quant_formats.py: it must agree with the file)
QUANTIZATION_CHOICES = (None, "int8", "none", "gptq", "gptq_marlin", "awq", "awq_marlin", "compressed-tensors",
                        "compressed_tensors", "fp8")


@dataclass(frozen=True)
class WeightFormat:
    """How projections are stored in memory: float (``int8=False``) or int8 with ``group_size``
    values per scale (None: one scale per output channel)."""

    int8: bool = False
    group_size: int | None = None
    checkpoint: object | None = None  # a quantized checkpoint's QuantizedFormat (its layers as it stores them)


def decide_weight_format(quantization: str | None, is_gguf: bool, gguf_linear_types: set[str]) -> WeightFormat:
    """The :class:`WeightFormat` for an engine argument and checkpoint (see the module doc)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ConfigError(f"quantization must be one of {', '.join(map(repr, QUANTIZATION_CHOICES))}; "
                          f"got {quantization!r}")
    if quantization not in ("int8", "none", None):  # a checkpoint format, on a GGUF file
        raise ConfigError(f"quantization={quantization!r}: GGUF files carry their own quantization (None, 'int8' "
                          "or 'none')")
    if quantization == "none":
        return WeightFormat()
    if quantization is None:
        if is_gguf and gguf_linear_types == {"Q8_0"}:
            return WeightFormat(True, Q8_0_GROUP)
        return WeightFormat()
    return WeightFormat(True, Q8_0_GROUP if is_gguf else None)


class Int8Slot(nn.Module):
    """A placeholder the loader fills with int8 rows and their scales; becomes an ``Int8Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int | None,
                 device: torch.device) -> None:
        super().__init__()
        group = group_size or in_features
        if in_features % group:
            raise ModelLoadError(f"int8 groups of {group} do not divide the input width {in_features}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group
        self.qweight = torch.zeros(out_features, in_features, dtype=torch.int8, device=device)
        self.scales = torch.zeros(out_features, in_features // group, dtype=torch.float32, device=device)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None

    def assign_rows(self, start: int, size: int, value: torch.Tensor | QuantizedRows, name: str) -> None:
        """Fill rows ``start:start+size`` from a float tensor (quantized here) or stored int8 rows."""
        if tuple(value.shape) != (size, self.in_features):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {(size, self.in_features)}")
        if isinstance(value, QuantizedRows) and value.group_size != self.group_size:
            value = value.dequantize()  # stored with another grouping: requantize below
        if not isinstance(value, QuantizedRows):
            from ..kernels.int8_weights import quantize_weight

            qweight, scales = quantize_weight(value.float(), self.group_size if self.group_size != self.in_features
                                              else None)
            value = QuantizedRows(qweight, scales)
        self.qweight[start:start + size].copy_(value.qweight)
        self.scales[start:start + size].copy_(value.scales)


def int8_tied_head(model: nn.Module, fmt: WeightFormat) -> None:
    """A LM head tied to the embeddings becomes an int8 ``lm_head`` quantized from the embedding table."""
    from ..kernels.int8_linear import Int8Linear
    from ..kernels.int8_weights import quantize_weight

    qweight, scales = quantize_weight(model.model.embed_tokens.weight.float(), fmt.group_size)
    model.lm_head = Int8Linear(qweight, scales, None)
