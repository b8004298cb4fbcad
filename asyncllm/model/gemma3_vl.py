"""Gemma 3 with its vision side: a SigLIP tower, average pooling to ``mm_tokens_per_image`` rows, a soft
embedding norm and a projection, over the Gemma 3 text decoder.

The processor expands each ``<start_of_image>`` into the image's block: begin marker,
``mm_tokens_per_image`` soft tokens, end marker; the projected rows replace the soft tokens' embeddings
(unscaled: Gemma scales token embeddings, not image rows). Inside one image block attention is
bidirectional (every soft token sees the whole image, as transformers' Gemma 3 masks it), so an image's
block is computed in one prefill step and never split (engine/scheduler.py), and the step's attention
takes the block as a span (``AttentionMetadata.bidirectional``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelLoadError
from .gemma3 import Gemma3ForCausalLM
from .shape import DecoderShape
from .encoder_stages import Stages
from .step_io import ImageInput
from .vision_language import COMPOSITE_RENAMES, VisionLanguageModel
from .vision_tower import VisionTower


@dataclass(frozen=True)
class Gemma3VisionSpec:
    config: Any                 # the SigLIP tower's transformers config
    image_token_id: int         # the soft token the image's rows replace
    tokens_per_image: int       # mm_tokens_per_image
    bidirectional: bool = True  # an image's rows attend to each other both ways


class Gemma3Projector(nn.Module):
    """Average pooling of the patch grid to tokens_per_image rows, Gemma's RMSNorm, then the projection."""

    def __init__(self, spec: Gemma3VisionSpec, text_width: int) -> None:
        super().__init__()
        vision = spec.config
        self.patches_per_side = vision.image_size // vision.patch_size
        tokens_per_side = int(round(spec.tokens_per_image ** 0.5))
        if tokens_per_side ** 2 != spec.tokens_per_image or self.patches_per_side % tokens_per_side:
            raise ModelLoadError(f"mm_tokens_per_image {spec.tokens_per_image} does not pool the tower's "
                                 f"{self.patches_per_side} x {self.patches_per_side} patches evenly")
        self.kernel = self.patches_per_side // tokens_per_side
        self.eps = vision.layer_norm_eps
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision.hidden_size, text_width))
        self.mm_soft_emb_norm = nn.Module()
        # loaded with Gemma's +1 folded in (Gemma3ForConditionalGeneration.prepare_weight)
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vision.hidden_size))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        images, _, width = states.shape
        grid = states.transpose(1, 2).reshape(images, width, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.mm_soft_emb_norm.weight.float()
        return torch.matmul(normed.to(states.dtype), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(VisionLanguageModel, Gemma3ForCausalLM):
    """The Gemma 3 decoder with the SigLIP tower and projector beside it (``encode_images``)."""

    renamed = {**COMPOSITE_RENAMES, **Gemma3ForCausalLM.renamed}
    gguf_architectures = ()

    def __init__(self, shape: DecoderShape, rotaries, backend, lora=None, tp=None, full=None) -> None:
        from ..distributed.parallel import SINGLE

        super().__init__(shape, rotaries, backend, lora, tp or SINGLE, full)
        self.spec: Gemma3VisionSpec = (full or shape).vision
        self.vision_tower = VisionTower(self.spec.config)
        self.multi_modal_projector = Gemma3Projector(self.spec, shape.hidden_size)

    @classmethod
    def vision_spec(cls, config) -> Gemma3VisionSpec:
        return Gemma3VisionSpec(config.vision_config, int(config.image_token_id), int(config.mm_tokens_per_image))

    @classmethod
    def ties_embeddings(cls, config, text) -> bool:
        """The composite config's tie (Gemma 3 ties its head to the embeddings)."""
        return bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))

    @classmethod
    def check_config(cls, config) -> None:
        text = getattr(config, "text_config", None)
        if text is None:
            return super().check_config(config)
        vision_type = getattr(config.vision_config, "model_type", None)
        if vision_type != "siglip_vision_model":
            raise ModelLoadError(f"{cls.__name__}: vision tower {vision_type!r} (config key vision_config.model_type) "
                                 "is not supported; supported: siglip_vision_model")
        super().check_config(text)

    @classmethod
    def prepare_weight(cls, name: str, tensor: torch.Tensor, from_gguf: bool = False) -> torch.Tensor:
        """The tower's LayerNorms are plain (no +1); the language model's and the soft embedding norm are Gemma's."""
        if name.startswith("vision_tower."):
            return tensor
        return super().prepare_weight(name, tensor, from_gguf)

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [tokens_per_image, hidden] rows."""
        pixels = torch.cat([image.pixels["pixel_values"] for image in images])
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))

    def encode_image_stages(self, image: ImageInput) -> Stages[torch.Tensor]:
        """One image's rows, a tower layer at a time (model/encoder_stages.py)."""
        last = yield from self.vision_tower.last_state_stages(image.pixels["pixel_values"])
        return self.multi_modal_projector(last)[0]

    @classmethod
    def image_pixels(cls, out, count: int, spec=None) -> list[dict[str, torch.Tensor]]:
        """One dict per image block of the processed prompt: ``count`` images, or more with pan-and-scan
        (``mm_processor_kwargs={"do_pan_and_scan": True}``), where the processor adds each image's crops as
        blocks of their own after it, with a row of ``pixel_values`` each."""
        pixels = out["pixel_values"]
        if pixels.shape[0] < count:
            raise ValueError(f"the processor gave {pixels.shape[0]} image tensors for {count} images")
        return [{"pixel_values": pixels[i:i + 1].contiguous()} for i in range(pixels.shape[0])]

    @classmethod
    def image_rows(cls, spec: Gemma3VisionSpec, pixels: dict) -> int:
        return spec.tokens_per_image
