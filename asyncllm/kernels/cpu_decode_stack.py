"""The CPU decode step of a batch as one C call (``csrc/decode_stack.c``).

A decode-only step (one new token per sequence) of at most :data:`MAX_PANEL_ROWS` (64) sequences on
float32 weights, or :data:`MAX_ROWS` (4) on int8 weights or on a build without AVX-512, skips the
module-by-module forward: after the embedding lookup, one call runs every layer, and the LM head
follows. At batch 1, ~15 torch operations per layer cost more than reading the layer's weights; at
batch 32 on SmolLM2 the module path spent ~10 of a 41 ms step between its projections (norms,
rotary, cache writes, attention calls, Python), and its oneDNN projections reached 370 GFLOP/s
where this kernel's register-blocked tiles reach more (31 ms a step; docs/cpu.md). Prefill chunks,
mixed steps and larger batches keep the regular path (oneDNN's packed GEMM wins on many rows).

Float32 projections are read as panels of 32 output columns (:func:`to_panels`, made at load; the
oneDNN-packed copies serve the regular path, so float32 weights are held twice while this path is
on; ``ASYNCLLM_CPU_DECODE_STACK=0`` turns it off); builds without AVX-512 read them row-major.
Int8 projections are read straight from their ``qweight``/``scales`` buffers (no second copy), and so are
4-bit and asymmetric 8-bit ones (``GroupQuantLinear`` of a GPTQ / AWQ / compressed-tensors checkpoint:
``packed`` nibbles or bytes, ``scales``, ``zeros``; one group size for every projection, a padded partial
last group included; act-order layers gather their input by ``perm`` first, unless a tensor-parallel cut
left their groups uneven), by int4_linear.c's loops, for batches up to :data:`MAX_PANEL_ROWS` rows.
Not used for LoRA steps, Qwen3's q/k norms, families whose layers are not Llama's (``DecoderShape.llama_math``,
plain full-width rope), or shapes the kernel does not take (widths not a multiple of 8).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from .cpu_build import load_library
from .quant_linear import GroupQuantLinear
from .metadata import AttentionMetadata

logger = logging.getLogger(__name__)

ENV_SWITCH = "ASYNCLLM_CPU_DECODE_STACK"
# Decode batches up to this size run here on row-major weights (int8, or float32 without AVX-512); from
# 8 rows oneDNN's packed GEMM is faster than their per-row dot products (measured on SmolLM2).
MAX_ROWS = 4
# ... and up to this size on float32 panels, whose tiles beat oneDNN at 8-64 rows (measured on SmolLM2:
# 14.5 vs 20.5 ms a step at 8 rows, 31 vs 41 at 32, 60 vs 70 at 64).
MAX_PANEL_ROWS = 64
PANEL = 32  # output columns per panel (csrc/decode_stack.c)
# Speculative verification steps of one or two sequences (1 + k rows each) also run here, one row per token:
# the general path's per-layer torch calls cost more than the extra rows (docs/decoding.md).
MAX_CHAINED_ROWS = 8
# ... and on panels, any step of up to MAX_PANEL_ROWS tokens, and a step of decodes beside prefill chunks of up to
# MAX_MIXED_ROWS tokens whose chunks end within MAX_MIXED_CONTEXT positions: such a step then reads the weights once,
# where cutting it in two (model/mixed_steps.py) reads them twice and pays the modules' per-layer calls. Measured
# on cpu-llama float32 (docs/cpu.md#the-decode-stack): a 64-token prompt alone 7.6 vs 16.0 ms through the modules;
# W-STREAM at 64 streams 902 vs 824-857 tokens/s. A prompt alone past 64 tokens goes to the modules, whose flash
# attention reads each key once for all the chunk's rows where the stack's rows read it one by one (512 tokens:
# 70 vs 58-62 ms); so does a chunk deep in a long prompt, for the same reason.
MAX_MIXED_ROWS = 512
MAX_MIXED_CONTEXT = 1024


@dataclass(frozen=True)
class StackLimits:
    """Which steps the decode stack runs whole (one C call); larger ones take an eager pass through the modules."""

    decode_rows: int       # a decode-only step of at most this many rows
    chained_rows: int      # any step of at most this many tokens, one row per token
    mixed_rows: int        # a step with decodes beside prefill chunks, of at most this many tokens ...
    mixed_context: int     # ... whose chunks all end within this many positions

    def runs_whole(self, num_new_tokens: list[int], ends: list[int]) -> bool:
        """Whether a step of these new-token counts (sequence ``i`` reaching position ``ends[i]``) runs whole."""
        tokens = sum(num_new_tokens)
        if all(n == 1 for n in num_new_tokens):
            return tokens <= self.decode_rows
        if tokens <= self.chained_rows:
            return True
        return (tokens <= self.mixed_rows and any(n == 1 for n in num_new_tokens)
                and all(end <= self.mixed_context for n, end in zip(num_new_tokens, ends) if n > 1))


_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_LAYER_FIELDS = ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_scales", "o_scales",
                 "gate_up_scales", "down_scales", "qkv_bias", "k_cache", "v_cache", "qkv_zeros", "o_zeros",
                 "gate_up_zeros", "down_zeros", "qkv_perm", "o_perm", "gate_up_perm", "down_perm")
# the weights' kinds the kernel reads (its ``kind`` argument)
# bfloat16: panels of bf16 values (AVX-512); uint8: GroupQuantLinear's 8-bit codes with zero points
WEIGHT_KINDS = {"float32": 0, "int8": 1, "int4": 2, "bfloat16": 3, "uint8": 4}
GROUP_QUANT_BITS = {"int4": 4, "uint8": 8}  # the GroupQuantLinear kinds, by their bits
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in _LAYER_FIELDS]


_SIGNATURES = (("decode_stack_f32", (ctypes.POINTER(_Layer), _i64, _int, _i64, _ptr, _i64, _ptr, _f32, _i64, _i64,
                                     _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _f32,
                                     _int, _int, _int), _int),
               ("decode_stack_panels", (), _int),
               ("panel_linear_f32", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int), _int),
               ("panel_linear_bf16", (_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int), _int),
               ("decode_stack_dp_rows", (), _int),
               ("decode_stack_amx_rows", (), _int),
               ("decode_stack_set_amx_rows", (_int,), _int),
               ("decode_stack_amx_calls", (), _i64))


def _library() -> ctypes.CDLL | None:
    return load_library("decode_stack", _SIGNATURES)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def panels_supported() -> bool:
    """Whether the built kernel reads float32 weights in panels (AVX-512 builds), and so takes decode
    batches up to :data:`MAX_PANEL_ROWS` rows."""
    lib = _library()
    return lib is not None and bool(lib.decode_stack_panels())


def bf16_dot_rows() -> int:
    """The fewest rows of a step for which bf16 panels multiply with bf16 dot products (``vdpbf16ps``, the
    activations rounded to bf16), or 0 where this build has no AVX512-BF16 (float32 activations always)."""
    lib = _library()
    return int(lib.decode_stack_dp_rows()) if lib is not None else 0


def amx_rows() -> int:
    """The fewest rows of a step for which bf16 panels multiply in AMX tiles (``tdpbf16ps``), or 0 where the
    build has no AMX-BF16, the OS did not grant the tile state, or :func:`set_amx_rows` switched them off."""
    lib = _library()
    return int(lib.decode_stack_amx_rows()) if lib is not None else 0


def amx_calls() -> int:
    """How many projections (counted once per thread) multiplied in AMX tiles in this process: how tests and
    benchmarks see that the tiles did the work."""
    lib = _library()
    return int(lib.decode_stack_amx_calls()) if lib is not None else 0


def set_amx_rows(rows: int) -> int:
    """Sets the fewest rows that use AMX tiles (0 = off; the process-wide switch benchmarks turn) where the
    OS granted them; returns the threshold in force."""
    lib = _library()
    return int(lib.decode_stack_set_amx_rows(int(rows))) if lib is not None else 0


def pair_panels_bf16(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight holding bf16-rounded values as the kernel's paired bf16 panels: [ceil(N / 32),
    ceil(K / 2), 64], where entry [p, j, 2c + h] is the weight of output column 32 p + c at input column
    2 j + h (zeros past N and past K): the two weights a ``vdpbf16ps`` lane multiplies side by side."""
    panels = to_panels(weight)  # [P, K, 32]
    p, k, _ = panels.shape
    if k % 2:
        panels = torch.cat([panels, panels.new_zeros(p, 1, PANEL)], dim=1)
    pairs = panels.reshape(p, -1, 2, PANEL).transpose(2, 3)  # [P, K2, 32, 2]
    return pairs.to(torch.bfloat16).reshape(p, -1, 2 * PANEL).contiguous()


