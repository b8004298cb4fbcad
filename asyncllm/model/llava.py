"""LLaVA: a CLIP or SigLIP vision tower, a two-layer MLP projector, and a Llama or Mistral language model.

An image becomes a run of placeholder tokens in the prompt (the processor expands each ``<image>``
into one token per patch feature); the tower's hidden state at ``vision_feature_layer`` (without
CLIP's class token under the ``default`` strategy), projected to the language model's width, takes
those tokens' places in the input embeddings (model/image_embeddings.py). From there on an image is
positions in the paged KV cache like any text: decoding, the prefix cache, LoRA on the language model
and tensor parallelism work as for the text family.

Checkpoints in both of transformers' layouts load: ``model.language_model.*`` /
``model.vision_tower.*`` (transformers 5) and ``language_model.model.*`` /
``vision_tower.vision_model.*`` (the hub's llava-hf checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelLoadError
from .llama import LlamaForCausalLM
from .shape import DecoderShape
from .encoder_stages import Stages, run_stages
from .step_io import ImageInput
from .vision_language import COMPOSITE_RENAMES, LoadsOwnTensors, VisionLanguageModel
from .vision_tower import VISION_TYPES, VisionTower, activation, feature_layer_index

_TEXT_TYPES = ("llama", "mistral")


@dataclass(frozen=True)
class VisionSpec:
    """What the language model's shape carries about its vision side (read from the composite config)."""

    config: Any                    # the vision tower's transformers config
    image_token_id: int
    feature_layers: tuple          # hidden-state indices whose outputs are joined (one in most checkpoints)
    keep_class_token: bool         # vision_feature_select_strategy "full"; "default" drops the first row (CLIP's class token)
    projector_act: str
    projector_bias: bool


