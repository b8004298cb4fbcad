"""Multi-head latent attention (DeepSeek V2/V3) over a paged cache of latents, not of keys and values.

Each token's keys and values come from one compressed vector: ``kv_a_proj_with_mqa`` gives the latent
``c`` (``kv_lora_rank`` values, then normed by ``kv_a_layernorm``) and one rope key ``k_rope``
(``qk_rope_head_dim`` values, rotated, shared by every head); ``kv_b_proj`` expands ``c`` into each
head's ``k_nope`` (``W_UK[h] c``) and value (``W_UV[h] c``). The cache keeps what is per token: the
normed latent and the rotated rope key, ``kv_lora_rank + qk_rope_head_dim`` values in one "KV head".

Attention runs in the absorbed form, so that nothing is expanded per cached token:

* a head's score ``q_nope . W_UK[h] c + q_rope . k_rope`` is ``(W_UK[h]^T q_nope) . c + q_rope . k_rope``:
  the query ``[W_UK[h]^T q_nope, q_rope]`` against the cached vector as its key, one KV head for all
  heads (multi-query attention with head_dim ``kv_lora_rank + qk_rope_head_dim``);
* the output ``sum_j p_j W_UV[h] c_j`` is ``W_UV[h] (sum_j p_j c_j)``: the same cached vectors serve
  as the values, the first ``kv_lora_rank`` output dimensions are kept and multiplied by ``W_UV[h]``.

So the paged backends run it unchanged, given the one cache tensor as both K and V cache; their
softmax scale is ``qk_head_dim ** -0.5`` (times yarn's ``mscale ** 2``, ``DecoderShape.attention_scale``).
Under tensor parallelism the heads are split (``q_proj``/``q_b_proj``/``kv_b_proj`` rows, ``o_proj``
columns) and every rank computes and caches the whole latent (it is one head, replicated).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..distributed.parallel import SINGLE, TensorParallel
from ..errors import ModelLoadError
from ..kernels.metadata import AttentionMetadata
from .norms import RMSNorm
from .layers import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from .rotary import RotaryEmbedding, rope_parameters, rope_type_of
from .shape import DecoderShape, MLAShape

# transformers' DeepSeek norms the query and latent bottlenecks with its RMSNorm's default epsilon
_LATENT_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float) -> float:
    """Yarn's attention-temperature factor for a context stretched ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config, mla: MLAShape) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when a scaled rope asks for it
    (transformers' ``yarn_apply_mscale``: any rope type but "default" with a non-zero ``mscale_all_dim``)."""
    scale = mla.qk_head_dim ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if rope_type_of(params) != "default" and mscale_all_dim:
        factor = yarn_mscale(float(params["factor"]), float(mscale_all_dim))
        scale *= factor * factor
    return scale


class LatentProjection(nn.Module):
    """``kv_b_proj`` kept per head as ``weight`` [local heads, qk_nope_head_dim + v_head_dim, kv_lora_rank]: its
    first rows are ``W_UK[h]``, the rest ``W_UV[h]``. Not an ``nn.Linear``: it is never applied to the latent
    as a matmul (the absorbed form multiplies queries and outputs by its slices instead)."""

    def __init__(self, mla: MLAShape, first_head: int, num_heads: int) -> None:
        """``first_head``, ``num_heads``: this rank's heads."""
        super().__init__()
        self.mla, self.first_head = mla, first_head
        per_head = mla.qk_nope_head_dim + mla.v_head_dim
        self.weight = nn.Parameter(torch.empty(num_heads, per_head, mla.kv_lora_rank))
        self.method = None  # a quantized checkpoint's tensors for it (FP8: widened at load), or None

    def use_checkpoint_format(self, fmt) -> None:
        """The checkpoint is quantized (before loading): its kv_b_proj tensors are read as ``fmt`` stores them."""
        if not fmt.dynamic:
            self.method = WidenedAtLoad(fmt)

    def weight_loader(self, kind: str, tensor, part, name: str) -> None:
        """This rank's heads of the checkpoint's ``[heads * (nope + v), kv_lora_rank]`` tensor (an FP8 one with its
        scales: widened once both are in)."""
        if self.method is not None and self.method.handles(kind):
            tensor = self.method.take(kind, tensor, name)
            if tensor is None:
                return
            kind = "weight"
        if kind != "weight" or not isinstance(tensor, torch.Tensor) or tensor.element_size() == 1:
            raise ModelLoadError(f"tensor {name!r}: kv_b_proj is read as float weights, or FP8 with its scales")
        heads, per_head, rank = self.weight.shape
        total = tensor.shape[0] // per_head if tensor.dim() == 2 else 0
        if tensor.dim() != 2 or tensor.shape[1] != rank or total * per_head != tensor.shape[0] or total < heads:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"(num_attention_heads * {per_head}, {rank})")
        self.weight.data.copy_(tensor.view(total, per_head, rank)[self.first_head:self.first_head + heads])

    def uk(self) -> torch.Tensor:
        """``W_UK`` [heads, qk_nope_head_dim, kv_lora_rank]."""
        return self.weight[:, :self.mla.qk_nope_head_dim]

    def uv(self) -> torch.Tensor:
        """``W_UV`` [heads, v_head_dim, kv_lora_rank]."""
        return self.weight[:, self.mla.qk_nope_head_dim:]


