"""The decoder every native family shares, and the declaration each family's model class makes.

A family file (``model/llama.py``, ``model/gemma2.py``, ...) subclasses :class:`DecoderModel` and
says, in one place, what is specific to it:

* ``read_shape(config)``: its :class:`DecoderShape`, i.e. the sizes plus the ways it differs from
  Llama (norm layout, activation, multipliers, soft-capping, sliding windows, q/k norms, biases);
* ``make_rotaries(config, shape, max_len)``: one rotary embedding per layer (or None for a layer
  without rope), when its rope is not the config's single rope;
* ``check_config(config)``: the variants it does not implement, refused with the config key named;
* the declaration read by the rest of the engine: ``packed_modules`` (checkpoint projection ->
  engine fused projection and part), ``renamed`` (checkpoint module names the engine calls
  otherwise), ``lora_targets`` (PEFT modules adapters may touch), ``fast_paths`` (CPU decode stack,
  CUDA graphs, tensor parallelism, LoRA) and ``gguf_architectures`` (llama.cpp names it loads).

Module and parameter names follow Hugging Face's, except that q/k/v and gate/up projections are
fused into one matmul each (``qkv_proj``, ``gate_up_proj``). Under tensor parallelism
(``distributed/parallel.py``) each rank builds the model from its local shape, sums the
row-parallel outputs of ``o_proj`` and ``down_proj`` with an all-reduce, and splits the vocabulary
of the embedding and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..distributed.parallel import SINGLE, TensorParallel
from ..errors import ModelLoadError
from ..kernels.metadata import AttentionMetadata
from .layers import QKVParallelLinear, RowParallelLinear, VocabParallelLMHead, vocab_rows
from .mla import LatentAttention
from .mlp import MLP
from .norms import RMSNorm, make_norm
from .moe import SparseMoE
from .registry import LLAMA_LORA_TARGETS, SPLIT_PROJECTIONS
from .rotary import MRotaryEmbedding, RotaryEmbedding, rope_parameters, rope_type_of
from .shape import DecoderShape

_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


@dataclass(frozen=True)
class FastPaths:
    """Which of the engine's fast paths a family may use (each still checks the shape it is given)."""

    decode_stack: bool = True     # the C decode stack (kernels/cpu_decode_stack.py), for Llama math only
    cuda_graphs: bool = True      # decode steps replayed as CUDA graphs
    tensor_parallel: bool = True  # heads and MLP columns split over ranks
    lora: bool = True             # PEFT adapters on the lora_targets


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape, layer_index: int, rotary: RotaryEmbedding | None, backend, lora=None,
                 tp: TensorParallel = SINGLE, full: DecoderShape | None = None) -> None:
        """``shape``: this rank's (local) shape; ``full``: the whole model's (default: the same)."""
        super().__init__()
        full = full or shape
        self.lora = lora  # LoRASlots shared by all layers, or None
        self.tp = tp
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = QKVParallelLinear(shape.hidden_size, full.num_heads, full.num_kv_heads, shape.head_dim,
                                          shape.qkv_bias, tp)
        head_share = tp.split(full.num_heads)
        self.o_proj = RowParallelLinear(self.q_size, shape.hidden_size, shape.o_bias,
                                        (head_share[0] * shape.head_dim, head_share[1] * shape.head_dim), tp)
        self.qk_norm = shape.qk_norm
        if shape.qk_norm == "full":  # over all heads of the projection (OLMo 2)
            self.q_norm, self.k_norm = make_norm(shape, self.q_size), make_norm(shape, self.kv_size)
        elif shape.qk_norm:          # one norm per head (Qwen3, Gemma 3)
            self.q_norm, self.k_norm = make_norm(shape, shape.head_dim), make_norm(shape, shape.head_dim)
        self.rotary = rotary
        self.backend = backend
        self.scale = shape.attention_scale or shape.head_dim ** -0.5
        # only the layers that need them pass these: the backends' fast paths take neither
        self.variant = {key: value for key, value in (("window", shape.window(layer_index)),
                                                      ("softcap", shape.attn_softcap),
                                                      ("chunk", shape.chunk(layer_index))) if value is not None}
        # gpt-oss: a learnt logit per head that joins the softmax's denominator; under TP this rank's heads' own
        self.head_start, self.full_heads = head_share[0], full.num_heads
        self.sinks = nn.Parameter(torch.empty(shape.num_heads)) if shape.attn_sinks else None

    # dtype="bfloat16" prefill on CPU where attention runs bf16 (kernels/cpu_attention.py: SDPA on AMX CPUs, the C
    # kernel's bf16 variant elsewhere): q, k, v stay bf16 from the qkv projection to the o projection (False: the
    # float32 path; on AMX CPUs it computes the same numbers, elsewhere it keeps the float32 query; tests compare)
    bf16_prefill: ClassVar[bool] = True

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = hidden.shape[0]
        if self._bf16_prefill_applies(positions, hidden, meta, kv_cache[0]):
            return self._forward_bf16_prefill(positions, hidden, meta, kv_cache)
        qkv = self.qkv_proj(hidden)
        if self.lora is not None and self.lora.groups:
            self.lora.apply(self.layer_index, "qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.qk_norm != "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(positions, q, k, meta)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta)
        variant = self.variant if self.sinks is None else {**self.variant, "sinks": self.sinks}
        out = self.backend.forward(q, k_cache, v_cache, meta, self.scale, **variant).view(tokens, self.q_size)
        result = self.o_proj(out)
        if self.lora is not None and self.lora.groups:
            self.lora.apply(self.layer_index, "o_proj", out, result)
        return self.tp.all_reduce(result)  # row-parallel: each rank holds a partial sum

    def _bf16_prefill_applies(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                              k_cache: torch.Tensor) -> bool:
        """A prefill-only step of a plain attention layer (rotate-half rope over the whole head, no bias, norm, LoRA,
        window, cap or sinks) whose projections multiply in bf16 and whose backend attends in bf16 over this cache."""
        bf16_layers = getattr(self.backend, "bf16_prefill_layers", None)
        return (self.bf16_prefill and bf16_layers is not None and not meta.decode_indices and not meta.bidirectional
                and positions.dim() == 1
                and getattr(self.qkv_proj, "compute_dtype", None) == torch.bfloat16 and self.qkv_proj.bias is None
                and getattr(self.o_proj, "compute_dtype", None) == torch.bfloat16
                and (self.lora is None or not self.lora.groups) and not self.qk_norm and not self.variant
                and self.sinks is None and type(self.rotary) in (RotaryEmbedding, MRotaryEmbedding) and self.rotary.plain
                and self.rotary.rotary_dim == self.head_dim and bf16_layers(hidden, k_cache, meta))

    def _forward_bf16_prefill(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                              kv_cache: tuple[torch.Tensor, torch.Tensor],
                              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """forward() with q, k, v in bf16 from the qkv matmul's output to the o projection's input: the same numbers
        as the float32 path (oneDNN rounds its bf16 output; the float32 path rounds the rotated k for the cache and
        q for the bf16 SDPA, and o rounds its input), without four conversion passes per layer. ``hidden`` float32
        or already bf16; the output in ``out_dtype`` (default ``hidden``'s)."""
        from ..kernels.cpu_ops import rotary_embedding_

        tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward_as(hidden, torch.bfloat16)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        rotary_embedding_(positions, q, k, self.rotary.cos, self.rotary.sin)  # in place, float32 arithmetic
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta)
        out = self.backend.forward(q, k_cache, v_cache, meta, self.scale).view(tokens, self.q_size)
        return self.tp.all_reduce(self.o_proj.forward_as(out, out_dtype or hidden.dtype))

    def weight_loader(self, kind: str, tensor: torch.Tensor, part, name: str) -> None:
        """The checkpoint's ``sinks`` (one per head of the whole model), cut to this rank's heads."""
        if kind != "sinks" or self.sinks is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (no matching parameter)")
        if tuple(tensor.shape) != (self.full_heads,):
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected ({self.full_heads},)")
        self.sinks.data.copy_(tensor[self.head_start:self.head_start + self.num_heads])


