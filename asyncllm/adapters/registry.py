"""Named adapters: their paths, and a CPU LRU of the loaded ones (``max_cpu_loras``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from ..errors import LoRAError
from ..model.shape import DecoderShape
from .peft_loader import LoRAWeights, load_peft_adapter


class LoRARegistry:
    """Thread-safe: loading (slow, disk) happens outside the lock, in whatever thread calls ``load``.

    An adapter evicted from the CPU LRU stays registered and is read again on its next use;
    requests already running keep a reference to the weights they started with.
    """

    def __init__(self, shape: DecoderShape, max_rank: int, max_cpu_loras: int, layout=None) -> None:
        """``layout``: where adapters go in the model (adapters/peft_loader.py, LoRALayout)."""
        self.shape, self.max_rank, self.max_cpu_loras, self.layout = shape, max_rank, max_cpu_loras, layout
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}
        self._loaded: OrderedDict[str, LoRAWeights] = OrderedDict()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._paths)

    def path_of(self, name: str) -> str | None:
        with self._lock:
            return self._paths.get(name)

    def cached(self, name: str, path: str | None = None) -> LoRAWeights | None:
        """The loaded adapter if it is in memory (and matches ``path`` when given)."""
        with self._lock:
            weights = self._loaded.get(name)
            if weights is None or (path is not None and weights.path != _resolve(path)):
                return None
            self._loaded.move_to_end(name)
            return weights

    def load(self, name: str, path: str | None = None) -> LoRAWeights:
        """Return ``name``'s weights, reading them from disk if needed (blocking)."""
        if not isinstance(name, str) or not name:
            raise LoRAError("a LoRA adapter needs a non-empty name")
        hit = self.cached(name, path)
        if hit is not None:
            return hit
        path = path or self.path_of(name)
        if path is None:
            raise LoRAError(f"unknown LoRA adapter {name!r} (loaded: {', '.join(self.names()) or 'none'})")
        weights = load_peft_adapter(name, path, self.shape, self.max_rank, self.layout)
        with self._lock:
            self._paths[name] = weights.path
            self._loaded[name] = weights
            self._loaded.move_to_end(name)
            while len(self._loaded) > self.max_cpu_loras:
                self._loaded.popitem(last=False)
        return weights

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self._paths:
                raise LoRAError(f"unknown LoRA adapter {name!r}")
            del self._paths[name]
            self._loaded.pop(name, None)


def _resolve(path: str) -> str:
    return str(Path(path).expanduser().resolve())
