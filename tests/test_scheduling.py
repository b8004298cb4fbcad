"""Prefix caching, preemption under a tiny KV cache, seeds and n > 1 block sharing."""

import random

from asyncllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(length + rng.randrange(0, 7))] for _ in range(n)]


def test_shared_prefix_hits_cache_second_time(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    prefix = _prompts(1, 40, 1)[0][:40]
    prompts = [prefix + suffix for suffix in _prompts(6, 3, 2)]
    first = llm.generate(prompts, GREEDY)
    hits_after_first = llm.stats()["prefix_cache_hits"]
    second = llm.generate(prompts, GREEDY)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] - hits_after_first >= len(prompts) * 40  # every prompt reuses the prefix
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(o.metrics.num_cached_tokens >= 40 for o in second)
    assert stats["kv_blocks_used"] == 0

    uncached = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in uncached.generate(prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in first]
    assert uncached.stats()["prefix_cache_hits"] == 0


def test_preemption_with_tiny_kv_cache_gives_identical_output(model_dirs):
    prompts = _prompts(8, 10, 3)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    bytes_per_block = roomy.engine.runner.bytes_per_block
    tight = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, max_model_len=64,
                kv_cache_memory=20 * bytes_per_block)
    assert tight.stats()["kv_blocks_total"] == 20  # 8 requests need ~80 blocks at once
    outputs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_seeded_request_is_independent_of_its_batch(model_dirs):
    llm = LLM(str(model_dirs["qwen2"]), dtype="float32")
    prompt = _prompts(1, 12, 4)[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    (alone,) = llm.generate([prompt], seeded)
    others = _prompts(16, 8, 5)
    other_params = [SamplingParams(temperature=1.0, seed=None if i % 2 else i, max_tokens=10 + i, ignore_eos=True)
                    for i in range(16)]
    outputs = llm.generate(others[:8] + [prompt] + others[8:], other_params[:8] + [seeded] + other_params[8:])
    assert outputs[8].outputs[0].token_ids == alone.outputs[0].token_ids
    (again,) = llm.generate([prompt], seeded)
    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone.outputs[0].token_ids


def _peak_blocks(llm: LLM, prompts, params) -> int:
    peak = 0
    step = llm.engine.step

    def recording_step():
        nonlocal peak
        outputs = step()
        peak = max(peak, llm.stats()["kv_blocks_used"])
        return outputs

    llm.engine.step = recording_step
    try:
        llm.generate(prompts, params)
    finally:
        llm.engine.step = step
    return peak


def test_n4_uses_fewer_blocks_than_four_prompts(model_dirs):
    prompt = _prompts(1, 37, 6)[0][:37]
    kwargs = dict(dtype="float32", block_size=4, enable_prefix_caching=False)
    llm = LLM(str(model_dirs["llama"]), **kwargs)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    forked = _peak_blocks(llm, [prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    separate = _peak_blocks(llm, [prompt] * 4, sampled)
    assert forked < separate
    (out,) = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the children really sample apart
    assert llm.stats()["kv_blocks_used"] == 0
