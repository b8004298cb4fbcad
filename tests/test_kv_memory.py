"""The CPU KV cache costs resident memory only for the blocks that are written."""

from __future__ import annotations

import torch

from asyncllm import LLM, SamplingParams


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


def test_cpu_kv_cache_is_zero_and_lazily_committed(model_dirs):
    before = _rss_mib()
    llm = LLM(str(model_dirs["llama"]), dtype="float32", kv_cache_memory=1 << 30)
    runner = llm.engine.runner
    cache_mib = runner.num_blocks * runner.bytes_per_block // 2**20
    assert cache_mib > 900
    assert _rss_mib() - before < 300  # a zero-filled 1 GiB cache would add all of it
    k_cache, v_cache = runner.kv_caches[-1]
    assert k_cache.dtype == torch.float32 and not bool(k_cache[-8:].any()) and not bool(v_cache[:8].any())
    out = llm.generate([[3, 4, 5, 6] * 8], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
