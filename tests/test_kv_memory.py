"""The CPU KV cache costs resident memory only for the blocks that are written."""

from __future__ import annotations

import torch

from asyncllm import LLM, SamplingParams
from asyncllm.model.runner import _zeros


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_lazily_zeroed_tensor_commits_only_written_pages():
    before = _rss_mib()
    cache = _zeros((1024, 16, 4, 64, 64), torch.float32, torch.device("cpu"))  # 1 GiB
    assert cache.shape == (1024, 16, 4, 64, 64) and cache.is_contiguous()
    assert _rss_mib() - before < 100  # torch.zeros would have committed all 1,024 MiB
    cache[:16] = 1.0  # 16 MiB written
    assert 10 < _rss_mib() - before < 120
    assert not bool(cache[16:32].any()) and float(cache[:16].sum()) == 16 * 16 * 4 * 64 * 64
    assert _zeros((3, 5), torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError("no mapping holds the address")


def test_kv_mapping_does_not_ask_for_huge_pages():
    # a fresh 2 MiB page per layer's K and V on one step stalled every stream for 100+ ms (runner._zeros)
    cache = _zeros((64, 16, 4, 64, 64), torch.float32, torch.device("cpu"))
    flags = _vm_flags(cache.data_ptr())
    assert "hg" not in flags and "sh" not in flags  # not huge-page advised; private, not shared memory


def test_engine_kv_cache_starts_zeroed(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    k_cache, v_cache = llm.engine.runner.kv_caches[-1]
    assert not bool(k_cache.any()) and not bool(v_cache.any())
    out = llm.generate([[3, 4, 5, 6] * 8], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8 and bool(k_cache.any())
