"""Linear layers that load and shard their own weights, with a hook for how the weights are stored.

Each projection of the decoder is one of these ``nn.Linear`` subclasses; it knows its layout:
which rows a checkpoint piece fills (``q``/``k``/``v`` of a fused ``qkv_proj``, 0/1 of a fused
``gate_up_proj``, or the whole tensor) and what one tensor-parallel rank keeps of it (its heads, its
intermediate columns, its share of the input columns, its vocabulary rows). The loader hands each
checkpoint tensor to :meth:`ParallelLinear.weight_loader` with the part it is and knows nothing of
layouts (model/loader.py).

How the weights are held is the layer's ``method`` (:class:`LinearMethod`): float weights in the
layer's own ``weight`` (:class:`FloatWeights`), or int8 rows and scales filled as they arrive
(:class:`Int8Weights`, model/quantization.py chooses). After loading, :func:`finish_layers` turns
each layer into what runs: itself for float weights (its forward is ``nn.Linear``'s), an
``Int8Linear`` for int8. Other weight formats (GPTQ, AWQ, FP8) are further ``LinearMethod``s.

Int8 rows as a GGUF Q8_0 file stores them (``QuantizedRows``) are cut as they are: rows always,
columns when the cut falls on a group boundary (else they are widened first).
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel import SINGLE, TensorParallel
from ..errors import ModelLoadError
from .gguf_weights import QuantizedRows
from .weight_slices import Weight, cat_rows, columns, pad_rows, rows


class LinearMethod:
    """How a layer holds its weight: made when the model is, filled row slice by row slice, then
    turned into the module that runs."""

    def load_rows(self, layer: "ParallelLinear", start: int, size: int, value: Weight, name: str) -> None:
        raise NotImplementedError

    def finish(self, layer: "ParallelLinear") -> nn.Module:
        raise NotImplementedError


class FloatWeights(LinearMethod):
    """The layer's own float ``weight``; int8 rows from a file are widened."""

    def load_rows(self, layer, start, size, value, name) -> None:
        if isinstance(value, QuantizedRows):
            value = value.dequantize()
        _copy(layer.weight.data[start:start + size], value, name)

    def finish(self, layer) -> nn.Module:
        return layer


class Int8Weights(LinearMethod):
    """Int8 rows with float32 scales (``group_size`` values per scale; None: one per row), filled as
    float rows arrive (quantized here) or as int8 rows a file stores; the float weight is dropped."""

    def __init__(self, layer: "ParallelLinear", group_size: int | None) -> None:
        from .quantization import Int8Slot

        device = layer.weight.device
        self.slot = Int8Slot(layer.in_features, layer.out_features, False, group_size, device)
        layer.weight = nn.Parameter(torch.empty(0, device=device), requires_grad=False)  # not needed any more

    def load_rows(self, layer, start, size, value, name) -> None:
        self.slot.assign_rows(start, size, value, name)

    def finish(self, layer) -> nn.Module:
        from ..kernels.int8_linear import Int8Linear

        return Int8Linear(self.slot.qweight, self.slot.scales, None if layer.bias is None else layer.bias.data)


class ParallelLinear(nn.Linear):
    """A projection whose rows come from one or more checkpoint pieces (``parts``: part -> (first row,
    rows) in this rank's weight) and whose checkpoint tensors this rank cuts to its share."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.method: LinearMethod = FloatWeights()
        self.parts: dict = {None: (0, out_features)}

    def weight_loader(self, kind: str, tensor: Weight, part, name: str) -> None:
        """Put checkpoint tensor ``name`` (this layer's ``kind``, "weight" or "bias", for ``part``)
        where it belongs, cut to this rank."""
        if part not in self.parts:
            raise ModelLoadError(f"tensor {name!r}: {type(self).__name__} has no part {part!r}")
        start, size = self.parts[part]
        handles = getattr(self.method, "handles", None)
        if kind != "bias" and handles is not None and handles(kind):  # a quantized checkpoint's tensors
            self.method.load(self, kind, part, tensor, name)  # (it cuts to this rank itself)
            return
        value = self.cut(kind, part, tensor)
        if kind == "bias":
            if self.bias is None:
                raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (the layer has no bias)")
            _copy(self.bias.data[start:start + size], value, name)
        else:
            self.method.load_rows(self, start, size, value, name)

    def cut(self, kind: str, part, tensor: Weight) -> Weight:
        """This rank's share of a checkpoint tensor (all of it without tensor parallelism)."""
        return tensor


class ColumnParallelLinear(ParallelLinear):
    """Output rows split over the ranks in equal shares (no all-reduce: each rank's rows are its own)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(in_features, out_features // tp.size, bias, tp)
        self.row_share = tp.split(out_features)

    def cut(self, kind, part, tensor):
        return rows(tensor, *self.row_share) if self.tp.enabled else tensor


class QKVParallelLinear(ParallelLinear):
    """q, k and v projections in one matmul: this rank's query heads, then its KV heads (a share, or
    one replicated head when there are fewer KV heads than ranks)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 tp: TensorParallel = SINGLE) -> None:
        """``num_heads``/``num_kv_heads``: the whole model's."""
        q_start, q_heads = tp.split(num_heads)
        kv_start, kv_heads = tp.kv_heads(num_kv_heads)
        q, kv = q_heads * head_dim, kv_heads * head_dim
        super().__init__(hidden, q + 2 * kv, bias, tp)
        self.parts = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), None: (0, q + 2 * kv)}
        self.shares = {"q": (q_start * head_dim, q), "k": (kv_start * head_dim, kv), "v": (kv_start * head_dim, kv)}
        self.full = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}

    def cut(self, kind, part, tensor):
        if not self.tp.enabled:
            return tensor
        if part is not None:
            return rows(tensor, *self.shares[part])
        at, pieces = 0, []  # stored fused (Phi-3): q rows, then k, then v
        for p in "qkv":
            pieces.append(rows(rows(tensor, at, self.full[p]), *self.shares[p]))
            at += self.full[p]
        return cat_rows(pieces)


