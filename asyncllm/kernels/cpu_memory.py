"""Keep a CPU engine's large per-step buffers in the heap instead of fresh memory mappings (glibc).

A prefill chunk of 2,048 tokens allocates tensors of several MiB per layer: SmolLM2's gate_up output is 12 MiB in
bf16. glibc serves allocations over its mmap threshold with a fresh mapping and unmaps it on free, so every such
tensor faults in (and the kernel zeroes) each of its 4 KiB pages again, on every layer of every step. glibc's
dynamic threshold is meant to stop this, but it only rises to the size of a freed mapped chunk, and the
engine thread's mix of sizes keeps it below the largest ones. On the AMX Xeon VM a 32 x 128-token bf16 prefill
spent 7.2 ms per layer in gate_up's matmul against 2.9 ms for the same call over reused memory, and took 1.05 s
against 0.79 s in all (docs/cpu.md, "Heap buffers").

:func:`keep_large_buffers` fixes the thresholds once per process with ``mallopt``: chunks up to 32 MiB (glibc's
largest mmap threshold) come from the heap and are reused, and up to 256 MiB of free memory at the heap's top stays
with the process rather than being handed back and faulted in again. The cost is that the process keeps the
engine's peak transient memory (bounded by the token budget) after a step. Nothing is changed where the user has
already chosen (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` / ``MALLOC_TOP_PAD_`` set, or
``ASYNCLLM_MALLOC_TUNING=0``), off Linux, or where the C library has no ``mallopt`` (an allocator preloaded in
its place, such as tcmalloc or jemalloc, manages its own memory and ignores glibc's settings).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 * 1024 * 1024            # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 * 1024 * 1024
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def keep_large_buffers() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); True where they were set."""
    if os.environ.get("ASYNCLLM_MALLOC_TUNING", "1") == "0" or any(name in os.environ for name in USER_SETTINGS):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl's is a stub that returns 0
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
