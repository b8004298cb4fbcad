"""A step's input embeddings with its images in: the vision encoder's outputs, cached by image content.

A prompt's image is a run of placeholder tokens (model/step_io.py ``ImageInput``). The step that
computes any of those positions asks the model to encode the image (``encode_images``: the vision
tower and projector of the family, e.g. model/llava.py) and writes the encoder's rows over the
placeholders' token embeddings. The outputs are kept by the image's content hash, least recently used
first out, under a byte budget: a prompt split over several prefill chunks encodes its image once,
and so does a chat that sends the same screenshot again next turn (its KV may also still be in the
prefix cache, which keys image blocks by the same hash; engine/request.py).

An image larger than a step's encoder budget is encoded ahead (``advance``): its tower pass is a
generator (model/encoder_stages.py) resumed in each step for a share of the budget, while the running
streams decode; once done, its rows are in the cache and the step's output names it, so the scheduler
lets the prompt's chunk start the image.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .encoder_stages import Stages, run_stages
from .step_io import ImageInput, ImageRows

# Steps an encoding ahead (a pass under way, or its finished rows) is kept while its image goes unlisted: a
# step that skips the prompt (a preemption, a full step) must not throw the work away; after that many its
# request is taken to be gone, and the pass or rows are dropped.
AHEAD_GRACE_STEPS = 32


class ImageEmbeddings:
    """The encoder-output cache of one model runner and the scatter of a step's image rows."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype, max_bytes: int) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.max_bytes = max_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.images_encoded = 0   # encoder runs, one per image (a count the tests and metrics read)
        self.cache_hits = 0       # images whose rows came from the cache
        self.stages_run = 0       # stages of encodes ahead run (steps of a pass spread over several)
        # the tower's measured seconds per image row (CPU only: timing a CUDA pass would need a sync), which
        # the scheduler weighs against the step's time target; None until an image has been encoded
        self.seconds_per_row: float | None = None
        self._timed = device.type == "cpu"
        self._pending: dict[str, tuple[Stages[torch.Tensor], float]] = {}  # passes under way: (stages, done)
        # finished passes, held here (not only in the LRU cache, which may refuse or evict them) until a
        # prompt's chunk takes them
        self._ready: dict[str, torch.Tensor] = {}
        self._unlisted: dict[str, int] = {}  # steps each pending or ready entry has gone unlisted

    @property
    def pending(self) -> int:
        """Encodings ahead held: passes under way (their activations) and finished rows not yet taken."""
        return len(self._pending) + len(self._ready)

    def clear_pending(self) -> None:
        """Drop every encoding ahead (the engine was reset, or has nothing left to run)."""
        self._pending.clear()
        self._ready.clear()
        self._unlisted.clear()

    def advance(self, images: list[ImageInput], budget_rows: int, keep: set[str] = frozenset()) -> list[str]:
        """Run the encodings ahead of ``images`` for about ``budget_rows`` image rows of work this step (an
        image's whole pass counts as its rows; at least one stage runs); the hashes of those now encoded.
        An entry whose image goes unlisted (and is not among ``keep``, the step's own images) for
        ``AHEAD_GRACE_STEPS`` steps is dropped: its request finished or was aborted."""
        wanted = {image.content_hash for image in images} | set(keep)
        for key in list(self._pending) + list(self._ready):
            missed = 0 if key in wanted else self._unlisted.get(key, 0) + 1
            if missed > AHEAD_GRACE_STEPS:
                self._pending.pop(key, None)
                self._ready.pop(key, None)
                self._unlisted.pop(key, None)
            else:
                self._unlisted[key] = missed
        ready, spent = [], 0.0
        for image in images:
            key = image.content_hash
            if key in self._ready or key in self._cache:
                ready.append(key)
                continue
            if spent > 0 and spent >= budget_rows:  # the share is spent (a first stage always runs)
                break
            stages, done = self._pending.pop(key, None) or (self._stages(image), 0.0)
            try:
                while True:
                    start = time.perf_counter()
                    fraction = next(stages)
                    self.stages_run += 1
                    self._record_time(time.perf_counter() - start, (fraction - done) * image.length)
                    spent += (fraction - done) * image.length
                    done = fraction
                    if spent >= budget_rows and fraction < 1.0:  # (at 1.0 only the projector is left)
                        self._pending[key] = (stages, done)
                        break
            except StopIteration as finished:
                self._ready[key] = self._finish(image, finished.value)
                ready.append(key)
        return ready

    def _stages(self, image: ImageInput) -> Stages[torch.Tensor]:
        """The family's staged pass over ``image``, or its whole pass as a single stage."""
        staged = getattr(self.model, "encode_image_stages", None)
        if staged is not None:
            return staged(image)
        return self._whole_pass(image)

    def _whole_pass(self, image: ImageInput) -> Stages[torch.Tensor]:
        (rows,) = self.model.encode_images([image])
        yield 1.0
        return rows

    def _finish(self, image: ImageInput, rows: torch.Tensor) -> torch.Tensor:
        self.images_encoded += 1
        if rows.shape[0] != image.length:
            raise RuntimeError(f"the vision encoder gave {rows.shape[0]} rows for an image with "
                               f"{image.length} placeholders")
        self._keep(image.content_hash, rows)
        return rows

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
            if key in self._ready:  # encoded ahead: taken now
                found[key] = self._ready.pop(key)
                self._unlisted.pop(key, None)
                self.cache_hits += 1
            elif key in self._cache:
                self._cache.move_to_end(key)
                found[key] = self._cache[key]
                self.cache_hits += 1
            elif key in self._pending:  # encoding ahead, but its chunk came first: the rest of the pass now
                found[key] = self._finish(image, run_stages(self._pending.pop(key)[0]))
                self._unlisted.pop(key, None)
            else:
                missing.append(image)
        if missing:
            start = time.perf_counter()
            encoded = self.model.encode_images(missing)
            self._record_time(time.perf_counter() - start, sum(image.length for image in missing))
            for image, rows in zip(missing, encoded):
                found[image.content_hash] = self._finish(image, rows)
        return found

    def _record_time(self, seconds: float, rows: float) -> None:
        """Fold one measured piece of tower work into ``seconds_per_row`` (a moving average)."""
        if not self._timed or rows <= 0:
            return
        per_row = seconds / rows
        self.seconds_per_row = per_row if self.seconds_per_row is None else 0.7 * self.seconds_per_row + 0.3 * per_row

    def _keep(self, key: str, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes:
            return
        self._cache[key] = rows
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
