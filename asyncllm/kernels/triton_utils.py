"""Where Triton kernels can run, and small helpers their launchers share.

Importing this module never imports triton: the torch-only CPU path must not need it.
"""

from __future__ import annotations

import functools
import os

import torch

from ..errors import ConfigError


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels run in triton's CPU interpreter (tests only).

    Read from the environment each time, the way triton reads it when a kernel is decorated."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_triton_device(device: torch.device) -> None:
    """Raise a ConfigError unless the Triton kernels can run on ``device``."""
    if not triton_available():
        raise ConfigError("attention_backend='triton' needs the triton package: pip install 'asyncllm[triton]'")
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpreting():
        return
    raise ConfigError(
        f"attention_backend='triton' runs on CUDA; on {device.type} it only runs under TRITON_INTERPRET=1 "
        "(triton's interpreter, for tests). Use attention_backend='auto' or 'torch' here.")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device. Elsewhere (the interpreter) a small number, so
    that the split-KV path is taken, and tested, at the small shapes tests use."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def dot_flags(dtype: torch.dtype) -> dict[str, bool]:
    """Compile-time flags every kernel with ``tl.dot`` takes.

    UPCAST: the interpreter cannot do arithmetic on bfloat16 (it stores it as raw uint16 bits,
    triton issue 11584), so there operands are upcast to float32 first; on a GPU bf16 goes
    straight into the tensor cores. IEEE_DOT: float32 inputs get exact products, not TF32,
    so float32 results match the torch reference as tightly as float32 allows.
    """
    return {"UPCAST": interpreting() and dtype == torch.bfloat16, "IEEE_DOT": dtype == torch.float32}
