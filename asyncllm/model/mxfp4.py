"""MXFP4 expert weights (the checkpoints OpenAI publishes for gpt-oss), dequantized at load.

Such a checkpoint (``quantization_config.quant_method`` "mxfp4") stores each stacked expert projection as
two tensors: ``<proj>_blocks`` [E, N, K / 32, 16] uint8, two 4-bit E2M1 values a byte (the low nibble first),
and ``<proj>_scales`` [E, N, K / 32] uint8, one E8M0 exponent (bias 127) per 32 values; N is the
projection's output rows (2I for ``gate_up_proj``, H for ``down_proj``), K its inputs. Everything else
(attention, router, embeddings, biases) is stored in bf16. Every FP4 value times a power of two is exact in
bf16 and float32, so the dequantized weights are exactly the checkpoint's, as transformers'
``Mxfp4Config(dequantize=True)`` makes them.
"""

from __future__ import annotations

import torch

from ..errors import ModelLoadError

METHOD = "mxfp4"
# the 16 E2M1 codes: sign bit 3, then exponent and mantissa
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``blocks`` [..., N, G, 16] uint8 and ``scales`` [..., N, G] uint8 -> the weight [..., N, G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape \
            or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., N, G, 32]
    values = torch.ldexp(lut[codes], (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


class PendingPairs:
    """Holds a projection's blocks or scales until its partner tensor arrives (checkpoint order is free)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, rest: str, tensor: torch.Tensor, name: str) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """``rest`` ("gate_up_proj_blocks"...): (projection, blocks, scales) once both are here, else None."""
        projection, suffix = rest[:-len("_blocks")], rest[-len("_blocks"):]
        if suffix not in SUFFIXES:
            raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint (not MXFP4 blocks or scales)")
        held = self._held.setdefault(projection, {})
        held[suffix] = tensor
        if len(held) < 2:
            return None
        del self._held[projection]
        return projection, held["_blocks"], held["_scales"]


def is_mxfp4_tensor(rest: str) -> bool:
    """Whether a name below an expert stack is one of MXFP4's pair (``gate_up_proj_blocks``...)."""
    return rest.endswith(SUFFIXES) and rest[:-len("_blocks")] in ("gate_up_proj", "down_proj")