class DecoderLayer(nn.Module):
    """Attention and MLP with their norms wired as ``shape.layout`` says:

    * ``pre`` (Llama): ``h += attn(norm1(h)); h += mlp(norm2(h))``;
    * ``sandwich`` (Gemma 2/3, GLM-4): each block's output is normed too before the residual add;
    * ``post`` (OLMo 2): only the outputs are normed;
    * ``parallel`` (Cohere): ``h += attn(norm(h)) + mlp(norm(h))``.
    """

    def __init__(self, shape: DecoderShape, layer_index: int, rotary: RotaryEmbedding | None, backend, lora=None,
                 tp: TensorParallel = SINGLE, full: DecoderShape | None = None) -> None:
        super().__init__()
        self.layout, self.residual_scale = shape.layout, shape.residual_scale
        if shape.mla is not None:  # multi-head latent attention (DeepSeek), over a cache of latents

            self.self_attn = LatentAttention(shape, layer_index, rotary, backend, tp, full, lora)
        else:
            self.self_attn = Attention(shape, layer_index, rotary, backend, lora, tp, full)
        if shape.is_moe(layer_index):
            self.mlp = SparseMoE(shape, layer_index, tp, full, lora)
        else:
            self.mlp = MLP(shape, layer_index, lora, tp, full)
        size = shape.hidden_size
        if shape.layout != "post":
            self.input_layernorm = make_norm(shape, size)
        if shape.layout != "parallel":
            self.post_attention_layernorm = make_norm(shape, size)
        if shape.layout in ("sandwich", "post"):
            self.post_feedforward_layernorm = make_norm(shape, size)
        if shape.layout == "sandwich":
            self.pre_feedforward_layernorm = make_norm(shape, size)

    # dtype="bfloat16" prefill on CPU: whole layers between a float32 residual stream and bf16 activations (False:
    # the layers convert around each norm; the same numbers, tests compare)
    bf16_residual: ClassVar[bool] = True

    def bf16_residual_applies(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                              kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether this layer may run :meth:`forward_bf16_residual`: a Llama-shaped layer (pre-norm RMSNorms, no
        residual scale, a dense MLP without bias) on one rank whose attention keeps q, k, v bf16 in this step and
        whose MLP multiplies in bf16, so that nothing between the norms needs float32 activations."""
        attn, mlp = self.self_attn, self.mlp
        return (self.bf16_residual and self.layout == "pre" and self.residual_scale == 1.0
                and type(self.input_layernorm) is RMSNorm and type(self.post_attention_layernorm) is RMSNorm
                and type(mlp) is MLP and not mlp.tp.enabled and mlp.down_proj.bias is None
                and mlp.bf16_activations_apply()
                and type(attn) is Attention and not attn.tp.enabled and attn.o_proj.bias is None
                and attn._bf16_prefill_applies(positions, hidden, meta, kv_cache[0]))

    def forward_bf16_residual(self, positions: torch.Tensor, hidden: torch.Tensor, pending: torch.Tensor | None,
                              meta: AttentionMetadata,
                              kv_cache: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() for a step where :meth:`bf16_residual_applies`, with the previous layer's MLP output
        ``pending`` (bf16, None before the first layer) not yet added to the float32 residual ``hidden``; returns
        (the residual, this layer's MLP output, bf16 and likewise not added). Each norm adds its bf16 input to the
        residual and rounds its output to bf16 in one pass (``rms_norm_mixed`` in csrc/elementwise.c), so the o and
        down projections hand back oneDNN's bf16 output and qkv and gate_up take bf16 input: the same numbers as
        :meth:`forward` (widening is exact, and its conversions round to nearest even as the kernel does), without
        four conversion passes and the MLP's residual add per layer."""
        if pending is None:  # the first layer: nothing to add to the residual yet
            normed = self.input_layernorm.add_and_norm_as(hidden, None, torch.bfloat16)[1]
        else:
            hidden, normed = self.input_layernorm.add_and_norm_as(pending, hidden, torch.bfloat16)
        attn = self.self_attn._forward_bf16_prefill(positions, normed, meta, kv_cache, torch.bfloat16)
        hidden, normed = self.post_attention_layernorm.add_and_norm_as(attn, hidden, torch.bfloat16)
        return hidden, self.mlp._forward_bf16(normed, torch.bfloat16)

    def forward(self, positions, hidden, meta, kv_cache) -> torch.Tensor:
        layout = self.layout
        if layout == "pre":
            attn = self.self_attn(positions, self.input_layernorm(hidden), meta, kv_cache)
            if self.residual_scale != 1.0:
                attn = attn * self.residual_scale
            hidden, normed = self.post_attention_layernorm.add_and_norm(attn, hidden)
            mlp = self.mlp(normed)
            return hidden + (mlp * self.residual_scale if self.residual_scale != 1.0 else mlp)
        if layout == "parallel":
            normed = self.input_layernorm(hidden)
            return hidden + self.self_attn(positions, normed, meta, kv_cache) + self.mlp(normed)
        attn_in = self.input_layernorm(hidden) if layout == "sandwich" else hidden
        hidden = hidden + self.post_attention_layernorm(self.self_attn(positions, attn_in, meta, kv_cache))
        mlp_in = self.pre_feedforward_layernorm(hidden) if layout == "sandwich" else hidden
        return hidden + self.post_feedforward_layernorm(self.mlp(mlp_in))


class VocabParallelEmbedding(nn.Module):
    """One rank's rows ``[start, start + rows)`` of the embedding table; ids outside them give zeros
    here and their vectors come from the rank that holds them (all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.start, rows = tp.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp, self.vocab_size = tp, vocab_size

    def weight_loader(self, kind: str, tensor, part, name: str) -> None:
        """This rank's rows of the checkpoint's table (looked up, not multiplied: always float)."""
        if not isinstance(tensor, torch.Tensor):
            tensor = tensor.dequantize()
        rows = vocab_rows(tensor, self.tp, self.vocab_size)
        if rows.shape != self.weight.shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"({self.vocab_size}, {self.weight.shape[1]})")
        self.weight.data.copy_(rows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class DecoderModel(nn.Module):
    """The decoder stack plus LM head. ``forward`` takes a flattened batch of tokens.

    ``shape`` is the rank's local shape under tensor parallelism (``TensorParallel.local_shape``);
    its vocabulary size stays the whole model's. ``rotaries``: one per layer (None: no rope there)."""

    packed_modules: ClassVar[dict] = SPLIT_PROJECTIONS
    renamed: ClassVar[dict[str, str]] = {}
    lora_targets: ClassVar[tuple[str, ...]] = LLAMA_LORA_TARGETS
    fast_paths: ClassVar[FastPaths] = FastPaths()
    gguf_architectures: ClassVar[tuple[str, ...]] = ()  # llama.cpp architecture names of its GGUF files
    gguf_names: ClassVar[dict[str, str]] = {}  # GGUF per-layer tensor names that differ from Llama's -> module
    gguf_permuted_qk: ClassVar[bool] = False  # llama.cpp's converter interleaves q/k rows (Llama's converter does)
    activations: ClassVar[dict[str, str]] = {"silu": "silu"}  # config hidden_act -> MLP activation
    supported_rope_types: ClassVar[tuple[str, ...]] = _ROPE_TYPES
    dequantized_formats: ClassVar[tuple[str, ...]] = ()  # quantized formats it turns to float at load (gpt-oss: mxfp4)
    interleaved_rope: ClassVar[bool] = False

    def __init__(self, shape: DecoderShape, rotaries: list[RotaryEmbedding | None], backend, lora=None,
                 tp: TensorParallel = SINGLE, full: DecoderShape | None = None) -> None:
        """``shape``: this rank's; ``full``: the whole model's (its layers cut checkpoint tensors by it)."""
        super().__init__()
        self.shape, self.tp = shape, tp
        self.rotaries = [r for i, r in enumerate(rotaries) if r is not None and r not in rotaries[:i]]
        self.model = nn.Module()
        self.model.embed_tokens = (VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp) if tp.enabled
                                   else nn.Embedding(shape.vocab_size, shape.hidden_size))
        self.model.layers = nn.ModuleList(DecoderLayer(shape, i, rotaries[i], backend, lora, tp, full)
                                          for i in range(shape.num_layers))
        self.model.norm = make_norm(shape, shape.hidden_size)
        if not shape.tie_word_embeddings:
            self.lm_head = VocabParallelLMHead(shape.hidden_size, shape.vocab_size, tp)

    # ---- the family's declaration (class methods: read before the model is built) ----

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        """The family's shape of ``config`` (Llama's reading; families override and extend it)."""
        shape = DecoderShape.llama_fields(config, cls.architecture_name(config))
        shape.activation = cls.activations.get(cls.activation_of(config), "silu")
        shape.o_bias = shape.qkv_bias and cls.bias_on_o_proj
        shape.mlp_bias = bool(getattr(config, "mlp_bias", False))
        return shape

    bias_on_o_proj: ClassVar[bool] = True  # attention_bias covers o_proj too (Llama); Qwen2 sets q/k/v only

    @classmethod
    def architecture_name(cls, config) -> str:
        from .registry import architecture_names

        return (architecture_names(config) or [cls.__name__])[0]

    @classmethod
    def check_config(cls, config) -> None:
        """Raise ModelLoadError naming the config key of a variant this family does not implement."""
        act = cls.activation_of(config)
        if act not in cls.activations:
            raise ModelLoadError(f"{cls.__name__}: activation {act!r} (config key hidden_act) is not supported; "
                                 f"supported: {', '.join(cls.activations)}")
        for layer_type in cls.rope_layer_types(config):
            rope_type = rope_type_of(rope_parameters(config, layer_type))
            if rope_type not in cls.supported_rope_types:
                raise ModelLoadError(f"{cls.__name__}: rope type {rope_type!r} (config key rope_parameters.rope_type)"
                                     f" is not supported; supported: {', '.join(cls.supported_rope_types)}")

    @classmethod
    def activation_of(cls, config) -> str:
        """The config's activation name (the key families read it from differs)."""
        return getattr(config, "hidden_act", None) or "silu"

    @classmethod
    def rope_layer_types(cls, config) -> list[str | None]:
        return [None]

    @classmethod
    def make_rotaries(cls, config, shape: DecoderShape, max_positions: int) -> list[RotaryEmbedding | None]:
        """One rotary embedding shared by every layer that has rope."""
        rotary = RotaryEmbedding.from_config(config, shape.head_dim, max_positions, interleaved=cls.interleaved_rope)
        return [rotary if shape.has_rope(i) else None for i in range(shape.num_layers)]

    @classmethod
    def kv_cache_layout(cls, shape: DecoderShape) -> tuple[int, int, bool]:
        """(KV heads, head dim, shared) of each layer's paged cache for this rank's ``shape``; shared: one tensor
        is both the K and the V cache (the latent of multi-head latent attention), allocated and counted once."""
        return shape.num_kv_heads, shape.head_dim, False

    def skips_tensor(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is not part of this model (DeepSeek's multi-token-prediction layers)."""
        return False

    @classmethod
    def prepare_weight(cls, name: str, tensor: torch.Tensor, from_gguf: bool = False) -> torch.Tensor:
        """A checkpoint tensor as the engine's parameter takes it (Gemma folds its norms' +1 here)."""
        return tensor

    # ---- the forward pass ----

    def build_rotaries(self, device: torch.device, dtype: torch.dtype) -> None:
        for rotary in self.rotaries:
            rotary.build(device, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids)
        return hidden * self.shape.embedding_scale if self.shape.embedding_scale != 1.0 else hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens] ids and positions -> [tokens, hidden] final hidden states. ``input_embeds``: the step's
        input rows already embedded (a prompt's images in place of their placeholders; model/image_embeddings.py)."""
        hidden = self.embed(input_ids) if input_embeds is None else input_embeds
        layers = self.model.layers
        if self._bf16_residual_applies(positions, hidden, meta, kv_caches):
            pending = None
            for layer, kv_cache in zip(layers, kv_caches):
                hidden, pending = layer.forward_bf16_residual(positions, hidden, pending, meta, kv_cache)
            if type(self.model.norm) is RMSNorm:
                return self.model.norm.add_and_norm_as(pending, hidden, hidden.dtype)[1]
            return self.model.norm(hidden + pending)
        for layer, kv_cache in zip(layers, kv_caches):
            hidden = layer(positions, hidden, meta, kv_cache)
        return self.model.norm(hidden)

    def _bf16_residual_applies(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                               kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether every layer takes this step on the bf16 residual path (DecoderLayer.forward_bf16_residual)."""
        layers = self.model.layers
        return (len(layers) > 0 and hidden.dtype == torch.float32
                and all(type(layer) is DecoderLayer and layer.bf16_residual_applies(positions, hidden, meta, kv_cache)
                        for layer, kv_cache in zip(layers, kv_caches)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "lm_head", None)  # tied models get one only when the CPU path packs it
        logits = head(hidden) if head is not None else nn.functional.linear(hidden, self.model.embed_tokens.weight)
        if self.tp.enabled:  # each rank scored its vocabulary rows: put them side by side, drop the padding
            logits = self.tp.gather_columns(logits)[:, :self.shape.vocab_size]
        return self.finish_logits(logits)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Family-specific scaling of the logits (Cohere's scale, Granite's divisor, Gemma 2's soft cap)."""
        s = self.shape
        if s.logit_scale != 1.0:
            logits = logits * s.logit_scale
        if s.logit_divisor != 1.0:
            logits = logits / s.logit_divisor
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits
