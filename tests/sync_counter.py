"""Counting the operations that would make the host wait for a CUDA device, without a GPU.

On the CPU nothing synchronises, so :class:`SyncCounter` patches the torch operations that do on
CUDA and counts their calls while counting is switched on (in the thread that switched it on):

* values read back on the host: ``Tensor.item``, ``tolist``, ``numpy``, ``cpu``, ``bool(t)``,
  ``int(t)``, ``float(t)``;
* shapes that depend on values: ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``
  without ``output_size``, and indexing with a boolean mask;
* blocking host-to-device copies: ``torch.tensor`` / ``torch.as_tensor`` with a ``device``,
  ``Tensor.to(device)`` without ``non_blocking=True``, and indexing with a Python list (torch
  copies it to the device first);
* ``asyncllm.kernels.transfer.to_host``: the step's deliberate copy back, counted once (the calls
  it makes inside are not counted again).

Triton kernel launches are not counted: on CUDA a launch never waits, while the CPU interpreter
that runs them in tests reads its arguments back as numpy arrays.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import Counter

import torch

from asyncllm.kernels import transfer

_TENSOR_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "nonzero",
                   "masked_select", "unique")


class SyncCounter:
    """``with SyncCounter() as counter: ...``; then ``counter.counts`` (op -> calls) while
    :meth:`counting` was on, or ``counter.total``."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._local = threading.local()
        self._patches: list[tuple[object, str, object]] = []

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def _active(self) -> bool:
        return getattr(self._local, "depth", 0) == 1  # on, and not inside a counted or paused call

    @contextlib.contextmanager
    def counting(self):
        """Count in this thread for the duration of the block."""
        self._local.depth = 1
        try:
            yield self
        finally:
            self._local.depth = 0

    @contextlib.contextmanager
    def _nested(self):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1 if depth else 0
        try:
            yield
        finally:
            self._local.depth = depth

    def _count(self, name: str) -> None:
        if self._active():
            self.counts[name] += 1

    def _patch(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, make(original))

    def _counted(self, name: str, condition=lambda *a, **k: True):
        def make(original):
            def wrapper(*args, **kwargs):
                if self._active() and condition(*args, **kwargs):
                    self.counts[name] += 1
                with self._nested():
                    return original(*args, **kwargs)
            return wrapper
        return make

    def _paused(self, original):
        def wrapper(*args, **kwargs):
            with self._nested():
                return original(*args, **kwargs)
        return wrapper

    def __enter__(self) -> "SyncCounter":
        for name in _TENSOR_METHODS:
            self._patch(torch.Tensor, name, self._counted(f"Tensor.{name}"))
        self._patch(torch.Tensor, "repeat_interleave",
                    self._counted("repeat_interleave", lambda *a, **k: k.get("output_size") is None))
        self._patch(torch, "repeat_interleave",
                    self._counted("repeat_interleave", lambda *a, **k: len(a) > 1 and k.get("output_size") is None))
        self._patch(torch, "nonzero", self._counted("nonzero"))
        for name in ("tensor", "as_tensor"):
            self._patch(torch, name, self._counted(f"torch.{name}(device=...)", lambda *a, **k: "device" in k))
        self._patch(torch.Tensor, "to", self._counted("Tensor.to(device)", _blocking_device_copy))
        self._patch(torch.Tensor, "__getitem__", self._counted("index with list/mask", _syncing_index))
        self._patch(torch.Tensor, "__setitem__", self._counted("index with list/mask", _syncing_index))
        to_host = transfer.to_host
        counted_to_host = self._counted("to_host")(to_host)
        for module in [m for name, m in sys.modules.items() if name.startswith("asyncllm")]:
            if getattr(module, "to_host", None) is to_host:  # imported by name: patch each
                self._patch(module, "to_host", lambda original: counted_to_host)
        for owner in _triton_launchers():
            self._patch(owner, "run", self._paused)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)
        self._patches.clear()


def _blocking_device_copy(tensor, *args, **kwargs) -> bool:
    if kwargs.get("non_blocking") or (len(args) > 1 and isinstance(args[1], bool) and args[1]):
        return False
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device))


def _syncing_index(tensor, index, *rest) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool) for p in parts)


def _triton_launchers() -> list:
    """The classes whose ``run`` launches a Triton kernel (compiled and interpreted)."""
    owners = []
    try:
        from triton.runtime.interpreter import InterpretedFunction
        owners.append(InterpretedFunction)
    except ImportError:
        pass
    try:
        from triton.runtime.jit import JITFunction
        owners.append(JITFunction)
    except ImportError:
        pass
    return owners
