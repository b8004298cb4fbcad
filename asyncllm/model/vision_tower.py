"""The vision transformers of vision-language checkpoints: CLIP's and SigLIP's image encoders.

Both cut an image into patches (a strided convolution), add learnt position embeddings and run a
stack of pre-norm encoder layers with full (non-causal) attention over the patches. They differ in
small ways, read from the vision config's ``model_type``:

* CLIP (``clip_vision_model``): a class token before the patches, a LayerNorm before the stack
  (``pre_layrnorm``, as the checkpoints spell it), no bias on the patch convolution; its
  ``post_layernorm`` applies only to the pooled class token, never to the patch states;
* SigLIP (``siglip_vision_model``): no class token, no pre-norm, a biased convolution, and
  ``post_layernorm`` over every patch state.

The tower runs once per image, at prefill, in the engine's dtype; it is not on the decode path, so it
uses torch's fused attention rather than the paged kernels. It loads its own tensors (the loader's
``load_checkpoint_tensor`` hook) so that its ``q_proj``/``k_proj``/``v_proj`` are not taken for the
language model's fused projections.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelLoadError
from .encoder_stages import Stages, run_stages
from .vision_language import LoadsOwnTensors

VISION_TYPES = ("clip_vision_model", "siglip_vision_model")


def activation(name: str):
    """The activation ``name`` as transformers defines it (one table for the towers and projectors)."""
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ModelLoadError(f"vision activation {name!r} is not supported")
    return ACT2FN[name]


class _VisionAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = nn.functional.scaled_dot_product_attention(q, k, v, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, hidden))


class _VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, intermediate), nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _VisionLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(hidden, eps=eps), nn.LayerNorm(hidden, eps=eps)
        self.self_attn = _VisionAttention(hidden, config.num_attention_heads)
        self.mlp = _VisionMLP(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, config, class_token: bool) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, patch, stride=patch, bias=not class_token)
        self.num_patches = (config.image_size // patch) ** 2
        if class_token:
            self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.position_embedding = nn.Embedding(self.num_patches + class_token, hidden)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(device=weight.device, dtype=weight.dtype)).flatten(2).transpose(1, 2)
        if patches.shape[1] != self.num_patches:
            raise ValueError(f"an image of {tuple(pixels.shape[-2:])} pixels gives {patches.shape[1]} patches; "
                             f"the tower's position table has {self.num_patches}")
        if hasattr(self, "class_embedding"):
            patches = torch.cat([self.class_embedding.expand(patches.shape[0], 1, -1), patches], dim=1)
        return patches + self.position_embedding.weight


class VisionTower(LoadsOwnTensors):
    """A CLIP or SigLIP vision transformer; ``hidden_states(pixels, upto)`` gives the states after
    layers ``0..upto`` (0: the embeddings), as transformers' ``output_hidden_states`` numbers them."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in VISION_TYPES:
            raise ModelLoadError(f"vision tower {config.model_type!r} (config key vision_config.model_type) is not "
                                 f"supported; supported: {', '.join(VISION_TYPES)}")
        self.clip = config.model_type == "clip_vision_model"
        self.embeddings = _Embeddings(config, class_token=self.clip)
        if self.clip:
            self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(_VisionLayer(config) for _ in range(config.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.num_layers = config.num_hidden_layers

    def hidden_states(self, pixels: torch.Tensor, upto: int) -> list[torch.Tensor]:
        """States ``0..upto`` ([images, tokens, hidden] each); the layers above ``upto`` are not run."""
        return run_stages(self.hidden_state_stages(pixels, upto))

    def hidden_state_stages(self, pixels: torch.Tensor, upto: int) -> Stages[list[torch.Tensor]]:
        """``hidden_states`` a layer at a time (model/encoder_stages.py): yields the fraction done."""
        x = self.embeddings(pixels)
        if self.clip:
            x = self.pre_layrnorm(x)
        states = [x]
        for i, layer in enumerate(self.encoder.layers[:upto]):
            x = layer(x)
            states.append(x)
            yield (i + 1) / upto
        return states

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """The last hidden state (SigLIP's with its final norm, as transformers' ``last_hidden_state``)."""
        return run_stages(self.last_state_stages(pixels))

    def last_state_stages(self, pixels: torch.Tensor) -> Stages[torch.Tensor]:
        """``forward`` a layer at a time (model/encoder_stages.py)."""
        last = (yield from self.hidden_state_stages(pixels, self.num_layers))[-1]
        return last if self.clip else self.post_layernorm(last)

    def checkpoint_name(self, name: str) -> str | None:
        """A leading ``vision_model.`` is the older layout's; SigLIP's attention-pooling head and a saved
        position table are not used here."""
        name = name.removeprefix("vision_model.")
        return None if name.startswith("head.") or name == "embeddings.position_ids" else name


def feature_layer_index(layer: int, num_layers: int) -> int:
    """A ``vision_feature_layer`` (negative counts from the end, as in Python) as a hidden-state index."""
    index = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= index <= num_layers:
        raise ModelLoadError(f"vision_feature_layer {layer} is outside the tower's {num_layers} layers")
    return index
