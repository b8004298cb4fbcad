"""Rotary position embeddings with a precomputed cos/sin table.

Frequencies come from transformers' own rope-initialisation functions, so every rope type it
knows (default, linear, llama3, yarn, longrope) matches its numerics exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels.ops import rotary_embedding


def rope_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for a transformers config."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ModelLoadError("rope type 'dynamic' depends on the sequence length at run time and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies rope to q/k of shape [tokens, heads, head_dim] at given positions."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        super().__init__()
        self.inv_freq, self.scaling, self.max_positions = inv_freq, scaling, max_positions
        self.cos = self.sin = None

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        """Compute the table on the target device (call after the module is materialised)."""
        positions = torch.arange(self.max_positions, dtype=torch.float, device=device)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.scaling).to(dtype)
        self.sin = (emb.sin() * self.scaling).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, q, k, self.cos, self.sin)
