"""The vision transformers of Qwen2-VL and Qwen2.5-VL: images at their own resolution, merged 2 x 2.

The processor (transformers' Qwen2-VL image processor) resizes an image to a multiple of
``patch_size * merge_size`` pixels on each side and hands over its patches flattened, [patches,
channels * temporal_patch_size * patch_size**2], already in merge-block order (every run of
``merge_size**2`` rows is one 2 x 2 block), with the image's grid (t, h, w) in patches. The tower:

* embeds each patch with a Conv3d over (temporal_patch_size, patch, patch), no bias;
* rotates q/k in every block by 2-D rope: the first half of the rotated frequencies by the patch's row,
  the second half by its column (head_dim / 4 frequencies each);
* runs pre-norm blocks with full (non-causal) attention inside one image frame. Qwen2-VL: LayerNorm and
  an fc1/fc2 MLP (quick_gelu). Qwen2.5-VL: RMSNorm, a biased SwiGLU MLP, and attention inside windows of
  ``window_size`` pixels except in the ``fullatt_block_indexes`` blocks; for that the patches are
  reordered so each window's blocks are contiguous, and the merged rows put back in grid order at the end;
* merges each 2 x 2 block (``merger``: a norm, then Linear-GELU-Linear to the language model's width).

It runs once per image, at prefill, with torch's fused attention; its tensors load through its own
``load_checkpoint_tensor`` (so its ``qkv`` is not taken for the language model's projections).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ModelLoadError
from .encoder_stages import Stages, run_stages
from .vision_language import LoadsOwnTensors
from .vision_tower import activation

QWEN_VISION_TYPES = ("qwen2_vl", "qwen2_5_vl")  # the vision config's model_type, less "_vision"
_EPS = 1e-6


class _RMSNorm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS)).to(x.dtype)


def _norm(windowed: bool, size: int) -> nn.Module:
    return _RMSNorm(size) if windowed else nn.LayerNorm(size, eps=_EPS)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """``bounds``: row offsets of the segments that attend among themselves (frames or windows)."""
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim).unbind(1)
        q, k = (((t.float() * cos) + (_rotate_half(t.float()) * sin)).to(x.dtype) for t in (q, k))  # in float32
        out = torch.empty_like(q)
        for begin, end in zip(bounds[:-1], bounds[1:]):
            seg = [t[begin:end].transpose(0, 1) for t in (q, k, v)]  # [heads, rows, head_dim]
            out[begin:end] = nn.functional.scaled_dot_product_attention(*seg).transpose(0, 1)
        return self.proj(out.reshape(x.shape[0], -1))


class _MLP(nn.Module):
    """Qwen2-VL's fc1/fc2, or Qwen2.5-VL's biased SwiGLU (gate/up/down)."""

    def __init__(self, width: int, hidden: int, act: str, gated: bool) -> None:
        super().__init__()
        self.gated, self.act = gated, activation(act)
        if gated:
            self.gate_proj, self.up_proj = nn.Linear(width, hidden), nn.Linear(width, hidden)
            self.down_proj = nn.Linear(hidden, width)
        else:
            self.fc1, self.fc2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int, act: str, windowed: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(windowed, width), _norm(windowed, width)
        self.attn = _Attention(width, heads)
        self.mlp = _MLP(width, hidden, act, gated=windowed)

    def forward(self, x, cos, sin, bounds) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, width: int, out: int, merge: int, windowed: bool) -> None:
        super().__init__()
        self.width = width * merge * merge
        self.ln_q = _norm(windowed, width)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))


class QwenVisionTower(LoadsOwnTensors):
    """Qwen2-VL's (``windowed=False``) or Qwen2.5-VL's vision transformer; ``forward(pixels, grid)`` gives one
    image's merged rows, [t * h * w / merge**2, out width]."""

    def __init__(self, config, windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        self.patch, self.temporal, self.merge = config.patch_size, config.temporal_patch_size, config.spatial_merge_size
        self.channels = config.in_channels
        if windowed:  # Qwen2.5-VL names its width hidden_size and its output out_hidden_size
            width, hidden, out = config.hidden_size, config.intermediate_size, config.out_hidden_size
            self.full_blocks = set(config.fullatt_block_indexes)
            self.window = config.window_size // self.merge // self.patch  # in merged tokens
            if self.window < 1:
                raise ModelLoadError(f"vision_config.window_size {config.window_size} is smaller than one merged "
                                     f"token ({self.merge * self.patch} pixels)")
        else:
            width, out = config.embed_dim, config.hidden_size
            hidden = int(config.embed_dim * config.mlp_ratio)
        self.width, self.heads = width, config.num_heads
        if width % self.heads or (width // self.heads) % 4:
            raise ModelLoadError(f"vision_config: width {width} over num_heads {self.heads} gives a head size that "
                                 "2-D rope cannot split in four")
        self.patch_embed = nn.Module()
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed.proj = nn.Conv3d(self.channels, width, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(_Block(width, self.heads, hidden, config.hidden_act, windowed)
                                    for _ in range(config.depth))
        self.merger = _Merger(width, out, self.merge, windowed)
        self.theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's merged rows in grid order."""
        return run_stages(self.stages(pixels, grid))

    def stages(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> Stages[torch.Tensor]:
        """``forward`` a block at a time (model/encoder_stages.py): yields the fraction done."""
        t, h, w = grid
        weight = self.patch_embed.proj.weight
        x = pixels.to(device=weight.device, dtype=weight.dtype)
        x = self.patch_embed.proj(x.view(-1, self.channels, self.temporal, self.patch, self.patch)).view(-1, self.width)
        if x.shape[0] != t * h * w:
            raise ValueError(f"{x.shape[0]} patches for an image grid of {t} x {h} x {w}")
        cos, sin = self._rope(t, h, w, x.device)
        frames = list(range(0, t * h * w + 1, h * w))
        order = None
        if self.windowed:
            order, windows = self._windows(t, h // self.merge, w // self.merge)
            x, cos, sin = (self._by_block(a, order) for a in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            bounds = windows if self.windowed and i not in self.full_blocks else frames
            x = block(x, cos, sin, bounds)
            yield (i + 1) / len(self.blocks)
        merged = self.merger(x)
        return merged if order is None else merged[torch.argsort(order)]

    def _rope(self, t: int, h: int, w: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per patch (in merge-block order), cos and sin [patches, 1, head_dim] of its (row, column)."""
        m, quarter = self.merge, self.width // self.heads // 2
        # computed here, on the host: the model is built on the meta device, so no tensor is kept from __init__
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(-1, -1, w // m, m).transpose(1, 2).reshape(-1)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, -1, -1).transpose(1, 2).reshape(-1)
        freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1).repeat(t, 1)
        emb = torch.cat([freqs, freqs], dim=-1).to(device).unsqueeze(1)
        return emb.cos(), emb.sin()

    def _windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merged tokens in window order (each ``window`` x ``window`` square of the grid, row by row, then the
        next), and the row offsets of the windows in the reordered patches."""
        size, order, bounds = self.window, [], [0]
        grid = torch.arange(t * h * w).view(t, h, w)
        for frame in range(t):
            for top in range(0, h, size):
                for left in range(0, w, size):
                    cell = grid[frame, top:top + size, left:left + size].reshape(-1)
                    order.append(cell)
                    bounds.append(bounds[-1] + cell.numel() * self.merge ** 2)
        return torch.cat(order), bounds

    def _by_block(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """``x``'s rows regrouped: merge block ``order[i]`` becomes the i-th."""
        unit = self.merge ** 2
        return x.view(-1, unit, *x.shape[1:])[order.to(x.device)].reshape(x.shape)
