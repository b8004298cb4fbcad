"""The LM head on CPU as float32 panels (``csrc/decode_stack.c: panel_linear_f32``).

The decode stack's projections read float32 weights as panels of 32 output columns with
register-blocked tiles of up to 12 rows (AVX-512 builds; ``kernels/cpu_decode_stack.py``). The LM head
is the largest single matmul of a small model's step (SmolLM2: 49,152 x 576), and the same tiles beat
oneDNN's packed inner product on it at every row count a decode or prefill step asks for (SmolLM2,
2 threads, ms per call, panels vs oneDNN: 1 row 1.91 vs 2.12, 8 rows 2.18 vs 2.48, 32 rows 3.78 vs
5.24, 64 rows 7.31 vs 8.40, 128 rows 14.4 vs 15.4). So on such builds the head is held as panels
instead of a oneDNN-packed copy (the same memory), and every other projection stays with oneDNN.
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu_decode_stack import PANEL, _library, pair_panels_bf16, panels_supported, to_panels, unpair_panels_bf16


class PanelLinear(nn.Module):
    """``y = x @ W.T`` (no bias) for float32 CPU inputs, ``W`` held as panels; build with :meth:`build`."""

    def __init__(self, weight: torch.Tensor, bf16: bool = False) -> None:
        """``bf16``: hold the panels as paired bfloat16 panels (``weight`` holds bf16-rounded values: exact), half
        the bytes; steps of many rows then multiply with bf16 dot products (``cpu_decode_stack.bf16_dot_rows``)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # a plain attribute, as PackedLinear's: the engine never moves or saves a loaded model
        self.panels = pair_panels_bf16(weight.detach()) if bf16 else to_panels(weight.detach())
        self._fn = _library().panel_linear_bf16 if bf16 else _library().panel_linear_f32

    @classmethod
    def build(cls, weight: torch.Tensor, bf16: bool = False) -> "PanelLinear | None":
        """A panel layer for this float32 CPU weight, or None where the kernel cannot run it here."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not panels_supported():
            return None
        return cls(weight, bf16)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, rebuilt on demand (for inspection; the forward never uses it)."""
        if self.panels.dtype == torch.bfloat16:
            return unpair_panels_bf16(self.panels, self.out_features, self.in_features)
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features].float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"PanelLinear takes [rows, {self.in_features}] float32 CPU inputs, got "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        if x.shape[0]:
            self._fn(x.data_ptr(), x.shape[0], self.in_features, self.panels.data_ptr(), None, out.data_ptr(),
                     self.out_features, torch.get_num_threads())
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, panels=32"
                + (", bfloat16" if self.panels.dtype == torch.bfloat16 else ""))


class PanelEmbedding(nn.Module):
    """The token embedding read from a tied LM head's panels: row ``t`` of the table is column ``t % 32`` of
    panel ``t // 32``. A tied model then holds its largest tensor once (SmolLM2: 108 MiB) instead of as the
    embedding table and again as the head's panels; the values are the table's, exactly."""

    def __init__(self, head: PanelLinear) -> None:
        super().__init__()
        self.head = [head]  # a list: the head stays the model's module, not a child of this one too
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The dense table, rebuilt on demand (for inspection; the forward never uses it)."""
        return self.head[0].weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        panels = self.head[0].panels
        flat = input_ids.reshape(-1)
        if panels.dtype == torch.bfloat16:  # paired panels: column c's pairs at [p, :, 2c : 2c + 2]
            pairs = panels.reshape(panels.shape[0], panels.shape[1], PANEL, 2)
            rows = pairs[flat // PANEL, :, flat % PANEL].reshape(flat.numel(), -1)[:, :self.embedding_dim].float()
        else:
            rows = panels[flat // PANEL, :, flat % PANEL]
        return rows.reshape(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, from the LM head's panels"
