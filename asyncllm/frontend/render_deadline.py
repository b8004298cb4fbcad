"""A deadline for code compiled from one file name (a template), in the calling thread only.

``sys.settrace`` installs a tracer for this thread alone, for the duration of the block: the global
tracer sees each new frame and gives a line tracer only to frames whose code comes from
``filename``, so the rest of the work (jinja's runtime, filters) runs untraced and the cost stays a
call per frame. A line of that code executed past the deadline raises the given error there, which
ends the render and frees the thread; the tracer that was installed before (a debugger, coverage)
is put back afterwards.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator


@contextmanager
def deadline(seconds: float, filename: str, error: Callable[[], BaseException]) -> Iterator[None]:
    """Raise ``error()`` from the first line of ``filename``'s code run ``seconds`` from now."""
    end = time.monotonic() + seconds
    clock = time.monotonic

    def line_tracer(frame, event, arg):
        if event == "line" and clock() > end:
            raise error()  # Python unsets this thread's tracer here; the block's exit restores the old one
        return line_tracer

    def frame_tracer(frame, event, arg):
        return line_tracer if frame.f_code.co_filename == filename else None

    previous = sys.gettrace()
    sys.settrace(frame_tracer)
    try:
        yield
    finally:
        sys.settrace(previous)
