"""Handing the GIL over during long Python loops that run beside the host's event loop.

Measured on Python 3.11: a worker thread building thousands of small objects (an answer's choices, a
prompt's logprobs) often kept the GIL through its whole run, 45-127 ms, while the host's loop waited to
wake up; the interpreter's own switch interval did not hand it over. ``time.sleep(0)`` releases it, and
a waiting thread takes it.
"""

from __future__ import annotations

import time

HANDOVER_EVERY_S = 0.002


class GILHandover:
    """Call once per item of a long loop: every ``every_s`` seconds of work it lets other threads run."""

    __slots__ = ("every_s", "_since")

    def __init__(self, every_s: float = HANDOVER_EVERY_S) -> None:
        self.every_s = every_s
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since > self.every_s:
            time.sleep(0)
            self._since = time.perf_counter()
