"""Experts of a quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8), kept as the checkpoint stores them.

Quantized mixture-of-experts checkpoints store one set of tensors per expert and projection
(``experts.<e>.gate_proj.qweight`` / ``scales`` / ``qzeros`` / ``g_idx``, ``weight_packed``..., FP8's
``weight`` + ``weight_scale_inv``). :class:`CheckpointExperts` gives every local expert the same two
projections a dense MLP has: a merged gate/up projection and a down projection, each a ParallelLinear
whose method is the dense path's ``CheckpointWeights`` (model/quant_methods.py). So every format, group size,
act-order and tensor-parallel cut the dense layers take, the experts take too, and after loading each
becomes the same kernel-backed module (GroupQuantLinear, Int8Linear or Fp8Linear): the packed weights are
what stays in memory, never a float copy of the experts.

The step runs the experts grouped (ExpertStack.forward): each active expert's kernels once for all of its tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel import SINGLE
from .layers import MergedColumnParallelLinear, RowParallelLinear


class CheckpointExperts(nn.Module):
    """Per local expert: ``gate_up[e]`` (gate rows, then up rows) and ``down[e]``, loaded quantized."""

    def __init__(self, stack, fmt) -> None:
        """``stack``: the layer's ExpertStack (its sizes and its tensor/expert-parallel share); ``fmt``: the
        checkpoint's QuantizedFormat."""
        from .quant_methods import CheckpointWeights

        super().__init__()
        moe, hidden = stack.moe, stack.hidden
        # whole experts per rank (expert parallel) are not cut; under tensor parallelism the columns are
        tp = SINGLE if stack.tp.expert_parallel or not stack.tp.enabled else stack.tp
        device = stack.w13.device
        bias = moe.expert_bias
        with torch.device(device):
            self.gate_up = nn.ModuleList(MergedColumnParallelLinear(hidden, [moe.intermediate_size] * 2, bias, tp)
                                         for _ in range(stack.local_experts))
            self.down = nn.ModuleList(RowParallelLinear(stack.columns, hidden, bias, (stack.column_start, stack.columns),
                                                        tp) for _ in range(stack.local_experts))
        for layer in (*self.gate_up, *self.down):
            layer.method = CheckpointWeights(layer, fmt)

    def load(self, expert: int, part: str, kind: str, tensor: torch.Tensor, name: str) -> bool:
        """Checkpoint tensor ``name`` (``kind`` of local ``expert``'s ``part``: gate, up or down); whether it is
        the one that stands for the projection's weight (the loader's bookkeeping)."""
        if part == "down":
            layer, piece = self.down[expert], None
        else:
            layer, piece = self.gate_up[expert], 0 if part == "gate" else 1
        layer.weight_loader(kind, tensor, piece, name)
        return layer.method.primary(kind)

    def held_bytes(self) -> int:
        """The bytes the experts' weights take in memory (packed values, scales, zero points)."""
        return sum(t.numel() * t.element_size() for t in self.buffers()) + \
            sum(p.numel() * p.element_size() for p in self.parameters())
