"""Quantized checkpoints' tensors, loaded into one layout per kind of weight (a LinearMethod per layer).

A projection of a quantized checkpoint arrives as several tensors per checkpoint projection: GPTQ's
``qweight``/``qzeros``/``scales``/``g_idx``, AWQ's, compressed-tensors' ``weight_packed``/``weight_scale``/
``weight_zero_point``, FP8's ``weight`` with ``weight_scale(_inv)``. :class:`CheckpointWeights` takes each one
as it comes, in the part of a fused projection it belongs to (q/k/v, gate/up). Each is brought to the layout
of kernels/quant_linear.py at once, so the float weight never exists. ``finish`` then makes the module that
runs:

- GroupQuantLinear for 4-bit, and for 8-bit with zero points;
- Int8Linear (the int8 C and Triton kernels) for symmetric 8-bit and W8A8;
- Fp8Linear for FP8.

Every format's packing is undone here. The test helpers (tests/quantized_checkpoints.py) write each format
independently, and the tests check the two against each other and against each tool's own unpacking.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError, ModelLoadError
from ..kernels.quant_linear import Fp8Linear, GroupQuantLinear, pack_int4, unpack_int4
from .quant_formats import QuantizedFormat

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of an int32 holds column AWQ_ORDER[i] of its 8
_PRIMARY = {"gptq": "qweight", "awq": "qweight", "ct-packed": "weight_packed", "ct-int8": "weight", "fp8": "weight"}
_KINDS = {"gptq": {"qweight", "qzeros", "scales", "g_idx"}, "awq": {"qweight", "qzeros", "scales"},
          "ct-packed": {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"},
          "ct-int8": {"weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point"},
          "fp8": {"weight", "weight_scale", "weight_scale_inv", "input_scale"}}
_IGNORED = {"input_scale", "input_zero_point", "weight_shape"}  # activations run in float; the shape is checked


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of ``32 // bits`` values each (value j in bits ``j*bits``..), unpacked along ``dim``."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:
        values = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)  # [W, per_word, C]
        return values.reshape(words.shape[0] * per_word, words.shape[1])
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, W, per_word]
    return values.reshape(words.shape[0], words.shape[1] * per_word)


class CheckpointWeights:
    """A LinearMethod (model/layers.py) for a projection of a quantized checkpoint."""

    def __init__(self, layer: nn.Module, fmt: QuantizedFormat) -> None:
        if layer.tp.enabled:
            raise ConfigError(f"{fmt.describe()} checkpoints run with tensor_parallel_size=1 only for now "
                              "(docs/quantization.md)")
        self.fmt = fmt
        n, k = layer.out_features, layer.in_features
        device = layer.weight.device
        self.n, self.k = n, k
        self.filled: dict[tuple, set[str]] = {}  # part -> kinds loaded
        layer.weight = nn.Parameter(torch.empty(0, device=device), requires_grad=False)  # never float
        if fmt.kind == "int":
            group = fmt.group_size or k
            if k % group:
                raise ModelLoadError(f"{fmt.method}: groups of {group} do not divide the input width {k}")
            self.groups = k // group
            self.packed = torch.zeros(n, k * fmt.bits // 8, dtype=torch.uint8, device=device)
            self.scales = torch.zeros(n, self.groups, dtype=torch.float32, device=device)
            # symmetric formats store no zero points: the middle of the range
            self.zeros = torch.full((n, self.groups), float(1 << (fmt.bits - 1)), device=device)
            self.g_idx: torch.Tensor | None = None
        elif fmt.kind == "int8":
            self.qweight = torch.zeros(n, k, dtype=torch.int8, device=device)
            self.scales = torch.zeros(n, 1, dtype=torch.float32, device=device)
        else:
            self.weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device)
            self.block_k = fmt.block[1] if fmt.block else None
            # per-row scales (per-tensor ones of q, k and v differ: each part's rows get its own), or with
            # blocks one per row and block of columns
            self.scale = torch.zeros(n, -(-k // self.block_k) if self.block_k else 1, dtype=torch.float32,
                                     device=device)

    # ---- LinearMethod ----------------------------------------------------------------------------
    def handles(self, kind: str) -> bool:
        return kind in _KINDS[self.fmt.layout]

    def primary(self, kind: str) -> bool:
        """Whether ``kind`` is the tensor that stands for the layer's weight (the loader's bookkeeping)."""
        return kind == _PRIMARY[self.fmt.layout]

    def load(self, layer: nn.Module, kind: str, start: int, size: int, tensor: torch.Tensor, name: str) -> None:
        """One checkpoint tensor for rows ``start:start+size`` of this layer."""
        if kind in _IGNORED:
            if kind == "weight_shape" and tuple(int(v) for v in tensor.tolist()) != (size, self.k):
                raise ModelLoadError(f"tensor {name!r}: weight_shape {tensor.tolist()}, expected {[size, self.k]}")
            return
        getattr(self, f"_{self.fmt.layout.replace('-', '_')}")(kind, start, size, tensor, name)
        self.filled.setdefault((start, size), set()).add(kind)

    def load_rows(self, layer, start, size, value, name) -> None:
        raise ModelLoadError(f"tensor {name!r}: a float weight where the checkpoint's quantization_config "
                             f"({self.fmt.describe()}) promises quantized tensors")

    def finish(self, layer: nn.Module) -> nn.Module:
        self._check_complete(layer)
        bias = None if layer.bias is None else layer.bias.data
        if self.fmt.kind == "fp8":
            block = (1, self.block_k) if self.block_k else None
            return Fp8Linear(self.weight, self.scale, block, bias)
        if self.fmt.kind == "int8":
            from ..kernels.int8_linear import Int8Linear

            return Int8Linear(self.qweight, self.scales, bias)
        perm = None
        packed, scales, zeros = self.packed, self.scales, self.zeros
        if self.g_idx is not None and self.fmt.desc_act:
            packed, scales, zeros, perm = self._sorted_by_group(layer)
        if self.fmt.bits == 8 and perm is None and bool((zeros == 128).all()):
            from ..kernels.int8_linear import Int8Linear  # symmetric 8-bit: the int8 kernels, decode stack too

            return Int8Linear((packed.to(torch.int16) - 128).to(torch.int8), scales, bias)
        return GroupQuantLinear(packed, scales, zeros, self.fmt.bits, bias, perm)

    # ---- the formats -------------------------------------------------------------------------------
    def _put_values(self, start: int, size: int, values: torch.Tensor, name: str) -> None:
        """Unsigned codes ``[size, K]`` into this layer's packed rows."""
        if tuple(values.shape) != (size, self.k):
            raise ModelLoadError(f"tensor {name!r} unpacks to {tuple(values.shape)}, expected {(size, self.k)}")
        rows = pack_int4(values) if self.fmt.bits == 4 else values.to(torch.uint8)
        self.packed[start:start + size].copy_(rows)

    def _put_groups(self, target: torch.Tensor, start: int, size: int, values: torch.Tensor, name: str) -> None:
        if tuple(values.shape) != (size, self.groups):
            raise ModelLoadError(f"tensor {name!r} gives {tuple(values.shape)} group values, expected "
                                 f"{(size, self.groups)}")
        target[start:start + size].copy_(values.float())

    def _g_idx(self, tensor: torch.Tensor, name: str) -> None:
        g_idx = tensor.to(torch.int64)
        if tuple(g_idx.shape) != (self.k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= self.groups:
            raise ModelLoadError(f"tensor {name!r}: expected {self.k} group indices below {self.groups}")
        if self.g_idx is not None and not torch.equal(self.g_idx, g_idx):
            # the parts of a fused projection share their input, and act-order sorts by it: one order
            raise ModelLoadError(f"tensor {name!r}: its act-order differs from the other parts of the fused "
                                 "projection")
        self.g_idx = g_idx

    def _gptq(self, kind, start, size, tensor, name) -> None:
        bits = self.fmt.bits
        if kind == "qweight":  # [K * bits / 32, N] packed along the input
            self._put_values(start, size, unpack_int32(tensor, bits, 0).t(), name)
        elif kind == "qzeros":  # [G, N * bits / 32] packed along the output; v1 stores zero - 1
            zeros = unpack_int32(tensor, bits, 1)[:, :size] + self.fmt.zero_offset
            self._put_groups(self.zeros, start, size, zeros.t(), name)
        elif kind == "scales":  # [G, N]
            self._put_groups(self.scales, start, size, tensor.t(), name)
        elif kind == "g_idx":
            self._g_idx(tensor, name)

    def _awq(self, kind, start, size, tensor, name) -> None:
        if kind in ("qweight", "qzeros"):  # [rows, N / 8] packed along the output, interleaved
            values = unpack_int32(tensor, 4, 1)
            columns = values.reshape(values.shape[0], -1, 8)
            inverse = torch.argsort(torch.tensor(AWQ_ORDER))  # column c of 8 sits in nibble inverse[c]
            values = columns[:, :, inverse].reshape(values.shape[0], -1)[:, :size]
            if kind == "qweight":
                self._put_values(start, size, values.t(), name)
            else:
                self._put_groups(self.zeros, start, size, values.t(), name)
        elif kind == "scales":
            self._put_groups(self.scales, start, size, tensor.t(), name)

    def _ct_packed(self, kind, start, size, tensor, name) -> None:
        bits = self.fmt.bits
        if kind == "weight_packed":  # [N, K * bits / 32] packed along the input, codes = value + 2**(bits-1)
            self._put_values(start, size, unpack_int32(tensor, bits, 1)[:, :self.k], name)
        elif kind == "weight_scale":  # [N, G]
            self._put_groups(self.scales, start, size, tensor.reshape(size, -1), name)
        elif kind == "weight_zero_point":  # [N * bits / 32, G] packed along the output, offset like the weights
            zeros = unpack_int32(tensor, bits, 0)[:size] if tensor.dtype == torch.int32 \
                else tensor.to(torch.int32).reshape(size, -1) + (1 << (bits - 1))
            self._put_groups(self.zeros, start, size, zeros, name)
        elif kind == "weight_g_idx":
            self._g_idx(tensor, name)

    def _ct_int8(self, kind, start, size, tensor, name) -> None:
        if kind == "weight":
            if tensor.dtype != torch.int8 or tuple(tensor.shape) != (size, self.k):
                raise ModelLoadError(f"tensor {name!r}: expected int8 {(size, self.k)}, got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
            self.qweight[start:start + size].copy_(tensor)
        elif kind == "weight_scale":
            scale = tensor.float().reshape(-1, 1)
            self.scales[start:start + size].copy_(scale.expand(size, 1) if scale.numel() == 1 else scale)
        elif kind == "weight_zero_point" and bool(tensor.any()):
            raise ModelLoadError(f"tensor {name!r}: int8 weights with zero points are not supported (symmetric only)")

    def _fp8(self, kind, start, size, tensor, name) -> None:
        if kind == "weight":
            if tensor.dtype != torch.float8_e4m3fn or tuple(tensor.shape) != (size, self.k):
                raise ModelLoadError(f"tensor {name!r}: expected float8_e4m3fn {(size, self.k)}, got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
            self.weight[start:start + size].copy_(tensor)
            return
        scale = tensor.float()
        if self.block_k:  # [ceil(N / bn), ceil(K / bk)]: each row takes its block row's scales
            bn = self.fmt.block[0]
            if scale.dim() != 2 or tuple(scale.shape) != (-(-size // bn), -(-self.k // self.block_k)):
                raise ModelLoadError(f"tensor {name!r}: block scales of shape {tuple(scale.shape)}, expected "
                                     f"{(-(-size // bn), -(-self.k // self.block_k))}")
            self.scale[start:start + size].copy_(scale.repeat_interleave(bn, 0)[:size])
        elif scale.numel() == 1:
            self.scale[start:start + size].fill_(float(scale.reshape(())))
        elif scale.numel() == size:
            self.scale[start:start + size].copy_(scale.reshape(size, 1))
        else:
            raise ModelLoadError(f"tensor {name!r}: {scale.numel()} scales for {size} rows")

    # ---- after loading -----------------------------------------------------------------------------
    def _check_complete(self, layer: nn.Module) -> None:
        needed = {"gptq": {"qweight", "scales"} | ({"qzeros"} if not self.fmt.sym else set()),
                  "awq": {"qweight", "scales"} | ({"qzeros"} if not self.fmt.sym else set()),
                  "ct-packed": {"weight_packed", "weight_scale"} | ({"weight_zero_point"} if not self.fmt.sym else set()),
                  "ct-int8": {"weight", "weight_scale"},
                  "fp8": {"weight", self.fmt.scale_name}}[self.fmt.layout]
        if self.fmt.desc_act and self.fmt.layout == "gptq":
            needed = needed | {"g_idx"}
        for part, kinds in self.filled.items():
            missing = needed - kinds
            if missing:
                raise ModelLoadError(f"{type(layer).__name__} rows {part[0]}..{part[0] + part[1]}: the checkpoint "
                                     f"lacks {', '.join(sorted(missing))}")

    def _sorted_by_group(self, layer: nn.Module):
        """Act-order: columns reordered so each group's are contiguous, and the input gathered to match."""
        perm = torch.argsort(self.g_idx, stable=True)
        counts = torch.bincount(self.g_idx, minlength=self.groups)
        if bool((counts != self.k // self.groups).any()):
            raise ModelLoadError(f"{type(layer).__name__}: act-order groups of unequal sizes are not supported")
        values = unpack_int4(self.packed) if self.fmt.bits == 4 else self.packed
        values = values.index_select(1, perm)
        packed = pack_int4(values) if self.fmt.bits == 4 else values.contiguous()
        # after sorting, column j belongs to group j // group_size: the scales stay as they are
        return packed, self.scales, self.zeros, perm
