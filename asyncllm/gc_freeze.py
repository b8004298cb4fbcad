"""Keeping the start-up heap out of the garbage collector's full collections.

A full (generation 2) collection walks every container object the process holds, and whichever thread
runs it keeps the GIL throughout: the host's event loop and the engine thread both wait. After torch,
transformers and a model are loaded that is millions of objects. Measured with W-HOST (32 streams beside a
host route at 50 requests/s, 2 cores, Python 3.11): one full collection of 179 ms in a 12 s phase stalled
the loop as long, delayed the nine host requests that arrived meanwhile and so set the host route's p99 (66 ms
against 3.3 ms alone; docs/benchmarks.md, W-HOST).

So once an engine has started, :func:`freeze_startup_heap` collects what start-up left behind, then
``gc.freeze()`` moves every object alive to the permanent generation, which later collections skip: they walk
only what was made since (requests, outputs). The freeze is process-wide, so it is counted: the last engine
to close (:func:`release_startup_heap`) unfreezes, and the collector again sees everything, the closed
engine's cycles included. Where the application had frozen objects itself before the first engine started,
the engines leave the unfreezing to it.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_owns_freeze = False  # whether the first holder found nothing frozen (then the last one unfreezes)


def freeze_startup_heap() -> None:
    """Collect, then freeze every live object out of future collections; pair with :func:`release_startup_heap`."""
    global _holders, _owns_freeze
    with _lock:
        if _holders == 0:
            _owns_freeze = gc.get_freeze_count() == 0
        _holders += 1
        gc.collect()  # garbage frozen now would never be reclaimed
        gc.freeze()


def release_startup_heap() -> None:
    """One holder fewer; the last one unfreezes (unless the application had frozen objects first)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _owns_freeze:
            gc.unfreeze()


def holders() -> int:
    """How many started engines hold the freeze (for tests and diagnostics)."""
    return _holders