class WidenedAtLoad:
    """``kv_b_proj`` of an FP8 checkpoint (DeepSeek V3's own, blocks of 128 x 128): the ``weight`` and its scale
    (``weight_scale_inv`` or ``weight_scale``: per tensor, per row or per block) widened to float once both are
    in. The absorbed form multiplies queries and outputs by slices of it, so it is held in float; it is one
    projection a layer, ~2% of DeepSeek V3's weights. Other quantized formats of it are refused by name."""

    SCALES = ("weight_scale_inv", "weight_scale")

    def __init__(self, fmt) -> None:
        self.fmt = fmt
        self.pending: dict[str, torch.Tensor] = {}

    def handles(self, kind: str) -> bool:
        return kind != "bias"

    def primary(self, kind: str) -> bool:
        return kind == "weight"

    def take(self, kind: str, tensor: torch.Tensor, name: str) -> torch.Tensor | None:
        """The float weight once ``tensor`` completes it, else None (held until its partner arrives)."""
        if self.fmt.layout != "fp8" or kind not in ("weight", "input_scale", *self.SCALES):
            raise ModelLoadError(f"tensor {name!r}: a {self.fmt.describe()} kv_b_proj is not supported (FP8 is)")
        if kind == "input_scale":
            return None
        if kind == "weight" and tensor.element_size() != 1:
            return tensor  # kept float by the checkpoint
        self.pending[kind if kind == "weight" else "scale"] = tensor
        if set(self.pending) != {"weight", "scale"}:
            return None
        weight, scale = self.pending.pop("weight").float(), self.pending.pop("scale").float()
        n, k = weight.shape
        if scale.numel() == 1:
            return weight * scale.reshape(())
        if scale.numel() == n:
            return weight * scale.reshape(n, 1)
        bn, bk = self.fmt.block or (-(-n // scale.shape[0]), -(-k // scale.shape[1]))
        if scale.dim() != 2 or scale.shape != (-(-n // bn), -(-k // bk)):
            raise ModelLoadError(f"tensor {name!r}: scales of shape {tuple(scale.shape)} do not fit a {n} x {k} "
                                 f"weight in blocks of {bn} x {bk}")
        return weight * scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


class LatentAttention(nn.Module):
    """A DeepSeek attention layer (module and parameter names as transformers' ``DeepseekV3Attention``)."""

    def __init__(self, shape: DecoderShape, layer_index: int, rotary: RotaryEmbedding | None, backend,
                 tp: TensorParallel = SINGLE, full: DecoderShape | None = None, lora=None) -> None:
        """``shape``: this rank's (its ``num_heads`` a share); ``full``: the whole model's; ``lora``: the LoRA
        slots (adapters on q_proj / q_a_proj / q_b_proj / kv_a_proj_with_mqa / o_proj), or None."""
        super().__init__()
        full = full or shape
        mla = shape.mla
        self.mla, self.tp, self.layer_index, self.lora = mla, tp, layer_index, lora
        self.num_heads = shape.num_heads
        hidden, q_out = shape.hidden_size, full.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, q_out, False, tp)
        else:
            self.q_a_proj = ParallelLinear(hidden, mla.q_lora_rank, shape.qkv_bias, tp)  # replicated
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, q_out, False, tp)
        self.kv_a_proj_with_mqa = ParallelLinear(hidden, mla.cache_dim, shape.qkv_bias, tp)  # replicated
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        first_head = tp.split(full.num_heads)[0] if tp.enabled else 0
        self.kv_b_proj = LatentProjection(mla, first_head, self.num_heads)
        self.o_proj = RowParallelLinear(self.num_heads * mla.v_head_dim, hidden, shape.o_bias,
                                        (first_head * mla.v_head_dim, self.num_heads * mla.v_head_dim), tp)
        if rotary is None:
            raise ModelLoadError("multi-head latent attention needs rope on every layer")
        self.rotary, self.backend = rotary, backend
        self.scale = shape.attention_scale or mla.qk_head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, mla, heads = hidden.shape[0], self.mla, self.num_heads
        nope, rope, rank = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.kv_lora_rank
        if mla.q_lora_rank is None:
            q = self._project("q_proj", hidden)
        else:
            q = self._project("q_b_proj", self.q_a_layernorm(self._project("q_a_proj", hidden)))
        q_nope, q_rope = q.view(tokens, heads, mla.qk_head_dim).split([nope, rope], dim=-1)
        latent, k_rope = self._project("kv_a_proj_with_mqa", hidden).split([rank, rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        # copies: the fused rope kernels rotate in place
        q_rope, k_rope = self.rotary(positions, q_rope.contiguous(), k_rope.reshape(tokens, 1, rope).contiguous(), meta)
        # the query in latent space: W_UK[h]^T q_nope per head, then its rotated rope part
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.kv_b_proj.uk()).transpose(0, 1)
        query = torch.cat([q_latent, q_rope], dim=-1)                             # [tokens, heads, cache_dim]
        entry = torch.cat([latent, k_rope.view(tokens, rope)], dim=-1).unsqueeze(1)  # [tokens, 1, cache_dim]
        cache = kv_cache[0]  # the same tensor as kv_cache[1]: keys and values are both the cached vector
        self.backend.write_kv(entry, entry, cache, cache, meta)
        out = self.backend.forward(query, cache, cache, meta, self.scale)         # [tokens, heads, cache_dim]
        # the attended latent (its first kv_lora_rank dims) through W_UV[h]
        values = torch.bmm(out[..., :rank].transpose(0, 1), self.kv_b_proj.uv().transpose(1, 2)).transpose(0, 1)
        result = self._project("o_proj", values.reshape(tokens, heads * mla.v_head_dim))
        return self.tp.all_reduce(result)  # row-parallel: each rank holds a partial sum

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Projection ``name`` of ``x``, with this step's LoRA deltas on it (before any norm that follows)."""
        y = getattr(self, name)(x)
        if self.lora is not None and self.lora.groups:
            self.lora.apply(self.layer_index, name, x, y)
        return y
