"""Beam search under KV-cache pressure: beams preempted one at a time, groups never deadlock.

The issue's reproduction: 16 blocks of 16 tokens, a 100-token prompt, 8 beams of 150 new tokens.
One beam (250 tokens) fits the cache alone; the 8 together never do (up to 86 blocks). Each engine
call below is bounded in steps, so a regression fails instead of hanging.
"""

import asyncio
import random

import pytest

from asyncllm import AsyncLLM, InvalidRequestError, LLM, SamplingParams
from asyncllm.engine.kv_cache import KVCacheManager

MAX_STEPS = 5000  # the reproduction takes about 500


def _bounded(llm: LLM, limit: int = MAX_STEPS) -> list[int]:
    """Make ``llm``'s engine raise after ``limit`` steps; the returned list holds the step count."""
    count = [0]
    step = llm.engine.step

    def bounded_step():
        count[0] += 1
        if count[0] > limit:
            raise AssertionError(f"no end after {limit} engine steps: livelock")
        return step()

    llm.engine.step = bounded_step
    return count


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(length)]


def _engine(model_dir, blocks: int | None = None, **kwargs) -> LLM:
    """A float32 toy engine; ``blocks``: a KV cache of exactly that many blocks."""
    llm = LLM(str(model_dir), dtype="float32", **kwargs)
    if blocks is None:
        return llm
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=blocks * llm.engine.runner.bytes_per_block, **kwargs)


def _summary(outputs) -> list[list[tuple]]:
    return [[(c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]


def _assert_same(got, expected) -> None:
    """Same hypotheses in the same order; scores equal up to recomputation's rounding (prefill and
    decode of the same position differ in the last bits)."""
    assert _summary(got) == _summary(expected)
    for mine, theirs in zip(got, expected):
        assert [c.cumulative_logprob for c in mine.outputs] == \
            pytest.approx([c.cumulative_logprob for c in theirs.outputs], abs=1e-3)


def _assert_clean(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert llm.engine.scheduler.waiting.num_tokens == 0 and not llm.engine.has_work()


def test_issue_reproduction_finishes_equal_to_a_roomy_cache(model_dirs):
    prompt = _prompt(100, 1)
    beams = SamplingParams(n=8, use_beam_search=True, max_tokens=150, ignore_eos=True, temperature=0)
    roomy = _engine(model_dirs["llama"], max_model_len=256)
    expected = roomy.generate([prompt], beams)
    tight = _engine(model_dirs["llama"], blocks=16, max_model_len=256)
    assert tight.stats()["kv_blocks_total"] == 16  # 131,072 bytes of this toy model's KV
    steps = _bounded(tight)
    got = tight.generate([prompt], beams)
    _assert_same(got, expected)
    assert len(got[0].outputs) == 8 and all(len(c.token_ids) == 150 for c in got[0].outputs)
    assert tight.stats()["num_preemptions"] > 0 and steps[0] < MAX_STEPS
    _assert_clean(tight)
    # sampling with n=8 in the same cache (the issue's comparison) still finishes too
    _bounded(tight)
    sampled = tight.generate([prompt], SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=150, ignore_eos=True))
    assert all(len(c.token_ids) == 150 for c in sampled[0].outputs)
    _assert_clean(tight)


@pytest.mark.parametrize("block_size,caching", [(4, True), (16, False)])
def test_beam_groups_and_sampling_contending_all_finish(model_dirs, block_size, caching):
    """Three beam groups (one with a better priority), greedy streams and a seeded n=2 request in a
    cache that holds one sequence and a little: everything finishes, each output equal to a roomy run's."""
    prompts = [_prompt(20 + 7 * i, 10 + i) for i in range(6)]
    params = [
        SamplingParams(n=4, use_beam_search=True, max_tokens=30, ignore_eos=True, temperature=0),
        SamplingParams(temperature=0, max_tokens=35, ignore_eos=True),
        SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=25, temperature=0, length_penalty=0.5),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30, ignore_eos=True),
        SamplingParams(n=3, use_beam_search=True, max_tokens=28, ignore_eos=True, temperature=0),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    ]
    priorities = [0, 0, 0, 1, -1, 0]
    kwargs = dict(block_size=block_size, max_model_len=96, enable_prefix_caching=caching)
    expected = _engine(model_dirs["llama"], **kwargs).generate(prompts, params)
    tight = _engine(model_dirs["llama"], blocks=96 // block_size + 2, **kwargs)
    _bounded(tight)
    got = tight.generate(prompts, params, priority=priorities)
    _assert_same(got, expected)
    assert tight.stats()["num_preemptions"] > 0
    _assert_clean(tight)


def test_concurrent_beam_groups_under_pressure_both_finish_on_asyncllm(model_dirs):
    prompts = [_prompt(60, 21), _prompt(70, 22)]
    beams = [SamplingParams(n=4, use_beam_search=True, max_tokens=60, ignore_eos=True, temperature=0),
             SamplingParams(n=3, best_of=5, use_beam_search=True, max_tokens=50, ignore_eos=True, temperature=0)]
    expected = _engine(model_dirs["llama"], max_model_len=160).generate(prompts, beams)
    bytes_per_block = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=160).engine.runner.bytes_per_block

    async def run():
        async with AsyncLLM(str(model_dirs["llama"]), dtype="float32", max_model_len=160,
                            kv_cache_memory=12 * bytes_per_block) as llm:
            outputs = await asyncio.wait_for(  # a guard against a hang, not a timing assertion
                asyncio.gather(*(llm.generate(p, sp) for p, sp in zip(prompts, beams))), timeout=120)
            await asyncio.sleep(0.05)  # the engine thread publishes its stats after the last step
            return outputs, llm.stats(), llm.engine.scheduler.num_preemptions

    outputs, stats, preemptions = asyncio.run(run())
    _assert_same(outputs, expected)
    assert preemptions > 0 and stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_request_that_can_never_fit_is_refused_at_once(model_dirs):
    """The engine's start refuses a cache smaller than one max_model_len sequence, so a request that
    cannot fit needs a pool shrunk behind the engine's back; ``add_request`` then refuses it, naming
    the blocks, before anything is queued."""
    llm = _engine(model_dirs["llama"], max_model_len=256)
    llm.engine.kv = llm.engine.scheduler.kv = KVCacheManager(10, llm.engine.kv.block_size)
    beams = SamplingParams(n=8, use_beam_search=True, max_tokens=150, ignore_eos=True, temperature=0)
    _bounded(llm, 100)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([_prompt(100, 1)], beams)
    assert info.value.field == "max_tokens"
    message = str(info.value)
    assert "16 KV blocks of 16 tokens" in message and "has 10 blocks" in message and "8 beams" in message
    assert not llm.engine.has_work()
    (out,) = llm.generate([_prompt(100, 1)], SamplingParams(temperature=0, max_tokens=59, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 59  # 159 positions: 10 blocks are enough
    _assert_clean(llm)
