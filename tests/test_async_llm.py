"""AsyncLLM: concurrent streams equal LLM.generate, early exits free everything, faults reach streams."""

import asyncio
import random
import threading
import time

import pytest

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.errors import EngineDeadError, InvalidRequestError


@pytest.fixture(scope="module")
def llama_path(model_dirs):
    return str(model_dirs["llama"])


@pytest.fixture(scope="module")
def async_llm(llama_path):
    llm = AsyncLLM(llama_path, dtype="float32", block_size=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def sync_llm(llama_path):
    return LLM(llama_path, dtype="float32", block_size=4)


def _workload(count: int, seed: int):
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(count):
        prompts.append([rng.randrange(5, 1000) for _ in range(rng.randrange(1, 40))])
        sampled = i % 3 == 0
        params.append(SamplingParams(temperature=0.8 if sampled else 0, seed=i if sampled else None,
                                     max_tokens=rng.randrange(1, 30), ignore_eos=True))
    return prompts, params


async def _collect(llm: AsyncLLM, prompt, params):
    tokens, text = [], ""
    async for delta in llm.stream_outputs(prompt, params):
        tokens += delta.outputs[0].token_ids
        text += delta.outputs[0].text
    return tokens, text


async def _wait_idle(llm: AsyncLLM, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = llm.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        await asyncio.sleep(0.01)
    return llm.stats()


def test_64_concurrent_streams_equal_generate(async_llm, sync_llm):
    prompts, params = _workload(64, 1)
    expected = sync_llm.generate(prompts, params)

    async def main():
        return await asyncio.gather(*(_collect(async_llm, p, sp) for p, sp in zip(prompts, params)))

    got = asyncio.run(main())
    for (tokens, text), want in zip(got, expected):
        assert tokens == want.outputs[0].token_ids
        assert text == want.outputs[0].text


def test_200_streams_with_early_exits_leave_nothing_behind(async_llm):
    prompts, params = _workload(200, 2)
    rng = random.Random(3)
    modes = [rng.choice(["break", "raise", "timeout"]) if rng.random() < 1 / 3 else "full" for _ in prompts]

    class Leave(Exception):
        pass

    async def consume(prompt, sp, mode):
        sp = SamplingParams.from_kwargs(sp, {"max_tokens": 30})
        count = 0
        try:
            if mode == "timeout":
                async def slow():
                    async for _ in async_llm.stream_outputs(prompt, sp):
                        await asyncio.sleep(0.05)
                await asyncio.wait_for(slow(), timeout=0.02)
            async for _ in async_llm.stream_outputs(prompt, sp):
                count += 1
                if mode == "break" and count == 2:
                    break
                if mode == "raise" and count == 2:
                    raise Leave()
        except (Leave, asyncio.TimeoutError):
            return mode
        return "done"

    async def main():
        results = await asyncio.wait_for(
            asyncio.gather(*(consume(p, sp, m) for p, sp, m in zip(prompts, params, modes))), timeout=120)
        return results, await _wait_idle(async_llm)

    results, stats = asyncio.run(main())
    assert len(results) == 200
    assert sum(r != "done" for r in results) > 40
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0


def test_two_event_loops_in_two_threads(async_llm, sync_llm):
    prompts, params = _workload(16, 4)
    expected = [o.outputs[0].token_ids for o in sync_llm.generate(prompts, params)]
    results: dict[int, list] = {}
    errors = []

    def worker(part: int):
        async def main():
            idx = range(part, 16, 2)
            got = await asyncio.gather(*(_collect(async_llm, prompts[i], params[i]) for i in idx))
            return dict(zip(idx, (tokens for tokens, _ in got)))

        try:
            results.update(asyncio.run(main()))
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(part,)) for part in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert [results[i] for i in range(16)] == expected


def test_stop_string_across_tokens_is_never_shown(async_llm, sync_llm):
    prompt = "The quick brown fox"
    free = sync_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    cut = len(sync_llm.tokenizer.decode(free.token_ids[:6]))
    stop = sync_llm.tokenizer.decode(free.token_ids[:9])[cut:]
    assert len(stop) >= 3

    async def main():
        pieces = []
        async for piece in async_llm.stream(prompt, temperature=0, max_tokens=40, ignore_eos=True, stop=stop):
            pieces.append(piece)
        final = await async_llm.generate(prompt, temperature=0, max_tokens=40, ignore_eos=True, stop=stop)
        return pieces, final

    pieces, final = asyncio.run(main())
    assert "".join(pieces) == final.outputs[0].text == free.text[:free.text.find(stop)]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == stop
    shown = ""
    for piece in pieces:  # no prefix of the stream ever contained text past the stop point
        shown += piece
        assert free.text.startswith(shown) and len(shown) <= free.text.find(stop)


def test_multibyte_characters_stream_whole(async_llm):
    from asyncllm.engine.core import SequenceOutput
    from asyncllm.frontend.output_processor import OutputProcessor

    text = "naïve 日本語 🙂 𝄞∮Ж ok"
    ids = async_llm.tokenizer.encode(text)
    processor = OutputProcessor(async_llm.tokenizer, lambda *a: None)
    from asyncllm.engine.request import EngineRequest

    state = processor.add(EngineRequest("r", [5], SamplingParams(max_tokens=len(ids)), len(ids)), None)
    pieces = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        processor.process([SequenceOutput("r", 0, [token], [0.0], finish_reason="length" if last else None)])
        pieces.append(state.take_delta().outputs[0].text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # some character did arrive split across tokens


def test_slow_consumer_still_gets_the_last_delta(async_llm, sync_llm):
    """A request that finishes while its consumer is busy hands out its last tokens and finish_reason."""
    prompt = [5, 6, 7]
    want = sync_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]

    async def main():
        tokens, reasons = [], []
        async for delta in async_llm.stream_outputs(prompt, temperature=0, max_tokens=6, ignore_eos=True):
            tokens += delta.outputs[0].token_ids
            reasons.append(delta.outputs[0].finish_reason)
            await asyncio.sleep(0.3)  # meanwhile the engine finishes the request
        return tokens, reasons

    tokens, reasons = asyncio.run(main())
    assert tokens == want.token_ids
    assert reasons[-1] == "length" and reasons.count("length") == 1  # (a slow machine may merge all into one delta)


def test_abort_and_cancel(async_llm):
    async def main():
        stream = async_llm.stream_outputs([5, 6, 7], temperature=1.0, n=3, max_tokens=200, ignore_eos=True,
                                          request_id="to-abort")
        first = await stream.__anext__()
        await async_llm.abort("to-abort")
        finals = [c for c in first.outputs if c.finish_reason]
        async for delta in stream:
            finals += [c for c in delta.outputs if c.finish_reason]
        assert sorted(c.index for c in finals) == [0, 1, 2]
        assert all(c.finish_reason == "abort" for c in finals)

        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.stream([8, 9], max_tokens=500, ignore_eos=True):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 10)  # then cancel at once: far from its 500th token
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _wait_idle(async_llm)

    stats = asyncio.run(main())
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_bad_requests_raise_before_streaming(async_llm):
    async def main():
        with pytest.raises(InvalidRequestError) as info:
            async for _ in async_llm.stream("hi", temperature=-1):
                pass
        assert info.value.field == "temperature"
        with pytest.raises(InvalidRequestError):
            async for _ in async_llm.stream("hi", n=2):
                pass
        out = await async_llm.generate([{"role": "user", "content": "Hello"}], max_tokens=4, temperature=0)
        assert "<|im_start|>assistant" in out.prompt and len(out.outputs[0].token_ids) <= 4

    asyncio.run(main())
    assert set(async_llm.stats()) >= {"num_running", "num_waiting", "kv_blocks_total", "kv_blocks_used",
                                      "num_preemptions"}


