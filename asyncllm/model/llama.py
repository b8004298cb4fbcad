"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and Phi-3, chosen by config.

Module and parameter names follow Hugging Face's, except that q/k/v and gate/up projections are
fused into one matmul each (``qkv_proj``, ``gate_up_proj``); the loader fills their slices as the
architecture's entry in ``model/registry.py`` says (Phi-3 checkpoints are fused already).

Under tensor parallelism (``distributed/parallel.py``) each rank builds this model from its local
shape (its heads and intermediate columns), sums the row-parallel outputs of ``o_proj`` and
``down_proj`` with an all-reduce, and splits the vocabulary of the embedding and the LM head.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.parallel import SINGLE, TensorParallel
from ..kernels.metadata import AttentionMetadata
from ..kernels.ops import add_rms_norm, rms_norm, silu_and_mul
from .rotary import RotaryEmbedding
from .shape import DecoderShape


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers does, then cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, norm(residual + x)), fused into one kernel where Triton ops are on."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, shape: DecoderShape, layer_index: int, rotary: RotaryEmbedding, backend, lora=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.lora = lora  # LoRASlots shared by all layers, or None
        self.tp = tp
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size = shape.num_heads * shape.head_dim
        self.kv_size = shape.num_kv_heads * shape.head_dim
        self.qkv_proj = nn.Linear(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, shape.hidden_size, bias=False)
        if shape.qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.qk_norm = shape.qk_norm
        self.rotary = rotary
        self.backend = backend
        self.scale = shape.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.lora is not None and self.lora.groups:
            self.lora.apply(self.layer_index, "qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, meta)
        out = self.backend.forward(q, k_cache, v_cache, meta, self.scale).view(tokens, self.q_size)
        result = self.o_proj(out)
        if self.lora is not None and self.lora.groups:
            self.lora.apply(self.layer_index, "o_proj", out, result)
        return self.tp.all_reduce(result)  # row-parallel: each rank holds a partial sum


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape, layer_index: int = 0, lora=None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_index, self.lora, self.tp = layer_index, lora, tp
        self.gate_up_proj = nn.Linear(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        lora = self.lora if self.lora is not None and self.lora.groups else None
        if lora:
            lora.apply(self.layer_index, "gate_up_proj", x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = silu_and_mul(gate, up)
        out = self.down_proj(hidden)
        if lora:
            lora.apply(self.layer_index, "down_proj", hidden, out)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, layer_index: int, rotary: RotaryEmbedding, backend, lora=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(shape, layer_index, rotary, backend, lora, tp)
        self.mlp = MLP(shape, layer_index, lora, tp)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, positions, hidden, meta, kv_cache) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), meta, kv_cache)
        hidden, normed = self.post_attention_layernorm.add_and_norm(attn, hidden)
        return hidden + self.mlp(normed)


class VocabParallelEmbedding(nn.Module):
    """One rank's rows ``[start, start + rows)`` of the embedding table; ids outside them give zeros
    here and their vectors come from the rank that holds them (all-reduce)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.start, rows = tp.vocab(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class LlamaFamilyModel(nn.Module):
    """The decoder stack plus LM head. ``forward`` takes a flattened batch of tokens.

    ``shape`` is the rank's local shape under tensor parallelism (``TensorParallel.local_shape``);
    its vocabulary size stays the whole model's."""

    def __init__(self, shape: DecoderShape, rotary: RotaryEmbedding, backend, lora=None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.shape, self.tp = shape, tp
        self.model = nn.Module()
        rows = tp.vocab(shape.vocab_size)[1]
        self.model.embed_tokens = (VocabParallelEmbedding(shape.vocab_size, shape.hidden_size, tp) if tp.enabled
                                   else nn.Embedding(shape.vocab_size, shape.hidden_size))
        self.model.layers = nn.ModuleList(DecoderLayer(shape, i, rotary, backend, lora, tp)
                                          for i in range(shape.num_layers))
        self.model.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, rows, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """[tokens] ids and positions -> [tokens, hidden] final hidden states."""
        hidden = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, meta, kv_cache)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = getattr(self, "lm_head", None)  # tied models get one only when the CPU path packs it
        logits = head(hidden) if head is not None else nn.functional.linear(hidden, self.model.embed_tokens.weight)
        if self.tp.enabled:  # each rank scored its vocabulary rows: put them side by side, drop the padding
            logits = self.tp.gather_columns(logits)[:, :self.shape.vocab_size]
        return logits
