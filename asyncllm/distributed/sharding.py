"""Cutting LoRA weights to one rank's part (see ``parallel.py`` for the layout).

The model's own weights are cut by its layers as they load (model/layers.py); the LoRA slots call
:meth:`Sharding.lora` with each adapter's A/B pair, cut the same way: B's rows for column-parallel
projections, A's columns for row-parallel ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.shape import DecoderShape
from ..model.weight_slices import columns as _columns
from ..model.weight_slices import rows as _rows
from .parallel import TensorParallel


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

    def lora(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's (A [rank, in], B [out, rank]) for PEFT module ``target``, cut to this rank:
        B's rows for column-parallel projections, A's columns for row-parallel ones (their partial
        products are summed by the layer's all-reduce with the base output)."""
        if not self.tp.enabled:
            return a, b
        if self.shape.mla is not None:
            return self._latent_lora(target, a, b)
        if target == "q_proj":
            return a, _rows(b, *self._row_ranges("qkv_proj", "q"))
        if target in ("k_proj", "v_proj"):
            return a, _rows(b, *self._row_ranges("qkv_proj", "k"))
        if target in ("gate_proj", "up_proj"):
            return a, _rows(b, *self._row_ranges("gate_up_proj", 0))
        if target in ("o_proj", "down_proj"):
            return _columns(a, *self._column_range(target)), b
        return a, b

    def _latent_lora(self, target: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The same for latent attention (model/mla.py): the query's output rows and o_proj's input columns by
        this rank's heads; q_a_proj and kv_a_proj_with_mqa are replicated."""
        mla = self.shape.mla
        start, count = self.tp.split(self.shape.num_heads)
        if target in ("q_proj", "q_b_proj"):
            return a, _rows(b, start * mla.qk_head_dim, count * mla.qk_head_dim)
        if target == "o_proj":
            return _columns(a, start * mla.v_head_dim, count * mla.v_head_dim), b
        return a, b
