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

Every format's packing is undone here. The writers of asyncllm/toy/quantized.py write each format
independently, and the tests check the two against each other and against each tool's own unpacking.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelLoadError
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


FP8_MAX = 448.0  # the largest float8_e4m3fn value


def quantize_fp8_rows(weight: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A float ``[N, K]`` weight as float8_e4m3fn with one float32 scale per row (absmax / 448)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ModelLoadError(f"tensor {name!r}: expected a 2-D float weight to quantize to FP8, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w / scale).to(torch.float8_e4m3fn), scale


class CheckpointWeights:
    """A LinearMethod (model/layers.py) for a projection of a quantized checkpoint.

    Each checkpoint tensor is first brought to a row-major piece of the layouts above, for the whole
    checkpoint projection (``values`` [N, K] codes, ``scales``/``zeros`` [N, groups], ``g_idx`` [K], FP8's
    ``weight`` and per-row ``scale``), then cut to this tensor-parallel rank by the layer's own ``cut``
    (rows of column-parallel layers; columns of row-parallel ones, on group boundaries), then stored."""

    def __init__(self, layer: nn.Module, fmt: QuantizedFormat) -> None:
        self.fmt = fmt
        n, k = layer.out_features, layer.in_features
        self.device = layer.weight.device
        self.n, self.k = n, k
        self.filled: dict[object, set[str]] = {}  # part -> kinds loaded
        self.row_cut = hasattr(layer, "column_share") and layer.tp.enabled  # a RowParallelLinear, cut
        layer.weight = nn.Parameter(torch.empty(0, device=self.device), requires_grad=False)  # never float
        self.g_idx: torch.Tensor | None = None
        # a partial last group (576 columns in groups of 128): stored with zero columns up to whole groups,
        # except under act-order, whose sorted groups are uneven anyway (each column's group is kept)
        group = fmt.group_size or k
        self.stored_k = -(-k // group) * group if fmt.kind == "int" and not fmt.desc_act else k
        if fmt.kind == "int":
            self.packed = torch.zeros(n, self.stored_k * fmt.bits // 8, dtype=torch.uint8, device=self.device)
        elif fmt.kind == "int8":
            self.qweight = torch.zeros(n, k, dtype=torch.int8, device=self.device)
        else:
            self.weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=self.device)
            self.block_k = fmt.block[1] if fmt.block else None
        # [N, groups] tensors, made when the first arrives (with act-order cut by rows, every group is kept)
        self.group_tensors: dict[str, torch.Tensor] = {}

    # ---- LinearMethod ----------------------------------------------------------------------------
    def handles(self, kind: str) -> bool:
        return kind in _KINDS[self.fmt.layout]

    def primary(self, kind: str) -> bool:
        """Whether ``kind`` is the tensor that stands for the layer's weight (the loader's bookkeeping)."""
        return kind == _PRIMARY[self.fmt.layout]

    def load(self, layer: nn.Module, kind: str, part, tensor: torch.Tensor, name: str) -> None:
        """One checkpoint tensor of ``part`` of this layer (the whole checkpoint projection, uncut)."""
        if kind == "weight_shape":
            if int(tensor.reshape(-1)[-1]) != self._full_k(layer):
                raise ModelLoadError(f"tensor {name!r}: weight_shape {tensor.tolist()} has {int(tensor.reshape(-1)[-1])} "
                                     f"input columns, expected {self._full_k(layer)}")
        elif kind not in _IGNORED:
            reader = getattr(self, f"_{self.fmt.layout.replace('-', '_')}")
            start, size = layer.parts[part]
            for target, value in reader(kind, tensor, name).items():
                self._store(target, start, size, self._this_rank(layer, part, target, value, name), name)
        self.filled.setdefault(part, set()).add(kind)

    def load_rows(self, layer, start, size, value, name) -> None:
        raise ModelLoadError(f"tensor {name!r}: a float weight where the checkpoint's quantization_config "
                             f"({self.fmt.describe()}) promises quantized tensors")

    def finish(self, layer: nn.Module) -> nn.Module:
        self._check_complete(layer)
        bias = None if layer.bias is None else layer.bias.data
        if self.fmt.kind == "fp8":
            scale = self.group_tensors["scale"]
            return Fp8Linear(self.weight, scale, (1, self.block_k) if self.block_k else None, bias)
        scales = self.group_tensors["scales"]
        if self.fmt.kind == "int8":
            from ..kernels.int8_linear import Int8Linear

            return Int8Linear(self.qweight, scales, bias)
        # symmetric formats store no zero points: the middle of the range
        zeros = self.group_tensors.get("zeros")
        if zeros is None:
            zeros = torch.full_like(scales, float(1 << (self.fmt.bits - 1)))
        packed, perm, group_index = self.packed, None, None
        if self.g_idx is not None and self.fmt.desc_act and not self._trivial_groups(scales.shape[1]):
            packed, perm, group_index = self._sorted_by_group(scales.shape[1])
        if self.fmt.bits == 8 and perm is None and self.stored_k == self.k and bool((zeros == 128).all()):
            from ..kernels.int8_linear import Int8Linear  # symmetric 8-bit: the int8 kernels, decode stack too

            return Int8Linear((packed.to(torch.int16) - 128).to(torch.int8), scales, bias)
        return GroupQuantLinear(packed, scales, zeros, self.fmt.bits, bias, perm, group_index, in_features=self.k)

    # ---- cutting and storing -------------------------------------------------------------------------
    def _full_k(self, layer: nn.Module) -> int:
        """The checkpoint projection's input width (ranks hold equal shares: TensorParallel.split)."""
        return self.k * layer.tp.size if self.row_cut else self.k

    def _this_rank(self, layer: nn.Module, part, target: str, value: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's share of a whole-projection piece (itself without tensor parallelism)."""
        if not layer.tp.enabled:
            return value
        if not self.row_cut:  # column-parallel: the rank's output rows, as the layer cuts a float weight
            return value if target == "g_idx" else layer.cut("weight", part, value)
        first, count = layer.column_share
        if target == "g_idx":
            return value[first:first + count]
        if target in ("values", "weight", "qweight"):
            return value[:, first:first + count]
        width = value.shape[1]
        if width == 1 or (self.fmt.desc_act and target in ("scales", "zeros")):
            return value  # one scale per row applies to any columns; act-order groups span the ranks: all kept
        group = self.block_k if target == "scale" else -(-self._full_k(layer) // width)
        if first % group or count % group:
            raise ModelLoadError(f"tensor {name!r}: tensor parallelism cuts the input at column {first} (+{count}), "
                                 f"inside a group of {group}: use a tensor_parallel_size whose shares are whole groups")
        return value[:, first // group:(first + count) // group]

    def _store(self, target: str, start: int, size: int, value: torch.Tensor, name: str) -> None:
        if target == "g_idx":
            self._g_idx(value, name)
            return
        if value.shape[0] != size:
            raise ModelLoadError(f"tensor {name!r} gives {value.shape[0]} rows, expected {size}")
        if target == "values":
            if value.shape[1] != self.k:
                raise ModelLoadError(f"tensor {name!r} unpacks to {tuple(value.shape)}, expected {(size, self.k)}")
            if self.stored_k != self.k:
                value = torch.nn.functional.pad(value, (0, self.stored_k - self.k))
            rows = pack_int4(value) if self.fmt.bits == 4 else value.to(torch.uint8)
            self.packed[start:start + size].copy_(rows)
        elif target == "qweight":
            self.qweight[start:start + size].copy_(value)
        elif target == "weight":
            self.weight[start:start + size].copy_(value)
        else:
            held = self.group_tensors.get(target)
            if held is None:
                held = self.group_tensors[target] = torch.zeros(self.n, value.shape[1], device=self.device)
            if held.shape[1] != value.shape[1]:
                raise ModelLoadError(f"tensor {name!r} has {value.shape[1]} groups, the layer's other parts "
                                     f"{held.shape[1]}")
            held[start:start + size].copy_(value.float())

    def _g_idx(self, g_idx: torch.Tensor, name: str) -> None:
        g_idx = g_idx.to(torch.int64).reshape(-1)
        if g_idx.numel() != self.k or int(g_idx.min()) < 0:
            raise ModelLoadError(f"tensor {name!r}: expected {self.k} group indices")
        if self.g_idx is not None and not torch.equal(self.g_idx, g_idx):
            # the parts of a fused projection share their input, and act-order sorts by it: one order
            raise ModelLoadError(f"tensor {name!r}: its act-order differs from the other parts of the fused "
                                 "projection")
        self.g_idx = g_idx

    # ---- the formats: checkpoint tensor -> row-major pieces ---------------------------------------------
    def _gptq(self, kind: str, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        bits = self.fmt.bits
        if kind == "qweight":  # [K * bits / 32, N] packed along the input
            return {"values": unpack_int32(tensor, bits, 0).t()}
        if kind == "qzeros":  # [G, N * bits / 32] packed along the output; v1 stores zero - 1
            return {"zeros": (unpack_int32(tensor, bits, 1)[:, :tensor.shape[1] * 32 // bits]
                              + self.fmt.zero_offset).t()}
        if kind == "scales":  # [G, N]
            return {"scales": tensor.t()}
        return {"g_idx": tensor}

    def _awq(self, kind: str, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        if kind == "scales":  # [G, N]
            return {"scales": tensor.t()}
        values = unpack_int32(tensor, 4, 1)  # [rows, N / 8] packed along the output, interleaved
        inverse = torch.argsort(torch.tensor(AWQ_ORDER))  # column c of each 8 sits in nibble inverse[c]
        values = values.reshape(values.shape[0], -1, 8)[:, :, inverse].reshape(values.shape[0], -1)
        return {"values" if kind == "qweight" else "zeros": values.t()}

    def _ct_packed(self, kind: str, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        bits = self.fmt.bits
        if kind == "weight_packed":  # [N, K * bits / 32] packed along the input, codes = value + 2**(bits-1)
            return {"values": unpack_int32(tensor, bits, 1)}
        if kind == "weight_scale":  # [N, G]
            return {"scales": tensor.reshape(tensor.shape[0], -1)}
        if kind == "weight_zero_point":  # packed along the output ([N * bits / 32, G]), offset like the weights
            if tensor.dtype == torch.int32:
                return {"zeros": unpack_int32(tensor, bits, 0)}
            return {"zeros": tensor.to(torch.int32).reshape(tensor.shape[0], -1) + (1 << (bits - 1))}
        return {"g_idx": tensor}

    def _ct_int8(self, kind: str, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        if kind == "weight":
            if tensor.dtype != torch.int8 or tensor.dim() != 2:
                raise ModelLoadError(f"tensor {name!r}: expected a 2-D int8 weight, got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
            return {"qweight": tensor}
        if kind == "weight_scale":
            return {"scales": tensor.float().reshape(-1, 1)}
        if bool(tensor.any()):  # weight_zero_point
            raise ModelLoadError(f"tensor {name!r}: int8 weights with zero points are not supported (symmetric only)")
        return {}

    def _fp8(self, kind: str, tensor: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        if kind == "weight" and self.fmt.dynamic:  # a float checkpoint run as FP8: each row scaled to e4m3's range
            return dict(zip(("weight", "scale"), quantize_fp8_rows(tensor, name)))
        if kind == "weight":
            if tensor.dtype != torch.float8_e4m3fn or tensor.dim() != 2:
                raise ModelLoadError(f"tensor {name!r}: expected a 2-D float8_e4m3fn weight, got {tensor.dtype} "
                                     f"{tuple(tensor.shape)}")
            self._fp8_rows = tensor.shape[0]
            return {"weight": tensor}
        scale = tensor.float()
        rows = getattr(self, "_fp8_rows", None)
        if self.block_k:  # [ceil(N / bn), ceil(K / bk)]: each row takes its block row's scales
            bn = self.fmt.block[0]
            if scale.dim() != 2:
                raise ModelLoadError(f"tensor {name!r}: block scales must be 2-D, got {tuple(scale.shape)}")
            expanded = scale.repeat_interleave(bn, 0)
            return {"scale": expanded[:rows] if rows else expanded}
        if scale.numel() == 1:  # per tensor: every row of this part the same
            if rows is None:
                raise ModelLoadError(f"tensor {name!r}: a per-tensor scale before its weight")
            return {"scale": scale.reshape(1, 1).expand(rows, 1)}
        return {"scale": scale.reshape(-1, 1)}

    # ---- after loading -----------------------------------------------------------------------------
    def _check_complete(self, layer: nn.Module) -> None:
        sym = self.fmt.sym
        needed = {"gptq": {"qweight", "scales"} | (set() if sym else {"qzeros"}),
                  "awq": {"qweight", "scales"} | (set() if sym else {"qzeros"}),
                  "ct-packed": {"weight_packed", "weight_scale"} | (set() if sym else {"weight_zero_point"}),
                  "ct-int8": {"weight", "weight_scale"},
                  "fp8": {"weight"} if self.fmt.dynamic else {"weight", self.fmt.scale_name}}[self.fmt.layout]
        if self.fmt.desc_act and self.fmt.layout == "gptq":
            needed = needed | {"g_idx"}
        for part, kinds in self.filled.items():
            missing = needed - kinds
            if missing:
                raise ModelLoadError(f"{type(layer).__name__} part {part!r}: the checkpoint lacks "
                                     f"{', '.join(sorted(missing))}")

    def _trivial_groups(self, groups: int) -> bool:
        """g_idx is column k -> k // group size (what GPTQ writes without act-order)."""
        return self.k % groups == 0 and torch.equal(self.g_idx, torch.arange(self.k) // (self.k // groups))

    def _sorted_by_group(self, groups: int):
        """Act-order: columns reordered so each group's are contiguous, and the input gathered to match. Where
        the groups come out uneven (a rank's share of an act-order layer), each column's group is kept."""
        perm = torch.argsort(self.g_idx, stable=True)
        values = unpack_int4(self.packed) if self.fmt.bits == 4 else self.packed
        values = values.index_select(1, perm)
        packed = pack_int4(values) if self.fmt.bits == 4 else values.contiguous()
        counts = torch.bincount(self.g_idx, minlength=groups)
        even = self.k % groups == 0 and bool((counts == self.k // groups).all())
        # even: sorted column j is in group j // group size, the scales stay as they are
        return packed, perm, None if even else self.g_idx[perm]
