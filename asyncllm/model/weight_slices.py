"""Cutting a checkpoint weight (float, or int8 rows as a GGUF Q8_0 file stores them) into pieces."""

from __future__ import annotations

import torch

from .gguf_weights import QuantizedRows

Weight = torch.Tensor | QuantizedRows


def rows(tensor: Weight, start: int, count: int) -> Weight:
    if isinstance(tensor, QuantizedRows):
        return QuantizedRows(tensor.qweight[start:start + count], tensor.scales[start:start + count])
    return tensor[start:start + count]


def columns(tensor: Weight, start: int, count: int) -> Weight:
    """Columns ``start:start+count``; int8 rows are cut as stored when the cut falls on a group boundary,
    else widened first."""
    if isinstance(tensor, QuantizedRows):
        group = tensor.group_size
        if start % group == 0 and count % group == 0:
            return QuantizedRows(tensor.qweight[:, start:start + count],
                                 tensor.scales[:, start // group:(start + count) // group])
        tensor = tensor.dequantize()
    return tensor[:, start:start + count]


def cat_rows(parts: list[Weight]) -> Weight:
    if all(isinstance(p, QuantizedRows) for p in parts):
        return QuantizedRows(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))
    return torch.cat([p.dequantize() if isinstance(p, QuantizedRows) else p for p in parts])


def pad_rows(tensor: Weight, count: int) -> Weight:
    """Zero rows appended up to ``count`` (the last vocabulary shard); their logits are cut off."""
    missing = count - tensor.shape[0]
    if missing <= 0:
        return tensor
    if isinstance(tensor, QuantizedRows):
        return QuantizedRows(torch.cat([tensor.qweight, tensor.qweight.new_zeros(missing, tensor.qweight.shape[1])]),
                             torch.cat([tensor.scales, tensor.scales.new_zeros(missing, tensor.scales.shape[1])]))
    return torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