def unpair_panels_bf16(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The dense float32 [N, K] weight back from :func:`pair_panels_bf16`'s panels (exact)."""
    p, pairs, _ = panels.shape
    dense = panels.reshape(p, pairs, PANEL, 2).permute(0, 2, 1, 3).reshape(p * PANEL, 2 * pairs)
    return dense[:out_features, :in_features].float()


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight as the kernel's panels: [ceil(N / 32), K, 32], zero columns past N."""
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    return weight.reshape(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def _projection(module: nn.Module, weights: str, panels: bool) -> dict[str, torch.Tensor | None]:
    """The kernel's view of a projection: ``weight`` (as the kernel reads it), ``scales``, ``zeros``, ``bias``
    and ``perm`` (the act-order gather of the input), each None where the layer has none. Of nn.Linear
    (row-major, or panels), Int8Linear (row-major int8) or a 4-bit GroupQuantLinear (packed nibbles, checked
    by :func:`_int4_group`). A module of another kind than ``weights`` raises TypeError."""
    if weights in ("float32", "bfloat16"):
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{type(module).__name__} among {weights} projections")
        weight = module.weight.detach()
        if weights == "bfloat16":  # the values are bf16-rounded already (the runner rounds them): exact
            weight = pair_panels_bf16(weight)
        elif panels:
            weight = to_panels(weight)
        return dict(weight=weight.contiguous(), scales=None, zeros=None, bias=module.bias, perm=None)
    if weights in GROUP_QUANT_BITS:
        if not isinstance(module, GroupQuantLinear):
            raise TypeError(f"{type(module).__name__} among {GROUP_QUANT_BITS[weights]}-bit projections")
        return dict(weight=module.packed, scales=module.scales, zeros=module.zeros, bias=module.bias,
                    perm=module.perm)
    qweight, scales = getattr(module, "qweight", None), getattr(module, "scales", None)
    if qweight is None or scales is None or qweight.dtype != torch.int8:
        raise TypeError(f"no row-major weight for {type(module).__name__}")
    return dict(weight=qweight.contiguous(), scales=scales.float().contiguous(), zeros=None,
                bias=getattr(module, "bias", None), perm=None)


def _int4_group(modules: list[tuple[str, nn.Module]], bits: int = 4) -> int:
    """The group size (0: one group per row) shared by ``bits``-bit (4 or 8) projections that the kernel reads
    as they are, or TypeError with the reason."""
    groups = set()
    for name, m in modules:
        if not isinstance(m, GroupQuantLinear):
            raise TypeError(f"{name} is {type(m).__name__}, not a {bits}-bit GroupQuantLinear (mixed layers)")
        if m.bits != bits:
            raise TypeError(f"{name} has {m.bits}-bit weights (the others {bits} bits)")
        if m.group_index is not None:  # act-order cut unevenly (a tensor-parallel rank's share)
            raise TypeError(f"{name} has uneven act-order groups (group_index): not in the kernel")
        if m.perm is not None and (m.perm.dtype != torch.int64 or m.perm.shape != (m.in_features,)
                                   or not m.perm.is_contiguous()):
            raise TypeError(f"{name}: act-order perm not a contiguous int64 [{m.in_features}]")
        if m.packed.device.type != "cpu" or m.packed.dtype != torch.uint8 or not m.packed.is_contiguous() \
                or m.packed.shape[1] * (2 if bits == 4 else 1) != m.stored_features:
            raise TypeError(f"{name}: packed weight not contiguous uint8 on CPU")
        for t in (m.scales, m.zeros):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.shape != (m.out_features, m.scales.shape[1]):
                raise TypeError(f"{name}: scales / zeros not float32 [N, groups]")
        if name != "qkv" and m.bias is not None:
            raise TypeError(f"{name} has a bias (the kernel adds qkv's only)")
        if -(-m.in_features // m.group_size) * m.group_size != m.stored_features:
            raise TypeError(f"{name}: {m.stored_features} stored columns are not {m.in_features} in whole groups")
        groups.add(m.group_size)
    per_row = all(m.scales.shape[1] == 1 and m.stored_features == m.in_features for _, m in modules)
    if per_row:
        return 0
    if len(groups) != 1:
        raise TypeError(f"4-bit projections in different group sizes ({sorted(groups)})")
    group = groups.pop()
    if group % 32:
        raise TypeError(f"4-bit groups of {group} columns (the kernel takes multiples of 32, or one per row)")
    return group


def _plain_rope(model: nn.Module, shape) -> bool:
    rotary = model.model.layers[0].self_attn.rotary
    return rotary is not None and rotary.plain and rotary.rotary_dim == shape.head_dim


class DecodeStack:
    """The model's layers, as pointers for the C kernel; build with :meth:`build` (None when the
    model or machine does not qualify)."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], weights: str,
                 group: int) -> None:
        shape = model.shape
        self.shape, self.weights, self.group = shape, weights, group
        self.int8, self.kind = weights == "int8", WEIGHT_KINDS[weights]
        self.panels = weights in ("float32", "bfloat16") and panels_supported()
        # 4 bits: int4_linear.c's loops, register tiles up to 12 rows and widened panels above (its MB: 64)
        self.max_rows = MAX_PANEL_ROWS if self.panels or weights in GROUP_QUANT_BITS else MAX_ROWS
        self.max_chained_rows = MAX_PANEL_ROWS if self.panels else MAX_CHAINED_ROWS
        self.limits = StackLimits(self.max_rows, self.max_chained_rows,
                                  MAX_MIXED_ROWS if self.panels else self.max_chained_rows, MAX_MIXED_CONTEXT)
        self.model = model
        # kv_cache_dtype="bfloat16": the kernel rounds the new keys/values into the cache and widens them as it reads
        self.kv_bf16 = kv_caches[0][0].dtype == torch.bfloat16
        self._keep: list[torch.Tensor] = []  # every tensor a pointer refers to
        layers = (_Layer * shape.num_layers)()
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(model.model.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            fields = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
                      "k_cache": k_cache, "v_cache": v_cache}
            for name, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                view = _projection(module, weights, self.panels)
                fields[name] = view["weight"]
                for part in ("scales", "zeros", "perm"):
                    fields[f"{name}_{part}"] = view[part]
                if name == "qkv":
                    fields["qkv_bias"] = view["bias"]
            for name, tensor in fields.items():
                if tensor is not None:
                    tensor = tensor.detach()
                    self._keep.append(tensor)
                    setattr(layers[index], name, tensor.data_ptr())
        self.layers = layers
        rotary = model.model.layers[0].self_attn.rotary
        self.cos, self.sin = rotary.cos.contiguous(), rotary.sin.contiguous()
        self.final_norm = model.model.norm.weight.detach()
        self.eps = float(model.model.norm.eps)
        self.scale = shape.head_dim ** -0.5

    @classmethod
    def build(cls, model: nn.Module, kv_caches, weights: str | bool, group: int | None) -> "DecodeStack | None":
        """The stack for ``model`` when this path can run it here, else None (the reason is logged).

        ``weights``: how the projections are held, ``"float32"``, ``"bfloat16"`` (float32 modules holding
        bf16-rounded values, read as bf16 panels), ``"int8"`` (``group`` values per scale, None:
        one per row), ``"int4"`` or ``"uint8"`` (every projection a 4-bit, or 8-bit, GroupQuantLinear; the group
        size is read from the layers, ``group`` is not used); a bool means int8 or float32."""
        if isinstance(weights, bool):
            weights = "int8" if weights else "float32"
        shape = model.shape
        reason = None
        int8 = weights == "int8"
        if not enabled():
            reason = f"{ENV_SWITCH}=0"
        elif _library() is None:
            reason = "the C kernel could not be built"
        elif shape.qk_norm:
            reason = "q/k norms (Qwen3) are not in the kernel"
        elif not shape.llama_math or not _plain_rope(model, shape):
            reason = "the kernel computes Llama's layers only (this family differs; it runs the module path)"
        elif any(size % 8 for size in (shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim)):
            reason = "widths must be multiples of 8"
        elif int8 and group and group % 8:
            reason = "int8 groups must be multiples of 8"
        elif weights not in WEIGHT_KINDS:
            reason = f"{weights} weights are not in the kernel"
        elif weights == "bfloat16" and not panels_supported():
            reason = "bfloat16 weights are read as panels, which need an AVX-512 build"
        elif kv_caches[0][0].dtype not in (torch.float32, torch.bfloat16):
            reason = f"a {kv_caches[0][0].dtype} KV cache (the kernel reads float32 or bfloat16 caches)"
        if reason is None:
            try:
                if weights in GROUP_QUANT_BITS:
                    group = _int4_group([(name, getattr(module, proj)) for layer in model.model.layers
                                         for name, module, proj in (("qkv", layer.self_attn, "qkv_proj"),
                                                                    ("o", layer.self_attn, "o_proj"),
                                                                    ("gate_up", layer.mlp, "gate_up_proj"),
                                                                    ("down", layer.mlp, "down_proj"))],
                                        GROUP_QUANT_BITS[weights])
                return cls(model, kv_caches, weights, group or 0)
            except TypeError as e:
                reason = str(e)
        logger.info("CPU decode stack off: %s", reason)
        return None

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """A decode-only step small enough for this path (or a multi-token step laid out as one,
        one row per token: ``meta.chained``)."""
        limit = max(self.limits.chained_rows, self.limits.mixed_rows) if meta.chained else self.max_rows
        return num_tokens <= limit and len(meta.decode_indices) == meta.num_seqs == num_tokens

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ([tokens, hidden], after the last norm) of a decode-only step."""
        s = self.shape
        hidden = self.model.model.embed_tokens(input_ids).contiguous()
        positions = positions.contiguous()
        slots = meta.slot_mapping.contiguous()
        tables = meta.block_tables.contiguous()
        seq_lens = meta.seq_lens_tensor.contiguous()
        failed = _library().decode_stack_f32(
            self.layers, s.num_layers, self.kind, self.group, hidden.data_ptr(), hidden.shape[0],
            self.final_norm.data_ptr(), self.eps, s.hidden_size, s.intermediate_size, s.num_heads, s.num_kv_heads,
            s.head_dim, positions.data_ptr(), self.cos.data_ptr(), self.sin.data_ptr(), self.cos.shape[0],
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), seq_lens.data_ptr(), meta.block_size, self.scale,
            torch.get_num_threads(), int(meta.chained), int(self.kv_bf16))
        if failed == 3:
            raise ValueError(f"{hidden.shape[0]} rows: more than the kernel takes for {self.weights} weights")
        if failed == 2:
            raise IndexError(f"a position or sequence length is outside the rotary tables (0..{self.cos.shape[0] - 1})")
        if failed:
            raise MemoryError("the CPU decode stack could not allocate its scratch memory")
        return hidden
