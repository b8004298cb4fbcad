"""A step's input embeddings with its images in: the vision encoder's outputs, cached by image content.

A prompt's image is a run of placeholder tokens (model/step_io.py ``ImageInput``). The step that
computes any of those positions asks the model to encode the image (``encode_images``: the vision
tower and projector of the family, e.g. model/llava.py) and writes the encoder's rows over the
placeholders' token embeddings. The outputs are kept by the image's content hash, least recently used
first out, under a byte budget: a prompt split over several prefill chunks encodes its image once,
and so does a chat that sends the same screenshot again next turn (its KV may also still be in the
prefix cache, which keys image blocks by the same hash; engine/request.py).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .step_io import ImageInput, ImageRows


class ImageEmbeddings:
    """The encoder-output cache of one model runner and the scatter of a step's image rows."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.images_encoded = 0   # encoder runs, one per image (a count the tests and metrics read)
        self.cache_hits = 0       # images whose rows came from the cache

    def embed(self, input_ids: torch.Tensor, rows: list[ImageRows]) -> torch.Tensor:
        """The step's [tokens, hidden] input embeddings: token embeddings, then each image's rows over its
        placeholders."""
        embeds = self.model.embed(input_ids)
        features = self._features([r.image for r in rows])
        for r in rows:
            embeds[r.row:r.row + r.count] = features[r.image.content_hash][r.begin:r.begin + r.count].to(embeds.dtype)
        return embeds

    def _features(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        wanted: dict[str, ImageInput] = {image.content_hash: image for image in images}
        found, missing = {}, []
        for key, image in wanted.items():
            if key in self._cache:
                self._cache.move_to_end(key)
                found[key] = self._cache[key]
                self.cache_hits += 1
            else:
                missing.append(image)
        if missing:
            encoded = self.model.encode_images(missing)
            self.images_encoded += len(missing)
            for image, rows in zip(missing, encoded):
                if rows.shape[0] != image.length:
                    raise RuntimeError(f"the vision encoder gave {rows.shape[0]} rows for an image with "
                                       f"{image.length} placeholders")
                found[image.content_hash] = rows
                self._keep(image.content_hash, rows)
        return found

    def _keep(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return
        self._cache[key] = rows
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