class LlavaProjector(LoadsOwnTensors):
    """linear_1, the activation, linear_2: the tower's width (times its feature layers) to the text width."""

    def __init__(self, vision_width: int, text_width: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, text_width, bias=bias)
        self.linear_2 = nn.Linear(text_width, text_width, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel, LlamaForCausalLM):
    """The Llama decoder with a vision tower and projector beside it (``encode_images``)."""

    renamed = {**COMPOSITE_RENAMES, **LlamaForCausalLM.renamed}
    gguf_architectures = ()

    def __init__(self, shape: DecoderShape, rotaries, backend, lora=None, tp=None, full=None) -> None:
        from ..distributed.parallel import SINGLE

        super().__init__(shape, rotaries, backend, lora, tp or SINGLE, full)
        spec: VisionSpec = (full or shape).vision
        self.spec = spec
        self.vision_tower = VisionTower(spec.config)
        width = spec.config.hidden_size * len(spec.feature_layers)
        self.multi_modal_projector = LlavaProjector(width, shape.hidden_size, spec.projector_act, spec.projector_bias)

    # ---- the declaration ----

    @classmethod
    def vision_spec(cls, config) -> VisionSpec:
        vision = config.vision_config
        layers = config.vision_feature_layer
        layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
        strategy = getattr(config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ModelLoadError(f"vision_feature_select_strategy {strategy!r} is not supported (default, full)")
        return VisionSpec(vision, int(config.image_token_id),
                          tuple(feature_layer_index(int(l), vision.num_hidden_layers) for l in layers),
                          keep_class_token=strategy == "full",
                          projector_act=config.projector_hidden_act,
                          projector_bias=bool(getattr(config, "multimodal_projector_bias", True)))

    @classmethod
    def check_config(cls, config) -> None:
        text = getattr(config, "text_config", None)
        if text is not None:  # the composite config: its text model is one the Llama class runs
            if getattr(text, "model_type", None) not in _TEXT_TYPES:
                raise ModelLoadError(f"{cls.__name__}: language model {getattr(text, 'model_type', None)!r} (config "
                                     f"key text_config.model_type) is not supported; supported: {', '.join(_TEXT_TYPES)}")
            vision_type = getattr(config.vision_config, "model_type", None)
            if vision_type not in VISION_TYPES:
                raise ModelLoadError(f"{cls.__name__}: vision tower {vision_type!r} (config key vision_config.model_type) "
                                     f"is not supported; supported: {', '.join(VISION_TYPES)}")
            cls.vision_spec(config)
            return
        super().check_config(config)

    # ---- the vision side ----

    def encode_images(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [placeholders, hidden] embeddings (images of one size are encoded together)."""
        return run_stages(self._encode_stages(images))

    def encode_image_stages(self, image: ImageInput) -> Stages[torch.Tensor]:
        """One image's embeddings, a tower layer at a time (model/encoder_stages.py)."""
        (rows,) = yield from self._encode_stages([image])
        return rows

    def _encode_stages(self, images: list[ImageInput]) -> Stages[list[torch.Tensor]]:
        tiles = [image.pixels["pixel_values"] for image in images]
        states = yield from self.vision_tower.hidden_state_stages(torch.cat(tiles), max(self.spec.feature_layers))
        features = torch.cat([states[i] for i in self.spec.feature_layers], dim=-1)
        if not self.spec.keep_class_token:
            features = features[:, 1:]
        projected = self.multi_modal_projector(features)
        return self._image_rows(projected, tiles, images)

    def _image_rows(self, projected: torch.Tensor, tiles: list[torch.Tensor],
                    images: list[ImageInput]) -> list[torch.Tensor]:
        """The projected tower rows ([tiles, patches, hidden]) as each image's placeholder rows."""
        return list(projected.unbind(0))

    @classmethod
    def image_rows(cls, spec: VisionSpec, pixels: dict) -> int:
        """How many placeholders (embedding rows) the processor gives one image."""
        config = spec.config
        patches = (config.image_size // config.patch_size) ** 2
        with_class = patches + (config.model_type == "clip_vision_model")
        return with_class if spec.keep_class_token else with_class - 1


@dataclass(frozen=True)
class LlavaNextSpec(VisionSpec):
    """LLaVA-NeXT's: the resolutions an image may be tiled at (``image_grid_pinpoints``, [height, width])."""

    grid_pinpoints: tuple = ()


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (1.6): an image is one base view at the tower's resolution plus tiles of the grid resolution
    nearest its aspect ratio ("any resolution"); the tiles' features are put back on one grid, cropped to the
    image's own aspect ratio (the padding's rows and columns dropped) and end each row with the learnt
    ``image_newline`` vector. The grid arithmetic is transformers' own (its LLaVA-NeXT helpers), so an image's
    rows match its processor's placeholder count by construction."""

    renamed = {**LlavaForConditionalGeneration.renamed, "model.image_newline": "image_newline"}

    def __init__(self, shape: DecoderShape, rotaries, backend, lora=None, tp=None, full=None) -> None:
        super().__init__(shape, rotaries, backend, lora, tp, full)
        self.image_newline = nn.Parameter(torch.empty(shape.hidden_size))

    @classmethod
    def vision_spec(cls, config) -> LlavaNextSpec:
        base = LlavaForConditionalGeneration.vision_spec(config)
        pinpoints = getattr(config, "image_grid_pinpoints", None)
        if not pinpoints:
            raise ModelLoadError(f"{cls.__name__}: the config has no image_grid_pinpoints")
        return LlavaNextSpec(base.config, base.image_token_id, base.feature_layers, base.keep_class_token,
                             base.projector_act, base.projector_bias, tuple(tuple(p) for p in pinpoints))

    @classmethod
    def image_pixels(cls, out, count: int, spec: LlavaNextSpec) -> list[dict[str, torch.Tensor]]:
        """Each image's own tiles ([tiles, 3, H, W]) and size: the processor pads every image of a prompt to
        the most tiles among them, and the padding must not reach the content hash."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        sizes, pixels = out.get("image_sizes"), out["pixel_values"]
        if sizes is None or sizes.shape[0] != count or pixels.dim() != 5:
            raise ValueError(f"the processor gave {0 if sizes is None else sizes.shape[0]} image sizes and pixels of "
                             f"shape {tuple(pixels.shape)} for {count} image(s)")
        pinpoints = [list(p) for p in spec.grid_pinpoints]
        tiles = [image_size_to_num_patches(sizes[i].tolist(), pinpoints, spec.config.image_size) for i in range(count)]
        return [{"pixel_values": pixels[i, :tiles[i]].contiguous(), "image_sizes": sizes[i:i + 1].clone()}
                for i in range(count)]

    def _image_rows(self, projected: torch.Tensor, tiles: list[torch.Tensor],
                    images: list[ImageInput]) -> list[torch.Tensor]:
        per_image = projected.split([t.shape[0] for t in tiles])
        return [self._pack(rows, image.pixels["image_sizes"][0].tolist()) for rows, image in zip(per_image, images)]

    def _pack(self, tiles: torch.Tensor, size: list[int]) -> torch.Tensor:
        """One image's [tiles, patches, hidden] features as its placeholder rows (transformers' packing)."""
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        newline = self.image_newline.to(tiles.dtype)
        if tiles.shape[0] == 1:
            return torch.cat([tiles[0], newline[None]])
        side = self.spec.config.image_size // self.spec.config.patch_size
        rows, cols = get_anyres_image_grid_shape(size, [list(p) for p in self.spec.grid_pinpoints],
                                                 self.spec.config.image_size)
        grid = tiles[1:].view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
        grid = unpad_image(grid, size)
        grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1)], dim=-1)
        return torch.cat([tiles[0], grid.flatten(1, 2).transpose(0, 1)])

    @classmethod
    def image_rows(cls, spec: LlavaNextSpec, pixels: dict) -> int:
        from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

        config = spec.config
        side = config.image_size // config.patch_size
        base = side * side + (spec.keep_class_token and config.model_type == "clip_vision_model")
        if pixels["pixel_values"].shape[0] == 1:
            return base + 1
        size = pixels["image_sizes"][0].tolist()
        rows, cols = get_anyres_image_grid_shape(size, [list(p) for p in spec.grid_pinpoints], config.image_size)
        grid = unpad_image(torch.empty(1, rows * side, cols * side), size)
        return base + grid.shape[1] * (grid.shape[2] + 1)
