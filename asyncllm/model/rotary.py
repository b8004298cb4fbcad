"""Rotary position embeddings: the rope types of the families in ``model/``, with precomputed tables.

Frequencies come from transformers' own rope-initialisation functions (``ROPE_INIT_FUNCTIONS``), so
every rope type it knows matches its numerics exactly; "default" is computed here as every
transformers model class does. Three variants need more than one table:

* **longrope** (Phi-3/Phi-4-mini 128k): transformers switches every position of a forward pass to the
  long factors once the sequence is longer than ``original_max_position_embeddings``. Here the choice is
  made per sequence the same way, for the length ``max(prompt length, length after this step)``: a
  prompt is rotated as transformers rotates it in one pass even when it is prefilled in chunks, and
  each generated token as transformers rotates it in ``generate``. Tokens already cached keep the
  rotation they were written with, as transformers' KV cache keeps them.
* **dynamic** (dynamic NTK): the base grows with the sequence length past ``max_position_embeddings``;
  each sequence gets the frequencies of that same length (computed on demand, kept in a small cache),
  as transformers recomputes them for a growing sequence.

Since a prompt's rotation depends on its length, prefix-cached KV is shared only between prompts
that get the same rotation (:meth:`RotaryEmbedding.cache_key`, part of the request's cache salt).
* **partial** and **interleaved** rotation (Phi-4-mini, GLM-4, Cohere): only the first ``rotary_dim``
  dimensions rotate, and GLM/Cohere pair neighbouring dimensions instead of the two halves.

Any other rope type is a :class:`ModelLoadError` naming it and the config key it came from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels.ops import rotary_embedding

_DYNAMIC_CACHE = 256  # distinct sequence lengths whose dynamic-NTK frequencies are kept


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """The rope parameters of ``config`` (one layer type's for per-layer-type configs such as Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return dict(params)


def rope_type_of(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default")) or "default"


def partial_rotary_factor(config, layer_type: str | None = None) -> float:
    params = rope_parameters(config, layer_type)
    return float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0)


def _init_function(rope_type: str):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported rope type {rope_type!r} (config key rope_parameters.rope_type); "
                             f"supported: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    return ROPE_INIT_FUNCTIONS[rope_type]


def _call_init(rope_type: str, config, layer_type: str | None, seq_len: int | None = None):
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, scaling = _init_function(rope_type)(config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    """Plain rope's inverse frequencies over ``dim`` rotated dimensions, as transformers computes them."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_frequencies(config, head_dim: int, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for a transformers config (the short factors for longrope)."""
    params = rope_parameters(config, layer_type)
    rope_type = rope_type_of(params)
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = default_inv_freq(base, int(head_dim * partial_rotary_factor(config, layer_type)))
        factors = getattr(config, "rope_freq_factors", None)  # from a GGUF file's rope_freqs (llama3 scaling)
        if factors is not None:
            if len(factors) != inv_freq.numel():
                raise ModelLoadError(f"rope_freq_factors has {len(factors)} entries for {inv_freq.numel()} "
                                     "rotary frequencies")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
        return inv_freq, 1.0
    return _call_init(rope_type, config, layer_type)


@dataclass(frozen=True)
class LongRope:
    """The long factors of a longrope config and the length past which they apply."""

    inv_freq: torch.Tensor
    original_max: int


@dataclass(frozen=True)
class DynamicNTK:
    """What it takes to recompute dynamic-NTK frequencies for a sequence length."""

    config: object
    layer_type: str | None
    max_position_embeddings: int


class RotaryEmbedding(nn.Module):
    """Applies rope to q/k of shape [tokens, heads, head_dim] at given positions.

    ``inv_freq`` has ``rotary_dim / 2`` entries; the dimensions past ``rotary_dim`` pass unchanged."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, *, interleaved: bool = False,
                 long: LongRope | None = None, dynamic: DynamicNTK | None = None) -> None:
        super().__init__()
        self.inv_freq, self.scaling, self.max_positions = inv_freq, scaling, max_positions
        self.rotary_dim = 2 * inv_freq.numel()
        self.interleaved, self.long, self.dynamic = interleaved, long, dynamic
        self.cos = self.sin = None
        self._dynamic_tables: dict[int, torch.Tensor] = {}  # dynamic NTK: sequence length -> inv_freq
        # decided once, since every layer asks on every step: "plain" is rotate-half over one table (what the
        # fused kernels and the decode stack run); "length_dependent" rope depends on each sequence's length
        self.plain = not interleaved and long is None and dynamic is None
        self.length_dependent = long is not None or dynamic is not None

    @classmethod
    def from_config(cls, config, head_dim: int, max_positions: int, *, layer_type: str | None = None,
                    interleaved: bool = False) -> "RotaryEmbedding":
        """The rotary embedding a transformers config asks for (per ``layer_type`` where rope differs by layer)."""
        params = rope_parameters(config, layer_type)
        rope_type = rope_type_of(params)
        inv_freq, scaling = rope_frequencies(config, head_dim, layer_type)
        long = dynamic = None
        if rope_type == "longrope":
            original = int(params.get("original_max_position_embeddings")
                           or getattr(config, "original_max_position_embeddings", 0) or config.max_position_embeddings)
            long = LongRope(_call_init(rope_type, config, layer_type, seq_len=original + 1)[0], original)
        elif rope_type == "dynamic":
            dynamic = DynamicNTK(config, layer_type, int(config.max_position_embeddings))
        return cls(inv_freq, scaling, max_positions, interleaved=interleaved, long=long, dynamic=dynamic)

    def cache_key(self, prompt_len: int) -> int:
        """The rotation a prompt of ``prompt_len`` tokens gets (equal keys: equal rotations)."""
        if self.long is not None:
            return int(prompt_len > self.long.original_max)
        if self.dynamic is not None:
            return prompt_len if prompt_len > self.dynamic.max_position_embeddings else 0
        return 0

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        """Compute the tables on the target device (call after the module is materialised). A
        longrope embedding stacks the long table under the short one (rows ``max_positions + p``)."""
        positions = torch.arange(self.max_positions, dtype=torch.float, device=device)
        cos, sin = self._table(self.inv_freq, positions)
        if self.long is not None:
            long_cos, long_sin = self._table(self.long.inv_freq, positions)
            cos, sin = torch.cat([cos, long_cos]), torch.cat([sin, long_sin])
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)
        self._dynamic_tables.clear()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                meta=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k). ``meta`` (the step's AttentionMetadata) is needed by longrope and dynamic
        rope, which depend on each sequence's length."""
        if self.plain and self.rotary_dim == q.shape[-1]:
            return rotary_embedding(positions, q, k, self.cos, self.sin)
        if self.dynamic is not None:
            cos, sin = self._dynamic_cos_sin(positions, meta)
        else:
            rows = positions
            if self.long is not None:
                lengths = _token_seq_lens(meta, positions.shape[0])
                rows = positions + (lengths > self.long.original_max).long() * self.max_positions
            cos, sin = self.cos[rows], self.sin[rows]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.interleaved:
            pairs = rot.unflatten(-1, (-1, 2))
            turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        else:
            half = self.rotary_dim // 2
            turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + turned * sin
        return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)

    def _dynamic_cos_sin(self, positions: torch.Tensor, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: the table row of its position, or for a sequence longer than
        ``max_position_embeddings`` the frequencies of that length (computed once per length)."""
        cos, sin = self.cos[positions], self.sin[positions]
        limit = self.dynamic.max_position_embeddings
        lengths = (meta.rope_lens or meta.seq_lens) if meta is not None else []
        if max(lengths, default=0) <= limit:
            return cos, sin
        cos, sin = cos.clone(), sin.clone()
        for i, length in enumerate(lengths):
            if length <= limit:
                continue
            start, end = meta.query_start[i], meta.query_start[i + 1]
            inv_freq = self._dynamic_frequencies(length)
            row_cos, row_sin = self._table(inv_freq, positions[start:end].float())
            cos[start:end], sin[start:end] = row_cos.to(cos.dtype), row_sin.to(sin.dtype)
        return cos, sin

    def _dynamic_frequencies(self, length: int) -> torch.Tensor:
        cached = self._dynamic_tables.get(length)
        if cached is None:
            if len(self._dynamic_tables) >= _DYNAMIC_CACHE:
                self._dynamic_tables.clear()
            inv_freq, _ = _call_init("dynamic", self.dynamic.config, self.dynamic.layer_type, seq_len=length)
            cached = self._dynamic_tables[length] = inv_freq.to(self.cos.device)
        return cached


def _token_seq_lens(meta, num_tokens: int) -> torch.Tensor:
    """Each token's sequence length after this step ([tokens] int64), without a device sync."""
    if meta is None:
        raise ValueError("longrope needs the step's attention metadata")
    lengths = meta.rope_lens_tensor if meta.rope_lens_tensor is not None else meta.seq_lens_tensor
    if num_tokens == meta.num_seqs:  # one token per sequence (decode steps, CUDA graphs)
        return lengths
    counts = meta.query_start_tensor[1:] - meta.query_start_tensor[:-1]
    return torch.repeat_interleave(lengths, counts, output_size=num_tokens)


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE (Qwen2-VL, Qwen2.5-VL): the rotary frequencies split in three sections (``mrope_section``,
    the config's rope parameters), rotated by a token's temporal, height and width positions.

    Given [tokens] positions (text, decode steps: the three are equal) it is plain rope over the same
    tables, on the fused kernels, the CPU decode stack and CUDA graphs; given [3, tokens] (a prefill with an
    image's tokens, model/mrope.py) each frequency's cos/sin row comes from its own section's position."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, sections) -> None:
        super().__init__(inv_freq, scaling, max_positions)
        self.sections = tuple(int(s) for s in sections)
        if len(self.sections) != 3 or sum(self.sections) != inv_freq.numel() or min(self.sections) < 0:
            raise ModelLoadError(f"mrope_section {list(self.sections)} (config key rope_parameters.mrope_section) "
                                 f"must be 3 sizes adding up to {inv_freq.numel()}, half the head dimension")
        self._component = None

    @classmethod
    def from_config(cls, config, head_dim: int, max_positions: int, **_) -> "MRotaryEmbedding":
        params = rope_parameters(config)
        if rope_type_of(params) not in ("default", "mrope"):
            raise ModelLoadError(f"rope type {rope_type_of(params)!r} (config key rope_parameters.rope_type) is not "
                                 "supported with M-RoPE; supported: default")
        if "mrope_section" not in params:
            raise ModelLoadError("the config has no rope_parameters.mrope_section (M-RoPE's split of the rotary "
                                 "dimensions into temporal, height and width)")
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return cls(default_inv_freq(base, head_dim), 1.0, max_positions, params["mrope_section"])

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        super().build(device, dtype)
        # per rotated dimension, the position component (0 temporal, 1 height, 2 width) of its frequency
        half = torch.repeat_interleave(torch.arange(3), torch.tensor(self.sections))
        self._component = torch.cat([half, half]).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                meta=None) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k, meta)
        index = self._component.view(1, 1, -1).expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index).squeeze(0)  # [3, tokens, dim] -> [tokens, dim]
        sin = self.sin[positions].gather(0, index).squeeze(0)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
