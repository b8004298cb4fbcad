"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): each token's (temporal, height, width) rotary positions.

A text token's three positions are equal: its index in the prompt, shifted by what the images before
it took. An image's tokens get 3-D positions over its merged grid, all starting at the position where
the image begins: temporal ``start + t``, height ``start + row``, width ``start + column``; the text
after an image continues at the image's largest position + 1. An image of ``h x w`` tokens thus
takes ``max(h, w)`` positions for its ``h * w`` tokens, and every token after the prompt (generated,
or a speculative draft) is at its index + the prompt's ``delta`` = (largest position + 1) - length.

:class:`MRopePositions` is computed once per prompt with images, at the front (from the prompt's length
and each image's offset and grid), and rides on the EngineRequest; a step's positions are cut from it
(:func:`step_rope_positions`). Positions only feed the rotary embedding: a token's KV slot is still
its index in the sequence. A prompt without images needs none of this: its positions are plain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MRopePositions:
    """A prompt's M-RoPE positions: ``prompt`` [3, prompt length] (int64) and the shift ``delta`` of every
    position past the prompt."""

    prompt: np.ndarray
    delta: int

    def rows(self, start: int, count: int) -> np.ndarray:
        """[3, count] positions of sequence indices ``start .. start + count``."""
        length = self.prompt.shape[1]
        if start >= length:  # decode steps, drafts: one plain position per token
            return np.broadcast_to(np.arange(start, start + count, dtype=np.int64) + self.delta, (3, count))
        inside = self.prompt[:, start:start + count]
        if start + count <= length:
            return inside
        after = np.arange(length, start + count, dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(after, (3, after.size))], axis=1)


def prompt_mrope_positions(num_tokens: int, images: list[tuple[int, int, tuple[int, int, int]]]) -> MRopePositions:
    """The positions of a prompt of ``num_tokens`` tokens whose images are ``(offset, length, (t, h, w))``:
    each image's placeholders at ``offset``, its grid in tokens (after the spatial merge)."""
    parts, cursor, next_position = [], 0, 0
    for offset, length, (t, h, w) in sorted(images):
        if t * h * w != length:
            raise ValueError(f"an image of grid {t} x {h} x {w} has {length} placeholders")
        text = offset - cursor
        parts.append(np.broadcast_to(np.arange(text, dtype=np.int64) + next_position, (3, text)))
        next_position += text
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        parts.append(np.stack([grid_t.ravel(), grid_h.ravel(), grid_w.ravel()]).astype(np.int64) + next_position)
        next_position += max(h, w)
        cursor = offset + length
    text = num_tokens - cursor
    parts.append(np.broadcast_to(np.arange(text, dtype=np.int64) + next_position, (3, text)))
    prompt = np.ascontiguousarray(np.concatenate(parts, axis=1))
    return MRopePositions(prompt, int(prompt.max()) + 1 - num_tokens if num_tokens else 0)


def step_rope_positions(mrope: list, starts: list[int], counts: list[int]) -> np.ndarray:
    """A step's rotary positions: per sequence its M-RoPE rows (``mrope[i]``, or plain positions where it is
    None). [tokens] when every token's three positions agree (decode steps, text: what the fused rotary
    kernels, the CPU decode stack and CUDA graphs take), else [3, tokens]."""
    out = np.empty((3, sum(counts)), dtype=np.int64)
    row = 0
    for positions, start, count in zip(mrope, starts, counts):
        out[:, row:row + count] = (np.arange(start, start + count, dtype=np.int64) if positions is None
                                   else positions.rows(start, count))
        row += count
    if np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2]):
        return out[0].copy()
    return out
