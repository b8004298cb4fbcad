"""Cutting checkpoint tensors and LoRA weights to one rank's part (see ``parallel.py`` for the layout).

The loader calls :meth:`Sharding.shard` with the engine parameter a checkpoint tensor fills (and the
part of a fused parameter it is: ``"q"``/``"k"``/``"v"`` of ``qkv_proj``, 0/1 of ``gate_up_proj``,
None for a whole tensor) before copying it; the LoRA slots call :meth:`Sharding.lora` with each
adapter's A/B pair. Int8 rows stored in a GGUF file (``QuantizedRows``) are cut as they are:
rows always, columns when the cut falls on a group boundary (else they are widened first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.gguf_weights import QuantizedRows
from ..model.shape import DecoderShape
from .parallel import TensorParallel

Weight = torch.Tensor | QuantizedRows


@dataclass(frozen=True)
class Sharding:
    """One rank's cut of a model of (global) ``shape``."""

    tp: TensorParallel
    shape: DecoderShape

    def _row_ranges(self, fused: str, part) -> tuple[int, int]:
        """(start, count) of the rows this rank keeps of one column-parallel piece."""
        s, tp = self.shape, self.tp
        if fused == "qkv_proj":
            if part == "q":
                start, count = tp.split(s.num_heads)
            else:
                start, count = tp.kv_heads(s.num_kv_heads)
            return start * s.head_dim, count * s.head_dim
        return tp.split(s.intermediate_size)  # gate_up_proj halves

    def _column_range(self, module: str) -> tuple[int, int]:
        """(start, count) of the input columns this rank keeps of a row-parallel projection."""
        s = self.shape
        if module == "o_proj":
            start, count = self.tp.split(s.num_heads)
            return start * s.head_dim, count * s.head_dim
        return self.tp.split(s.intermediate_size)  # down_proj

    def shard(self, param: str, part, tensor: Weight) -> Weight:
        """``tensor`` (a whole checkpoint tensor for ``param``, or its ``part``) cut to this rank."""
        if not self.tp.enabled:
            return tensor
        s = self.shape
        module = param.split(".")[-2] if "." in param else ""
        if module == "qkv_proj":
            if part is not None:
                return _rows(tensor, *self._row_ranges("qkv_proj", part))
            q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim  # stored fused (Phi-3)
            pieces = [(0, "q"), (q, "k"), (q + kv, "v")]
            return _cat_rows([_rows(_rows(tensor, at, q if p == "q" else kv), *self._row_ranges("qkv_proj", p))
                              for at, p in pieces])
        if module == "gate_up_proj":
            if part is not None:
                return _rows(tensor, *self._row_ranges("gate_up_proj", part))
            half = s.intermediate_size
            return _cat_rows([_rows(_rows(tensor, at, half), *self._row_ranges("gate_up_proj", p))
                              for at, p in ((0, 0), (half, 1))])
        if module in ("o_proj", "down_proj"):
            if param.endswith(".bias"):  # added once to the summed output: rank 0 keeps it, the others add zeros
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            return _columns(tensor, *self._column_range(module))
        if module in ("embed_tokens", "lm_head"):
            start, per_rank = self.tp.vocab(s.vocab_size)
            return _pad_rows(_rows(tensor, start, max(0, min(per_rank, s.vocab_size - start))), per_rank)
        return tensor  # norms: every rank keeps them whole

    def lora(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's (A [rank, in], B [out, rank]) for PEFT module ``target``, cut to this rank:
        B's rows for column-parallel projections, A's columns for row-parallel ones (their partial
        products are summed by the layer's all-reduce with the base output)."""
        if not self.tp.enabled:
            return a, b
        if target == "q_proj":
            return a, _rows(b, *self._row_ranges("qkv_proj", "q"))
        if target in ("k_proj", "v_proj"):
            return a, _rows(b, *self._row_ranges("qkv_proj", "k"))
        if target in ("gate_proj", "up_proj"):
            return a, _rows(b, *self._row_ranges("gate_up_proj", 0))
        if target in ("o_proj", "down_proj"):
            return _columns(a, *self._column_range(target)), b
        return a, b


def _rows(tensor: Weight, start: int, count: int) -> Weight:
    if isinstance(tensor, QuantizedRows):
        return QuantizedRows(tensor.qweight[start:start + count], tensor.scales[start:start + count])
    return tensor[start:start + count]


def _columns(tensor: Weight, start: int, count: int) -> Weight:
    if isinstance(tensor, QuantizedRows):
        group = tensor.group_size
        if start % group == 0 and count % group == 0:
            return QuantizedRows(tensor.qweight[:, start:start + count],
                                 tensor.scales[:, start // group:(start + count) // group])
        tensor = tensor.dequantize()
    return tensor[:, start:start + count]


def _cat_rows(parts: list[Weight]) -> Weight:
    if all(isinstance(p, QuantizedRows) for p in parts):
        return QuantizedRows(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))
    return torch.cat([p.dequantize() if isinstance(p, QuantizedRows) else p for p in parts])


def _pad_rows(tensor: Weight, rows: int) -> Weight:
    """Zero rows appended up to ``rows`` (the last vocabulary shard); their logits are cut off."""
    missing = rows - tensor.shape[0]
    if missing <= 0:
        return tensor
    if isinstance(tensor, QuantizedRows):
        return QuantizedRows(torch.cat([tensor.qweight, tensor.qweight.new_zeros(missing, tensor.qweight.shape[1])]),
                             torch.cat([tensor.scales, tensor.scales.new_zeros(missing, tensor.scales.shape[1])]))
    return torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
