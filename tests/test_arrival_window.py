"""The idle engine's arrival window: requests that arrive a little apart share the first prefill step.

Why it exists: requests sent together reach the engine one by one (an HTTP server parses them in turn), and the
first would otherwise start a step alone that the rest queue behind (engine/engine_thread.py). The windows here are
long (200 ms) against the requests' 1 ms spacing, so the check does not depend on the machine's speed."""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.errors import ConfigError


def _record_prefill_steps(llm: AsyncLLM) -> list[int]:
    """The prompt rows of each step that carries prompt tokens, recorded from the engine thread."""
    engine, steps = llm.engine, []
    run = engine._run

    def recorded(batch):
        prompts = sum(1 for n in batch.num_new_tokens if n > 1)
        if prompts:
            steps.append(prompts)
        return run(batch)

    engine._run = recorded
    return steps


async def _burst(llm: AsyncLLM, count: int, spacing_s: float) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def one(i: int) -> None:
        await asyncio.sleep(i * spacing_s)
        await llm.generate({"prompt_token_ids": [5 + i] * 12}, params)

    await asyncio.gather(*(one(i) for i in range(count)))


def _first_steps(model_dir, window_ms: float, count: int, spacing_s: float) -> list[int]:
    """The prompt rows of each prefill step while ``count`` requests arrive ``spacing_s`` apart."""
    async def main() -> list[int]:
        async with AsyncLLM(str(model_dir), dtype="float32", device="cpu", arrival_window_ms=window_ms) as llm:
            steps = _record_prefill_steps(llm)
            await _burst(llm, count, spacing_s)
            return steps

    return asyncio.run(main())


def test_a_burst_shares_its_first_prefill_step(llama_dir):
    assert _first_steps(llama_dir, 200, 4, 0.001) == [4]


def test_without_a_window_the_first_request_steps_alone(llama_dir):
    """The same burst, 50 ms apart and no window: the engine starts at once, so the first prompt steps alone."""
    steps = _first_steps(llama_dir, 0, 3, 0.05)
    assert steps[0] == 1 and sum(steps) == 3


def test_the_window_is_bounded(llama_dir):
    """Requests that keep coming, each within the window, do not hold the first step back past 5 windows: with a
    50 ms window and a request every 20 ms for 600 ms, the first step starts with some of them, not all 30."""
    steps = _first_steps(llama_dir, 50, 30, 0.02)
    assert 1 <= steps[0] < 30 and sum(steps) == 30


@pytest.mark.parametrize("bad", [-1, 1001, "3", True, None])
def test_a_bad_window_names_the_field(llama_dir, bad):
    with pytest.raises(ConfigError, match="arrival_window_ms"):
        AsyncLLM(str(llama_dir), dtype="float32", device="cpu", arrival_window_ms=bad)