def test_engine_fault_reaches_every_stream(llama_path):
    llm = AsyncLLM(llama_path, dtype="float32", auto_restart=False)  # restarts: tests/test_robustness.py
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}

    def failing_execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 5:
            raise RuntimeError("injected fault")
        return real_execute(*args, **kwargs)

    llm.engine.runner.execute = failing_execute

    async def main():
        async def consume(i):
            async for _ in llm.stream([5 + i, 6], max_tokens=100, ignore_eos=True):
                pass

        started = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(6)), return_exceptions=True), 5)
        assert time.monotonic() - started < 5
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "injected fault" in str(results[0])
        with pytest.raises(EngineDeadError, match="auto_restart is off"):  # dead: refuses new work
            await llm.generate([5, 6], max_tokens=3)
        assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0  # the truth, not the past
        await asyncio.wait_for(llm.aclose(), 5)
        await llm.aclose()  # idempotent

    asyncio.run(main())


def test_aclose_finishes_open_streams_and_refuses_new_ones(llama_path):
    async def main():
        llm = AsyncLLM(llama_path, dtype="float32")
        reasons = []

        started = asyncio.Event()

        async def consume():
            async for delta in llm.stream_outputs([5, 6], max_tokens=400, ignore_eos=True):
                started.set()
                if delta.outputs[0].finish_reason:
                    reasons.append(delta.outputs[0].finish_reason)

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 10)  # then close at once: far from its 400th token
        await asyncio.wait_for(llm.aclose(), 5)
        await asyncio.wait_for(task, 5)
        assert reasons == ["abort"]
        with pytest.raises(EngineDeadError, match="closed"):
            await llm.generate([5], max_tokens=2)

    asyncio.run(main())


def test_request_id_reused_right_after_a_stop_string(async_llm, sync_llm):
    prompt = "The quick brown fox"
    free = sync_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = sync_llm.tokenizer.decode(free.token_ids[:4])[-2:]

    async def main():
        outs = []
        for _ in range(3):  # the engine may still hold the stopped sequence when the id comes back
            outs.append(await async_llm.generate(prompt, request_id="same-id", temperature=0, max_tokens=30,
                                                 ignore_eos=True, stop=stop))
        dup = async_llm.stream(prompt, request_id="live-id", max_tokens=50, ignore_eos=True)
        await dup.__anext__()
        with pytest.raises(InvalidRequestError, match="already running"):
            await async_llm.generate(prompt, request_id="live-id", max_tokens=2)
        await dup.aclose()
        return outs, await _wait_idle(async_llm)

    outs, stats = asyncio.run(main())
    assert all(o.outputs[0].finish_reason == "stop" and o.outputs[0].text == outs[0].outputs[0].text for o in outs)
    assert stats["kv_blocks_used"] == 0
