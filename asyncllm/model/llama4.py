"""Llama 4 (text): Llama's decoder with interleaved dense and mixture-of-experts layers, NoPE layers and
chunked attention, as transformers' ``Llama4ForCausalLM`` computes it.

* **MLPs**: the layers in ``moe_layers`` (every ``interleave_moe_layer_step``-th by default) are sparse: a
  router keeps each token's ``num_experts_per_tok`` best logits, each through a sigmoid (no softmax, no
  renormalisation), and the weight scales the expert's *input*; a shared expert (no gate) is added. The
  experts are ``intermediate_size`` wide, the dense layers' MLP ``intermediate_size_mlp``. Checkpoints
  store the experts stacked (``experts.gate_up_proj`` [E, H, 2I] as gate | up halves, ``experts.down_proj``
  [E, I, H]) under ``feed_forward``, with the router at ``feed_forward.router``: the engine's ``mlp``,
  ``mlp.experts`` and ``mlp.gate`` (model/moe.py).
* **Attention**: layers flagged 1 in ``no_rope_layers`` rotate q/k by rope on neighbouring pairs (transformers
  multiplies them as complex numbers), then, with ``use_qk_norm``, scale q and k to unit RMS per head (no
  weights); the others (NoPE, every fourth by default) have no rope and, with ``attn_temperature_tuning``,
  multiply q at position p by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``. Layers whose
  ``layer_types`` entry is ``chunked_attention`` (the rope layers by default) see only their chunk of
  ``attention_chunk_size`` positions: a token at position p attends to ``p // C * C .. p`` (the backends'
  ``chunk`` variant, kernels/torch_attention.py).

Both position treatments are what :meth:`Llama4ForCausalLM.make_rotaries` hands each layer in place of a plain
rotary embedding: :class:`NormedRope` on rope layers, :class:`TemperatureTuning` on NoPE layers.

``Llama4ForConditionalGeneration`` checkpoints (text and vision) load text-only: the config's ``text_config``
is the model's, its tensors are read from under ``language_model.``, and the vision tower's are skipped.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import ModelLoadError
from .decoder import DecoderModel
from .mixtral import MoEFamily
from .moe import moe_shape
from .rotary import RotaryEmbedding
from .shape import DecoderShape

_LAYER_TYPES = ("full_attention", "chunked_attention")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` scaled to unit RMS over its last dimension, in float32 (transformers' Llama4TextL2Norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class NormedRope(RotaryEmbedding):
    """Rope on neighbouring pairs of dimensions, then (``use_qk_norm``) q and k normed per head without
    weights: a rope layer's treatment of q and k. ``eps`` is the config's ``rms_norm_eps``. The rotation
    runs in float32 whatever the model's dtype, as transformers' complex multiplication does."""

    eps: float | None = None  # None: rope only

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        super().build(device, torch.float32)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                meta=None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = q.dtype
        q, k = super().forward(positions, q.float(), k.float(), meta)
        q, k = q.to(dtype), k.to(dtype)
        if self.eps is None:
            return q, k
        return l2_norm(q, self.eps), l2_norm(k, self.eps)


class TemperatureTuning(nn.Module):
    """A NoPE layer's queries scaled by position (arXiv 2501.19399): ``q * (log1p(floor((p + 1) / floor_scale))
    * attn_scale + 1)``; keys pass unchanged. It stands where a rotary embedding would (make_rotaries)."""

    length_dependent = False  # what the runner asks of a rotary embedding: the scale depends on p alone
    dynamic = None

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def build(self, device: torch.device, dtype: torch.dtype) -> None:
        """No tables: the scales are computed from each step's positions."""

    def cache_key(self, prompt_len: int) -> int:
        return 0

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                meta=None) -> tuple[torch.Tensor, torch.Tensor]:
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        return (q * scales[:, None, None]).to(q.dtype), k