class MergedColumnParallelLinear(ParallelLinear):
    """Several column-parallel projections in one matmul (gate and up): part i's rows follow part i-1's."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool, tp: TensorParallel = SINGLE) -> None:
        """``sizes``: each part's whole output width (each a multiple of the ranks)."""
        local = [size // tp.size for size in sizes]
        super().__init__(in_features, sum(local), bias, tp)
        starts = [sum(local[:i]) for i in range(len(local))]
        self.parts = {i: (starts[i], local[i]) for i in range(len(sizes))}
        self.parts[None] = (0, sum(local))
        self.sizes, self.shares = sizes, [tp.split(size) for size in sizes]

    def cut(self, kind, part, tensor):
        if not self.tp.enabled:
            return tensor
        if part is not None:
            return rows(tensor, *self.shares[part])
        at, pieces = 0, []  # stored fused (Phi-3, GLM-4): the parts' rows one after another
        for size, share in zip(self.sizes, self.shares):
            pieces.append(rows(rows(tensor, at, size), *share))
            at += size
        return cat_rows(pieces)


class RowParallelLinear(ParallelLinear):
    """Input columns split over the ranks (``column_share``: this rank's (first column, count)); the
    ranks' partial outputs are summed by the caller's all-reduce, so only rank 0 adds the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, column_share: tuple[int, int],
                 tp: TensorParallel = SINGLE) -> None:
        """``in_features``: this rank's input width (``column_share[1]``)."""
        super().__init__(in_features, out_features, bias, tp)
        self.column_share = column_share

    def cut(self, kind, part, tensor):
        if not self.tp.enabled:
            return tensor
        if kind == "bias":  # added once to the summed output
            return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
        return columns(tensor, *self.column_share)


class VocabParallelLMHead(ParallelLinear):
    """One rank's vocabulary rows of the LM head (the last rank's padded with zero rows)."""

    def __init__(self, hidden: int, vocab_size: int, tp: TensorParallel = SINGLE) -> None:
        self.vocab_start, per_rank = tp.vocab(vocab_size)
        super().__init__(hidden, per_rank, False, tp)
        self.vocab_size = vocab_size

    def cut(self, kind, part, tensor):
        if not self.tp.enabled:
            return tensor
        start, per_rank = self.vocab_start, self.out_features
        return pad_rows(rows(tensor, start, max(0, min(per_rank, self.vocab_size - start))), per_rank)


def vocab_rows(tensor: Weight, tp: TensorParallel, vocab_size: int) -> Weight:
    """This rank's rows of a vocabulary-sized table (the embedding), padded like the LM head's."""
    if not tp.enabled:
        return tensor
    start, per_rank = tp.vocab(vocab_size)
    return pad_rows(rows(tensor, start, max(0, min(per_rank, vocab_size - start))), per_rank)


def use_int8(model: nn.Module, group_size: int | None) -> int:
    """Every ParallelLinear of ``model`` holds int8 weights from now on (before loading)."""
    layers = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    for layer in layers:
        layer.method = Int8Weights(layer, group_size)
    return len(layers)


def use_checkpoint_quantization(model: nn.Module, fmt) -> int:
    """Every projection the quantized checkpoint ``fmt`` (model/quant_formats.py) stores quantized takes its
    tensors from now on (before loading); the LM head and the modules it lists as ignored stay float. Returns
    how many ParallelLinear layers changed (modules with ``use_checkpoint_format`` are told, not counted)."""
    from .quant_methods import CheckpointWeights

    count = 0
    for name, layer in model.named_modules():
        if isinstance(layer, ParallelLinear) and not isinstance(layer, VocabParallelLMHead) and not fmt.skips(name):
            layer.method = CheckpointWeights(layer, fmt)
            count += 1
    # modules that read their own tensors: expert stacks (model/moe_quantized.py), DeepSeek's kv_b_proj (model/mla.py)
    for name, module in list(model.named_modules()):
        if hasattr(module, "use_checkpoint_format") and not fmt.skips(name):
            module.use_checkpoint_format(fmt)
    return count


def finish_layers(model: nn.Module) -> int:
    """Replace every loaded ParallelLinear by the module its method makes; how many changed type."""
    changed = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, ParallelLinear):
            done = module.method.finish(module)
            if done is not module:
                parent_name, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, attr, done)
                changed += 1
    return changed


def _copy(destination: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if destination.shape != tensor.shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(destination.shape)}")
    destination.copy_(tensor)
