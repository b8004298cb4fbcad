"""Linear layers on CPU through oneDNN with weights packed once at load time.

Why: torch's CPU ``F.linear`` goes to MKL's sgemm, which on this project's AMD EPYC machines runs
its non-AVX-512 code path and re-reads the plain row-major weight on every call. oneDNN's
inner-product primitive with a weight already reordered into its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the op inductor's CPU freezing pass uses) is
1.3-1.5x faster at decode batch sizes (8-64 rows) and up to 6x for the LM head at one row, and
about 10% faster for prefill chunks of 2,048 rows (``python -m benchmarks.cpu_kernels``).
The packed tensor replaces the dense weight, so the model's memory does not grow, except for a LM
head tied to the embeddings: its packed copy sits next to the embedding table (vocab x hidden).

Results equal ``F.linear`` up to float32 summation order (about 1e-6 relative).
Set ``ASYNCLLM_CPU_PACKED_LINEAR=0`` to keep plain ``nn.Linear`` (for A/B runs and debugging).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger(__name__)

ENV_SWITCH = "ASYNCLLM_CPU_PACKED_LINEAR"
_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linear layers for this device and dtype can use packed oneDNN weights here."""
    if device.type != "cpu" or dtype not in _PACKABLE_DTYPES:
        return False
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)())
    return True


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held as a oneDNN-packed tensor (CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype | None = None) -> None:
        """``compute_dtype=torch.bfloat16`` on float32 inputs: the weight packed in bf16 and each call's input
        rounded to bf16 for oneDNN's bf16 matmul (AVX512-BF16: twice float32's multiply-adds per instruction),
        the output widened back to float32 and the bias added in float32 (dtype="bfloat16" on CPU, docs/cpu.md)."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.compute_dtype = compute_dtype if compute_dtype is not None and compute_dtype != weight.dtype else None
        packed_weight = weight.detach().contiguous()
        if self.compute_dtype is not None:
            packed_weight = packed_weight.to(self.compute_dtype)
        # A plain attribute, not a parameter: module utilities (.to, state_dict) cannot handle the
        # opaque mkldnn layout, and the engine never moves or saves a loaded model.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(packed_weight)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, compute_dtype: torch.dtype | None = None) -> "PackedLinear":
        return cls(linear.weight, linear.bias, compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, rebuilt on demand (for inspection; the forward never uses it)."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype is not None:
            return self.forward_as(x, x.dtype)
        return self._matmul(x, self.bias)

    def forward_as(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x @ W.T + b`` returned in ``dtype``, ``x`` in float32 or the compute dtype: with a bf16 compute dtype,
        a bf16 input skips the rounding pass and a bf16 output the widening one (the bf16 prefill MLP keeps its
        activations bf16 from gate_up to down, model/mlp.py)."""
        compute = self.compute_dtype or self.dtype
        out = self._matmul(x.to(compute), None if self.compute_dtype is not None else self.bias).to(dtype)
        if self.compute_dtype is None or self.bias is None:
            return out
        return out + self.bias.to(dtype)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0] if x.dim() == 2 else None
        padded = row_bucket(rows) if rows is not None else None
        if padded is None or padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        # not F.pad: it fills the whole padded tensor before copying x in, a second pass over a multi-MiB input
        # in every padded prefill call; only the few padding rows need zeros (rows of a matmul are independent)
        padded_x = x.new_empty((padded, x.shape[1]))
        padded_x[:rows].copy_(x)
        padded_x[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(padded_x, self.packed, bias, "none", [], "")[:rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def row_bucket(rows: int) -> int:
    """The row count a call with ``rows`` rows runs at: exact up to 32, then rounded up to one of 16
    evenly spaced sizes per power of two up to 512 (a multiple of 2 to 64, of 4 to 128, of 8 to 256,
    of 16 to 512), and of 8 beyond (a multiple of 64 to 1,024, of 128 to 2,048, ...).

    oneDNN builds (and caches, 1,024 entries LRU) one primitive per input shape, each with its own
    buffers; a serving engine sees every token count from 1 to the step budget, so without buckets
    the cache churns and the process's memory creeps up for thousands of requests (W-SOAK measured
    it). Each row count seen also keeps memory of its own, outside that cache, growing with the rows
    (about 14 MB for a 2048x2048 weight at 1,500 rows; docs/cpu.md), hence coarser buckets for large
    calls: one layer shape has at most 112 of them up to 2,048 rows. Padding stays under 1/16 of the
    rows up to 512 rows, where a stall-free step's decodes plus a prefill chunk land (multiples of 128
    made a 257-row call 40% slower than an exact one), and under 1/8 beyond."""
    if rows <= 32:
        return rows
    per_octave_log2 = 4 if rows <= 512 else 3
    step = 1 << (rows.bit_length() - 1 - per_octave_log2)
    return -(-rows // step) * step


def pack_linear_layers(model: nn.Module, extra: dict[str, torch.Tensor] | None = None,
                       compute_dtype: torch.dtype | None = None) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a :class:`PackedLinear`, in place.

    ``extra`` maps attribute names on ``model`` to weights that should become packed linear layers too
    (the LM head of a model whose head is tied to its embeddings); ``compute_dtype``: see PackedLinear.
    Returns how many layers were packed.
    """
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear.from_linear(linear, compute_dtype))
    for attr, weight in (extra or {}).items():
        setattr(model, attr, PackedLinear(weight, None, compute_dtype))
    count = len(targets) + len(extra or {})
    logger.info("packed %d linear layers for oneDNN", count)
    return count