class Llama4ForCausalLM(MoEFamily, DecoderModel):
    renamed = {"feed_forward": "mlp", "router": "gate"}
    interleaved_rope = True
    expert_lora = "swapped"  # its experts are stored [E, in, out], unmarked: PEFT's pairs come transposed

    @classmethod
    def language_config(cls, config):
        """The text model's config (here: ``config`` itself)."""
        return config

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        config = cls.language_config(config)
        shape = super().read_shape(config)
        layers = shape.num_layers
        shape.intermediate_size = int(config.intermediate_size_mlp)  # the dense layers' MLP
        shape.moe = moe_shape(config, router="topk_sigmoid", renormalize=False, weights_on_input=True,
                              shared_intermediate_size=int(config.intermediate_size))
        sparse = {int(i) for i in (config.moe_layers or ())}
        shape.moe_layers = tuple(i in sparse for i in range(layers))
        rope = tuple(bool(flag) for flag in config.no_rope_layers[:layers])
        shape.rope_layers = rope if not all(rope) else ()
        chunk = config.attention_chunk_size
        chunks = tuple(int(chunk) if t == "chunked_attention" and chunk else None for t in _layer_types(config))
        shape.layer_chunks = chunks if any(c is not None for c in chunks) else ()
        return shape

    @classmethod
    def check_config(cls, config) -> None:
        config = cls.language_config(config)
        super().check_config(config)
        name, layers = cls.__name__, config.num_hidden_layers
        if len(config.no_rope_layers or ()) < layers:
            raise ModelLoadError(f"{name}: no_rope_layers (config key no_rope_layers) has "
                                 f"{len(config.no_rope_layers or ())} entries for {layers} layers")
        outside = [i for i in (config.moe_layers or ()) if not 0 <= int(i) < layers]
        if outside:
            raise ModelLoadError(f"{name}: moe_layers {outside} (config key moe_layers) are outside the {layers} layers")
        types = _layer_types(config)
        unknown = sorted({t for t in types if t not in _LAYER_TYPES})
        if unknown or len(types) < layers:
            raise ModelLoadError(f"{name}: layer_types (config key layer_types) must give one of "
                                 f"{', '.join(_LAYER_TYPES)} for each of the {layers} layers; got {types}")
        if "chunked_attention" in types and not config.attention_chunk_size:
            raise ModelLoadError(f"{name}: chunked_attention layers need attention_chunk_size (config key "
                                 "attention_chunk_size)")
        if config.attn_temperature_tuning and not config.floor_scale:
            raise ModelLoadError(f"{name}: attn_temperature_tuning needs a positive floor_scale (config key "
                                 "floor_scale)")

    @classmethod
    def make_rotaries(cls, config, shape: DecoderShape, max_positions: int) -> list[nn.Module | None]:
        """Rope layers: one :class:`NormedRope`; NoPE layers: one :class:`TemperatureTuning` (or None without
        ``attn_temperature_tuning``)."""
        config = cls.language_config(config)
        rope = NormedRope.from_config(config, shape.head_dim, max_positions, interleaved=True)
        if config.use_qk_norm:
            rope.eps = float(config.rms_norm_eps)
        nope = (TemperatureTuning(config.floor_scale, config.attn_scale) if config.attn_temperature_tuning
                else None)
        return [rope if shape.has_rope(i) else nope for i in range(shape.num_layers)]


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """A Llama 4 checkpoint with its vision tower, run as the text model it holds."""

    renamed = {"language_model.model": "model", "language_model.lm_head": "lm_head", **Llama4ForCausalLM.renamed}

    @classmethod
    def language_config(cls, config):
        """The nested ``text_config``, named after this architecture so that the registry finds this class
        again (its tensors live under ``language_model.``); a config already unwrapped passes unchanged."""
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        text = copy.deepcopy(text)
        text.architectures = list(getattr(config, "architectures", None) or [cls.__name__])
        return text

    def skips_tensor(self, name: str) -> bool:
        """The vision tower and its projector (and a tied head's copy)."""
        return (name.startswith(("vision_model.", "multi_modal_projector."))
                or (name == "language_model.lm_head.weight" and self.shape.tie_word_embeddings))


def _layer_types(config) -> list:
    """Each layer's attention type; transformers' default: chunked on rope layers when a chunk size is set."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    chunked = config.attention_chunk_size is not None
    return ["chunked_attention" if rope and chunked else "full_attention" for rope in config.no_rope_layers]
