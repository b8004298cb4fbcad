"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with M-RoPE positions and a dynamic-resolution vision tower.

An image keeps its own size (the processor rounds each side to a multiple of 28 pixels, within
``min_pixels``/``max_pixels``): its ``t x h x w`` patches are one run of ``t*h*w / merge_size**2``
``<|image_pad|>`` placeholders, filled by the tower's merged rows (model/qwen_vision.py), so each image
of a prompt has its own row count. The processor's ``pixel_values`` are every image's patches stacked
([all patches, dim]) with ``image_grid_thw`` [images, 3]: :meth:`image_pixels` cuts them per image by grid.

The language model rotates by M-RoPE (model/mrope.py, model/rotary.py ``MRotaryEmbedding``): an image's
tokens get (temporal, height, width) positions over its grid, the text after it continues from the
image's largest position + 1, and a generated token is at its index + the prompt's delta. The front
computes a prompt's positions once (:meth:`mrope_positions`); the engine cuts each step's from them; a
decode step's are plain positions again (index + delta), so the CPU decode stack and CUDA graphs run
these families as they run Qwen2. A prompt without images is plain Qwen2 throughout.

Checkpoints in both layouts load: ``model.language_model.*`` / ``model.visual.*`` (transformers 5) and
``model.*`` / ``visual.*`` (the hub's Qwen2-VL and Qwen2.5-VL checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ModelLoadError
from .llama import Qwen2ForCausalLM
from .mrope import MRopePositions, prompt_mrope_positions
from .qwen_vision import QwenVisionTower
from .rotary import MRotaryEmbedding
from .shape import DecoderShape
from .encoder_stages import Stages
from .step_io import ImageInput
from .vision_language import VisionLanguageModel


@dataclass(frozen=True)
class QwenVisionSpec:
    """What the language model's shape carries about its vision side (read from the composite config)."""

    config: Any              # the vision tower's transformers config
    image_token_id: int
    merge_size: int          # spatial_merge_size: merged tokens are merge_size x merge_size patches
    windowed: bool           # Qwen2.5-VL's tower (window attention, RMSNorm, SwiGLU)


class Qwen2VLForConditionalGeneration(VisionLanguageModel, Qwen2ForCausalLM):
    """The Qwen2 decoder with M-RoPE and Qwen2-VL's vision tower beside it (``encode_images``)."""

    renamed = {"model.language_model": "model", "model.visual": "visual", **Qwen2ForCausalLM.renamed}
    gguf_architectures = ()
    supported_rope_types = ("default",)
    model_types = ("qwen2_vl", "qwen2_vl_text")   # the composite config's and its text config's
    vision_type = "qwen2_vl"

    def __init__(self, shape: DecoderShape, rotaries, backend, lora=None, tp=None, full=None) -> None:
        from ..distributed.parallel import SINGLE

        super().__init__(shape, rotaries, backend, lora, tp or SINGLE, full)
        spec: QwenVisionSpec = (full or shape).vision
        self.spec = spec
        self.visual = QwenVisionTower(spec.config, spec.windowed)

    # ---- the declaration ----

    @classmethod
    def ties_embeddings(cls, config, text) -> bool:
        """The composite config holds the tying (transformers 5); older saves kept it in the text config."""
        return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))

    @classmethod
    def vision_spec(cls, config) -> QwenVisionSpec:
        vision = config.vision_config
        return QwenVisionSpec(vision, int(config.image_token_id), int(vision.spatial_merge_size),
                              windowed=cls.vision_type == "qwen2_5_vl")

    @classmethod
    def check_config(cls, config) -> None:
        text = getattr(config, "text_config", None)
        if text is not None:  # the composite config
            vision_type = getattr(config.vision_config, "model_type", None)
            if vision_type != f"{cls.vision_type}_vision":
                raise ModelLoadError(f"{cls.__name__}: vision tower {vision_type!r} (config key vision_config."
                                     f"model_type) is not supported; supported: {cls.vision_type}_vision")
            config = text
        if getattr(config, "model_type", None) not in cls.model_types:
            raise ModelLoadError(f"{cls.__name__}: language model {getattr(config, 'model_type', None)!r} (config "
                                 f"key text_config.model_type) is not supported; supported: {cls.model_types[-1]}")
        super().check_config(config)
        params = getattr(config, "rope_parameters", None) or {}
        if "mrope_section" not in params:
            raise ModelLoadError(f"{cls.__name__}: the config has no rope_parameters.mrope_section")

    @classmethod
    def make_rotaries(cls, config, shape: DecoderShape, max_positions: int) -> list:
        rotary = MRotaryEmbedding.from_config(config, shape.head_dim, max_positions)
        return [rotary] * shape.num_layers

    # ---- the front's hooks (frontend/multimodal.py) ----

    @classmethod
    def image_pixels(cls, out, count: int, spec=None) -> list[dict[str, torch.Tensor]]:
        """Each image's patches and grid: the processor stacks every image's patches in one tensor."""
        if count == 0:
            return []
        grids = out.get("image_grid_thw")
        if grids is None or grids.shape[0] != count:
            raise ValueError(f"the processor gave {0 if grids is None else grids.shape[0]} image grids for "
                             f"{count} image(s)")
        pixels, start, result = out["pixel_values"], 0, []
        for grid in grids:
            patches = int(grid.prod())
            result.append({"pixel_values": pixels[start:start + patches].contiguous(),
                           "image_grid_thw": grid.view(1, 3).clone()})
            start += patches
        if start != pixels.shape[0]:
            raise ValueError(f"the image grids cover {start} patches of the processor's {pixels.shape[0]}")
        return result

    @classmethod
    def image_rows(cls, spec: QwenVisionSpec, pixels: dict) -> int:
        """How many placeholders (merged tokens) the processor gives one image."""
        return int(pixels["image_grid_thw"].prod()) // spec.merge_size ** 2

    @classmethod
    def mrope_positions(cls, spec: QwenVisionSpec, num_tokens: int, images: list[ImageInput]) -> MRopePositions:
        """The M-RoPE positions of a prompt of ``num_tokens`` tokens with ``images``."""
        m = spec.merge_size
        grids = []
        for image in images:
            t, h, w = (int(v) for v in image.pixels["image_grid_thw"][0])
            grids.append((image.offset, image.length, (t, h // m, w // m)))
        return prompt_mrope_positions(num_tokens, grids)

    # ---- the vision side ----

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [placeholders, hidden] embeddings (one tower pass per image: each has its own grid)."""
        return [self.visual(image.pixels["pixel_values"], tuple(int(v) for v in image.pixels["image_grid_thw"][0]))
                for image in images]

    def encode_image_stages(self, image: ImageInput) -> Stages[torch.Tensor]:
        """One image's rows, a tower block at a time (model/encoder_stages.py)."""
        return (yield from self.visual.stages(image.pixels["pixel_values"],
                                              tuple(int(v) for v in image.pixels["image_grid_thw"][0])))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2-VL's language side with Qwen2.5-VL's tower (window attention, RMSNorm and SwiGLU blocks)."""

    model_types = ("qwen2_5_vl", "qwen2_5_vl_text")
    vision_type = "qwen2_5_vl"
