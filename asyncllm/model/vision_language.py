"""What every vision-language family shares: reading the composite config, and modules that load their own tensors.

A vision-language checkpoint's config nests the language model's (``text_config``) beside the vision tower's.
The engine runs the language model as a native family, so :meth:`VisionLanguageModel.language_config` hands
the engine that nested config, named after the composite architecture (the registry then finds the
vision-language class again) and carrying the family's vision facts (``vision_spec``), which ``read_shape``
puts on the shape. :data:`COMPOSITE_RENAMES` maps both of transformers' checkpoint layouts onto the engine's
module names. :class:`LoadsOwnTensors` lets a vision module take every checkpoint tensor under its name (the
loader's ``load_checkpoint_tensor`` hook), so that its ``q_proj``/``k_proj``/``v_proj`` are not taken for the
language model's fused projections.
"""

from __future__ import annotations

import copy

from torch import nn

from ..errors import ModelLoadError
from .shape import DecoderShape

# transformers 5's layout (model.language_model.*, model.vision_tower.*) and the hub's older one
# (language_model.model.*, language_model.lm_head.*); the towers strip their own older prefixes
COMPOSITE_RENAMES = {"model.language_model": "model", "language_model.model": "model",
                     "language_model.lm_head": "lm_head", "model.vision_tower": "vision_tower",
                     "model.multi_modal_projector": "multi_modal_projector"}


class VisionLanguageModel:
    """The composite-config side of a vision-language family (mixed in before its text family's class)."""

    @classmethod
    def vision_spec(cls, config):
        """The family's vision facts, read from the composite config."""
        raise NotImplementedError

    @classmethod
    def ties_embeddings(cls, config, text) -> bool:
        """Whether the head is tied to the embeddings (the text config says so, unless a family knows better)."""
        return bool(getattr(text, "tie_word_embeddings", False))

    @classmethod
    def language_config(cls, config):
        """The nested ``text_config``, named after this architecture and carrying ``vision_spec``; a config already
        unwrapped passes unchanged."""
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        text = copy.deepcopy(text)
        text.architectures = list(getattr(config, "architectures", None) or [cls.__name__])
        text.tie_word_embeddings = cls.ties_embeddings(config, text)
        text.vision_spec = cls.vision_spec(config)
        return text

    @classmethod
    def read_shape(cls, config) -> DecoderShape:
        shape = super().read_shape(config)
        shape.vision = getattr(config, "vision_spec", None)
        if shape.vision is None:
            raise ModelLoadError(f"{cls.__name__}: the config has no vision_config")
        return shape


class LoadsOwnTensors(nn.Module):
    """A module whose checkpoint tensors are its own parameters by their names below it (shapes checked)."""

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor named ``name`` (below this module) fills; None: not used here."""
        return name

    def load_checkpoint_tensor(self, path: str, name: str, tensor, original: str) -> str | None:
        name = self.checkpoint_name(name)
        if name is None:
            return None
        params = dict(self.named_parameters())
        if name not in params:
            raise ModelLoadError(f"unexpected tensor {original!r} in checkpoint (no matching parameter)")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"tensor {original!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        return f"{path}.{name}:None"

    def expected_pieces(self, path: str) -> set[str]:
        return {f"{path}.{name}:None" for name, _ in self.named_parameters()}
