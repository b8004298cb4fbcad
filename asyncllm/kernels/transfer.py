"""Host <-> device copies that do not stall the host, and the one that must.

On CUDA a host-to-device copy from ordinary (pageable) memory, which is what
``torch.tensor(data, device="cuda")`` and ``.to("cuda")`` do, makes the host wait until the stream
has drained: the CPU cannot build the next step while the GPU runs this one. So a step's host data
go through :func:`to_device` / :func:`stage`: written into page-locked memory (torch's caching host
allocator keeps the block alive until its copy is done) and copied with ``non_blocking=True``.
What comes back to the host (the sampled token ids, their logprobs) goes through :func:`to_host`,
the step's one deliberate synchronisation. On the CPU all of this costs nothing: the tensors are
the host arrays themselves.

``tests/sync_counter.py`` counts the operations that would synchronise a CUDA step; the decode
step keeps them to at most two (tests/test_step_syncs.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def _host(data, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.to(dtype)
    return torch.from_numpy(np.ascontiguousarray(data, dtype=_NUMPY_DTYPES[dtype]))


def to_device(data, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``data`` (a list, a numpy array or a CPU tensor) on ``device`` without waiting for it."""
    host = _host(data, dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def stage(arrays: Sequence, device: torch.device, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    """Several 1-d arrays in one page-locked buffer and one non-blocking copy; their device views,
    in order. (A step's metadata is a dozen small arrays: one copy instead of a dozen.)"""
    parts = [np.ascontiguousarray(a, dtype=_NUMPY_DTYPES[dtype]).reshape(-1) for a in arrays]
    flat = to_device(np.concatenate(parts) if parts else np.zeros(0), device, dtype)
    return list(flat.split([p.size for p in parts]))


def to_host(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values on the host: on CUDA this waits for the device (the step's sync point)."""
    return tensor.detach().cpu().numpy()
