"""Helpers of the vision-language tests: random images, their PNG bytes and data: URLs, and transformers'
greedy continuation of a prompt with images (the oracle)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    """A ``size`` (width, height) RGB image of seeded random pixels."""
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def chat_parts(texts: list[str], images: list[Image.Image]) -> tuple[list[dict], list[dict]]:
    """A user message's content with ``texts[i]`` before ``images[i]``, twice: with the images as openai
    ``image_url`` data: URLs (the request) and as transformers' ``{"type": "image"}`` (for its chat template)."""
    request, template = [], []
    for text, image in zip(texts, images):
        request += [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        template += [{"type": "text", "text": text}, {"type": "image"}]
    return request, template


def greedy_reference(model, processor):
    """``greedy(text, images, max_new_tokens=8, special=True)``: transformers' greedy new token ids for the
    prompt as the checkpoint's own processor expands it (``special``: add the tokenizer's special tokens, as a
    plain prompt does; a rendered chat has them already). ``greedy.processor`` is the processor."""
    def greedy(text: str, images: list, max_new_tokens: int = 8, special: bool = True) -> list[int]:
        enc = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=special)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, enc["input_ids"].shape[1]:].tolist()

    greedy.processor = processor
    return greedy
