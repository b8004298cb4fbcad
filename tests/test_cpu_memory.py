"""glibc's thresholds for the CPU engine's large step buffers (kernels/cpu_memory.py)."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from asyncllm.kernels import cpu_memory


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.parametrize("name,value", [("ASYNCLLM_MALLOC_TUNING", "0"), ("MALLOC_TRIM_THRESHOLD_", "1048576"),
                                        ("MALLOC_MMAP_THRESHOLD_", "65536"), ("MALLOC_TOP_PAD_", "0")])
def test_the_users_own_choice_is_left_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert cpu_memory.keep_large_buffers.__wrapped__() is False


@pytest.mark.skipif(not _glibc(), reason="mallopt's thresholds are glibc's")
def test_large_buffers_are_reused_instead_of_faulted_in_again(monkeypatch):
    """After the thresholds are set, a 12 MiB tensor allocated, written and freed 20 times faults in its pages about
    once, not 20 times (3,072 pages of 4 KiB each time under glibc's default mmap threshold)."""
    for name in ("ASYNCLLM_MALLOC_TUNING", *cpu_memory.USER_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    assert cpu_memory.keep_large_buffers.__wrapped__() is True
    size = 12 * 1024 * 1024 // 4
    torch.empty(size).fill_(1.0)  # the first one may grow the heap
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.empty(size).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 3 * 3072, faults
