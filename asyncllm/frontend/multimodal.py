"""Prompts with images: the model's own transformers processor expands them into token ids and pixels.

A multimodal prompt is ``{"prompt": text, "images": [...]}`` (or vLLM's
``{"prompt": text, "multi_modal_data": {"image": ...}}``), where the text holds the model's image
placeholder (``<image>`` for LLaVA) once per image, or chat messages whose content has image parts
(frontend/messages.py), which the chat template renders as the placeholder. The processor from the
checkpoint (``AutoProcessor``) resizes and normalises each image and repeats its placeholder once
per embedding row; each image's run of placeholders becomes an ``ImageInput`` (model/step_io.py)
with a content hash of its pixels, which keys the prefix cache and the encoder cache.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ..errors import InvalidRequestError
from ..model.step_io import ImageInput
from .images import ImagePolicy, load_image

IMAGE_PART = "image"  # the part chat templates see for an image ({"type": "image"}); messages.py uses it too

_PROMPT_KEYS = {"prompt", "images", "multi_modal_data"}


def is_multimodal_prompt(prompt: Any) -> bool:
    """A ``{"prompt": ..., "images"/"multi_modal_data": ...}`` mapping."""
    return isinstance(prompt, dict) and "prompt" in prompt and "role" not in prompt


def prompt_images(prompt: dict) -> tuple[str, list[tuple[Any, str]]]:
    """The text and the ``(source, field)`` of each image of a multimodal prompt mapping."""
    unknown = sorted(set(prompt) - _PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(f"prompt: unknown key(s) {', '.join(map(repr, unknown))}; expected "
                                  "'prompt' with 'images' or 'multi_modal_data'", field="prompt")
    text = prompt["prompt"]
    if not isinstance(text, str) or not text:
        raise InvalidRequestError("prompt.prompt: expected a non-empty string", field="prompt")
    if "images" in prompt and "multi_modal_data" in prompt:
        raise InvalidRequestError("prompt: give 'images' or 'multi_modal_data', not both", field="prompt")
    if "multi_modal_data" in prompt:
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidRequestError("prompt.multi_modal_data: expected {'image': an image or a list of images}",
                                      field="prompt")
        images, name = data.get("image", []), "prompt.multi_modal_data.image"
    else:
        images, name = prompt.get("images", []), "prompt.images"
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    return text, [(image, f"{name}[{i}]") for i, image in enumerate(images)]


def take_image_sources(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """Template-ready messages with each image part reduced to ``{"type": "image"}``, and the images'
    ``(source, field)`` in the order the template renders them."""
    sources, result = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list) and any(p.get("type") == IMAGE_PART for p in content):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") == IMAGE_PART:
                    sources.append((part.get("image"), f"messages[{i}].content[{j}]"))
                    part = {"type": IMAGE_PART}
                parts.append(part)
            message = {**message, "content": parts}
        result.append(message)
    return result, sources


class MultiModalProcessor:
    """A vision-language model's processor, its image placeholder and the operator's image limits."""

    def __init__(self, model_dir, model_class, spec, policy: ImagePolicy, processor_kwargs: dict | None = None) -> None:
        from .processor_loading import load_processor

        self.processor = load_processor(model_dir)
        self.processor_kwargs = dict(processor_kwargs or {})  # the operator's (mm_processor_kwargs)
        self.model_class, self.spec, self.policy = model_class, spec, policy
        # dynamic-resolution families stack every image's patches in one tensor, LLaVA-NeXT pads each image's
        # tiles to the batch's most: they cut it themselves (with the model's spec)
        hook = getattr(model_class, "image_pixels", None)
        self._split = (lambda out, count: hook(out, count, spec)) if hook is not None else self.split_pixels
        self.image_token_id = spec.image_token_id

    def load_images(self, sources: list[tuple[Any, str]]) -> list:
        if len(sources) > self.policy.max_images:
            raise InvalidRequestError(f"{sources[self.policy.max_images][1]}: at most {self.policy.max_images} "
                                      "images per prompt (limit_mm_per_prompt)", field=sources[0][1].split("[")[0])
        return [load_image(source, self.policy, field) for source, field in sources]

    def expand(self, text: str, images: list, add_special_tokens: bool,
               fields: list[str]) -> tuple[list[int], list[ImageInput]]:
        """Token ids with each image's placeholders expanded, and the images' inputs to the encoder."""
        placeholder = getattr(self.processor, "image_token", None)
        if isinstance(placeholder, str) and text.count(placeholder) != len(images):
            raise InvalidRequestError(f"prompt: the text has {text.count(placeholder)} image placeholder(s) "
                                      f"{placeholder!r} for {len(images)} image(s); put one where each image goes",
                                      field="prompt")
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="pt",
                                 add_special_tokens=add_special_tokens, **self.processor_kwargs)
        except ValueError as exc:  # e.g. the text's placeholders and the images do not match in number
            raise InvalidRequestError(f"prompt: {exc}", field="prompt") from None
        except TypeError as exc:  # an mm_processor_kwargs entry this processor does not take
            raise InvalidRequestError(f"prompt: the model's processor refused mm_processor_kwargs ({exc})",
                                      field="prompt") from None
        ids = out["input_ids"][0].tolist()
        try:
            pixels = self._split(out, len(images))
        except ValueError as exc:
            raise InvalidRequestError(f"prompt: {exc}", field="prompt") from None
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        items, cursor = [], 0
        for index, image_pixels in enumerate(pixels):  # (more than the images where a processor adds crops)
            rows = self.model_class.image_rows(self.spec, image_pixels)
            run = positions[cursor:cursor + rows]
            if len(run) != rows or run[-1] - run[0] != rows - 1:
                field = fields[index] if index < len(fields) else "prompt"
                raise InvalidRequestError(f"{field}: the prompt has no place for this image (each image "
                                          "needs its placeholder in the text)", field=field.split("[")[0])
            items.append(ImageInput(content_hash(image_pixels), run[0], rows, image_pixels))
            cursor += rows
        if cursor != len(positions):
            raise InvalidRequestError(f"prompt: {len(positions) - cursor} image placeholder tokens without an image",
                                      field="prompt")
        return ids, items

    def mrope_positions(self, num_tokens: int, images: list[ImageInput]):
        """The M-RoPE positions of a prompt with ``images`` (model/mrope.py), for the families that rotate by
        them; None for the others and for a prompt without images (its positions are plain)."""
        hook = getattr(self.model_class, "mrope_positions", None)
        return hook(self.spec, num_tokens, images) if hook is not None and images else None

    @staticmethod
    def split_pixels(out, count: int) -> list[dict[str, torch.Tensor]]:
        """The processor's batched image tensors, one dict per image (every tensor with a row per image)."""
        tensors = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask", "token_type_ids")
                   and isinstance(v, torch.Tensor) and v.shape[:1] == (count,)}
        return [{k: v[i:i + 1].contiguous() for k, v in tensors.items()} for i in range(count)]


def content_hash(pixels: dict[str, torch.Tensor]) -> str:
    """A digest of an image's processed tensors: equal images share it, different ones never do."""
    digest = hashlib.blake2b(digest_size=16)
    for key in sorted(pixels):
        tensor = pixels[key].contiguous()
        digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
