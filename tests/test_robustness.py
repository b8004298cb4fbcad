"""Hostile input and faults through the Python API: every value range checked, nothing blocks the
event loop, one request's failure stays its own, and an engine fault is survived in-process."""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError,
                             RequestTimeoutError)
from asyncllm.frontend import output_processor, tokenizing
from fault_injection import inject_faults
from asyncllm.frontend.tokenizing import LARGE_IDS, LARGE_TEXT_CHARS, decode_ids, encode_text, max_prompt_chars

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_path(model_dirs) -> str:
    return str(model_dirs["llama"])


@pytest.fixture(scope="module")
def llm(llama_path):
    return LLM(llama_path, dtype="float32", max_model_len=128, max_num_seqs=8)


def run(coro):
    return asyncio.run(coro)


# ---- the whole range of every value ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 10**6}, "top_k"),          # above the vocabulary
    ({"n": 129}, "n"),                     # above max_n (128 by default)
    ({"n": 9}, "n"),                       # above this engine's max_num_seqs (8): it could never start
    ({"n": 10**6}, "n"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"presence_penalty": float("inf")}, "presence_penalty"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"min_tokens": 200, "max_tokens": None}, "min_tokens"),
    ({"json_schema": {"$ref": "#"}}, "json_schema"),   # no JSON satisfies it
    ({"regex": "[^\\s\\S]"}, "regex"),                 # matches nothing
])
def test_out_of_range_values_are_refused_and_the_engine_goes_on(llm, kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[5, 6, 7]], SamplingParams.from_kwargs(None, kwargs))
    assert info.value.field == field and field in str(info.value)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY))
    assert len(out.outputs[0].token_ids) == 3 and llm.stats()["kv_blocks_used"] == 0


def test_max_tokens_error_names_both_numbers(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[5] * 100], SamplingParams(max_tokens=10**12))
    message = str(info.value)
    assert str(10**12) in message and "100 tokens" in message and "128" in message and "room for 28" in message


def test_seeds_at_the_ends_of_the_64_bit_range_work(llm):
    for seed in (2**64 - 1, -(2**63), 0):
        a, b = (llm.generate([[5, 6]], SamplingParams(max_tokens=4, seed=seed, ignore_eos=True))[0] for _ in "ab")
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # seeded: reproducible


def test_top_k_up_to_the_vocabulary_and_tiny_temperatures_are_greedy(llm):
    vocab = llm.engine.vocab_size
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0].token_ids
    for temperature in (1e-40, 1e-7):
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=temperature, top_k=vocab,
                                                       ignore_eos=True))[0]
        assert out.outputs[0].token_ids == greedy
    mixed = llm.generate([[5, 6, 7], [5, 6, 7]], [SamplingParams(max_tokens=6, temperature=1e-40, ignore_eos=True),
                                                  SamplingParams(max_tokens=6, temperature=0.8, seed=1,
                                                                 ignore_eos=True)])
    assert mixed[0].outputs[0].token_ids == greedy  # a tiny temperature beside a sampled row: no NaN


@pytest.mark.parametrize("messages, fragment", [
    ([{"role": 5, "content": "hi"}], "messages[0].role"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": 7}], "messages[0].content"),
    ([{"role": "assistant", "content": "", "tool_calls": "x"}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": "", "tool_calls": [5]}], "messages[0].tool_calls[0]"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name"),
    ([{"role": "user", "content": "hi \ud800 there"}], "messages[0].content"),
    ([{"role": "user", "content": "ok"}, "not a message"], "messages"),
])
def test_chat_messages_are_validated_as_over_http(llm, messages, fragment):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([messages], SamplingParams(max_tokens=2))
    assert info.value.field in ("messages", "prompt") and fragment in str(info.value)


def test_lone_surrogate_text_prompt_is_an_invalid_request(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["abc \udc80 def"], SamplingParams(max_tokens=2))
    assert info.value.field == "prompt" and "surrogate" in str(info.value)


def test_text_that_cannot_fit_is_refused_before_tokenizing(llm):
    limit = max_prompt_chars(llm.tokenizer, llm.max_model_len)
    assert limit is not None and limit < 100_000
    calls = []
    real = llm.tokenizer.encode
    llm.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with pytest.raises(InvalidRequestError, match="cannot fit in max_model_len"):
            llm.generate(["word " * 1_000_000], SamplingParams(max_tokens=2))
    finally:
        del llm.tokenizer.encode
    assert calls == []


def test_large_inputs_encode_and_decode_as_the_tokenizer_does(llm, monkeypatch):
    tok = llm.tokenizer
    text = ("Hello <|im_start|> wörld, the cat 猫 sat. " * 600)[:LARGE_TEXT_CHARS * 2]
    for special in (True, False):
        assert encode_text(tok, text, add_special_tokens=special) == tok.encode(text, add_special_tokens=special)
    monkeypatch.setattr(tokenizing, "IDS_PIECE", 1000)  # long results are converted piece by piece
    expected = tok.encode(text)
    assert len(expected) > 3000 and encode_text(tok, text) == expected
    with pytest.raises(tokenizing.TooManyTokens) as info:  # counted, never turned into a list
        encode_text(tok, text, max_tokens=len(expected) - 1)
    assert info.value.count == len(expected)
    ids = tok.encode(text) * 2
    assert len(ids) > LARGE_IDS
    assert decode_ids(tok, ids) == tok.decode(ids)
    assert decode_ids(tok, ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


# ---- the scheduler's bounds ----------------------------------------------------------------------

def test_running_set_never_exceeds_max_num_seqs(llama_path):
    llm = LLM(llama_path, dtype="float32", max_num_seqs=4, max_model_len=64)
    engine = llm.engine
    seen = []
    real_schedule = engine.scheduler.schedule

    def schedule():
        batch = real_schedule()
        seen.append(len(engine.scheduler.running))
        return batch

    engine.scheduler.schedule = schedule
    outs = llm.generate([[5, 6, 7]] * 3, [SamplingParams(n=4, max_tokens=5, **GREEDY),
                                          SamplingParams(n=3, max_tokens=5, **GREEDY),
                                          SamplingParams(n=1, max_tokens=5, **GREEDY)])
    assert max(seen) <= 4 and max(seen) >= 3, seen
    assert [len(o.outputs) for o in outs] == [4, 3, 1]
    assert all(len(c.token_ids) == 5 for o in outs for c in o.outputs)
    assert engine.stats()["kv_blocks_used"] == 0 and not engine._sequences


def test_many_children_finish_and_leave_nothing(llama_path):
    llm = LLM(llama_path, dtype="float32", max_num_seqs=128, max_model_len=64)
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(n=128, max_tokens=3, temperature=1.0, seed=3, ignore_eos=True))
    assert len(out.outputs) == 128 and all(len(c.token_ids) == 3 for c in out.outputs)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0 and not llm.engine._sequences


def test_abort_before_the_fork_ends_every_child(llama_path):
    async def main():
        async with AsyncLLM(llama_path, dtype="float32", max_num_batched_tokens=16) as llm:
            outs = []

            async def consume():
                async for out in llm.stream_outputs([5] * 200, n=4, max_tokens=4, request_id="forky"):
                    outs.append(out)

            task = asyncio.create_task(consume())
            await asyncio.sleep(0)  # submitted; its 200-token prompt needs many 16-token steps
            await llm.abort("forky")
            await asyncio.wait_for(task, 10)
            finished = {c.index: c.finish_reason for o in outs for c in o.outputs if c.finish_reason}
            assert finished == {0: "abort", 1: "abort", 2: "abort", 3: "abort"}
            await _wait_idle(llm)

    run(main())


# ---- the event loop is never the one doing heavy work --------------------------------------------

def test_heavy_inputs_are_processed_off_the_event_loop(model_dir_factory):
    path = str(model_dir_factory("llama", max_position_embeddings=4096))

    async def main():
        async with AsyncLLM(path, dtype="float32") as llm:
            threads = []
            real = llm.inputs.process

            def spy(*args, **kwargs):
                threads.append(threading.current_thread().name)
                return real(*args, **kwargs)

            llm.inputs.process = spy
            await llm.generate("Hello", max_tokens=1)                                   # small: inline
            await llm.generate("Hello " * 700, max_tokens=1)                            # large text (4200 chars)
            await llm.generate([{"role": "user", "content": "Hi"}], max_tokens=1)       # chat template
            await llm.generate("Hello", max_tokens=1, json_schema={"type": "object"})   # grammar
            assert threads[0] == threading.current_thread().name
            assert all(name.startswith("asyncllm-input") for name in threads[1:4]), threads

    run(main())


def test_event_loop_keeps_running_while_a_huge_chat_message_is_processed(model_dir_factory):
    path = model_dir_factory("llama", max_position_embeddings=1 << 20)  # no length bound cuts the message short

    async def main():
        async with AsyncLLM(str(path), dtype="float32", max_model_len=100_000, kv_cache_memory=1 << 26) as llm:
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.001)
                    ticks += 1

            tick = asyncio.create_task(ticker())
            message = [{"role": "user", "content": "the cat sat on the mat " * 20_000}]  # 460 kB
            with pytest.raises(InvalidRequestError, match="max_model_len"):  # ~140k tokens: rendered, tokenized, refused
                await llm.generate(message, max_tokens=1)
            tick.cancel()
            assert ticks > 20  # the loop went on ticking while the message was rendered and tokenized

    run(main())


# ---- one request's failure is its own --------------------------------------------------------------

def test_a_failure_in_one_requests_output_processing_ends_only_that_request(llama_path, monkeypatch):
    real_apply = output_processor.OutputProcessor._apply

    def faulty_apply(self, state, seq, out, now):
        if state.request_id == "victim" and len(seq.completion.token_ids) >= 2:
            raise ValueError("injected front fault")
        return real_apply(self, state, seq, out, now)

    monkeypatch.setattr(output_processor.OutputProcessor, "_apply", faulty_apply)

    async def main():
        async with AsyncLLM(llama_path, dtype="float32") as llm:
            async def consume(rid):
                return await llm.generate([5, 6, 7], max_tokens=12, request_id=rid, **GREEDY)

            results = await asyncio.wait_for(asyncio.gather(
                consume("a"), consume("victim"), consume("b"), return_exceptions=True), 20)
            assert isinstance(results[1], RequestFailedError) and "victim" in str(results[1])
            assert [len(r.outputs[0].token_ids) for r in (results[0], results[2])] == [12, 12]
            await _wait_idle(llm)
            await llm.check_health()  # the engine itself was never in trouble

    run(main())


# ---- engine faults: every stream told, counters true, the engine back in the same process ----------

async def _wait_idle(llm: AsyncLLM, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        stats = llm.stats()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine still busy: {llm.stats()}")


def test_engine_fault_fails_streams_resets_counters_and_serves_again(llama_path):
    async def main():
        async with AsyncLLM(llama_path, dtype="float32") as llm:
            inject_faults(llm, after_calls=5, times=1)

            async def consume(i):
                async for _ in llm.stream([5 + i, 6], max_tokens=100, **GREEDY):
                    pass

            results = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(6)),
                                                            return_exceptions=True), 10)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "injected engine fault" in str(results[0])
            stats = llm.stats()
            assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0 and stats["num_waiting"] == 0
            out = await llm.generate([5, 6], max_tokens=4, **GREEDY)  # the same AsyncLLM, no new one
            assert len(out.outputs[0].token_ids) == 4 and llm.num_restarts == 1
            await llm.check_health()

    run(main())


def test_restarts_are_bounded_and_restart_brings_the_engine_back(llama_path):
    async def main():
        async with AsyncLLM(llama_path, dtype="float32", max_restarts=2, restart_window_s=60) as llm:
            faults = inject_faults(llm, after_calls=0, times=10**9)  # every step fails
            for _ in range(3):
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(llm.generate([5, 6], max_tokens=2), 10)
            assert llm.num_restarts == 2
            with pytest.raises(EngineDeadError, match="not restarting"):  # the third fault was one too many
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                await llm.generate([5, 6], max_tokens=2)
            assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0
            faults["left"] = 0  # the cause is gone: restart() by hand
            await llm.restart()
            out = await llm.generate([5, 6], max_tokens=3, **GREEDY)
            assert len(out.outputs[0].token_ids) == 3
            await llm.check_health()

    run(main())


def test_restart_on_a_healthy_engine_ends_open_streams(llama_path):
    async def main():
        async with AsyncLLM(llama_path, dtype="float32", max_model_len=512) as llm:
            got_first = asyncio.Event()

            async def long_stream():
                async for _ in llm.stream([5, 6], max_tokens=400, **GREEDY):
                    got_first.set()

            task = asyncio.create_task(long_stream())
            await asyncio.wait_for(got_first.wait(), 10)
            await llm.restart()
            with pytest.raises(EngineDeadError, match="restarted"):
                await asyncio.wait_for(task, 10)
            assert llm.stats()["kv_blocks_used"] == 0
            assert len((await llm.generate([5, 6], max_tokens=2, **GREEDY)).outputs[0].token_ids) == 2
        with pytest.raises(EngineDeadError, match="closed"):
            await llm.restart()

    run(main())


# ---- backpressure and deadlines ----------------------------------------------------------------------

def test_waiting_queue_is_bounded(llama_path):
    async def main():
        async with AsyncLLM(llama_path, dtype="float32", max_num_seqs=1, max_waiting_requests=2,
                            max_model_len=512) as llm:
            first = asyncio.Event()

            async def long(rid):
                async for _ in llm.stream([5, 6], max_tokens=500, request_id=rid, **GREEDY):
                    first.set()

            running = asyncio.create_task(long("running"))
            await asyncio.wait_for(first.wait(), 10)
            waiting = [asyncio.create_task(long(f"w{i}")) for i in range(2)]

            async def queued():  # both wait behind the running one (its seat is the only one)
                while llm.stats()["num_waiting"] < 2:
                    await asyncio.sleep(0.001)

            await asyncio.wait_for(queued(), 10)
            with pytest.raises(EngineOverloadedError, match="max_waiting_requests"):
                await llm.generate([5, 6], max_tokens=2)
            for task in (running, *waiting):
                task.cancel()
            await asyncio.gather(running, *waiting, return_exceptions=True)
            await _wait_idle(llm)
            assert len((await llm.generate([5, 6], max_tokens=2, **GREEDY)).outputs[0].token_ids) == 2

    run(main())


def test_timeout_aborts_and_frees_blocks(model_dir_factory):
    # a request far longer than the timeout on any machine: the tiny model decodes 4,000 tokens in under a
    # second on the AVX-512 VM, so 60,000 at a 0.5 s timeout (a few thousand tokens per second at most:
    # every step is a round trip through the engine thread)
    path = str(model_dir_factory("llama", max_position_embeddings=1 << 20))

    async def main():
        async with AsyncLLM(path, dtype="float32", max_model_len=65_536, kv_cache_memory=1 << 26) as llm:
            received = 0
            with pytest.raises(RequestTimeoutError, match="timeout"):
                async for _ in llm.stream([5, 6], max_tokens=60_000, timeout=0.5, **GREEDY):
                    received += 1
            assert received > 0
            await _wait_idle(llm)
            for bad in (0, -1, float("nan"), "1"):
                with pytest.raises(InvalidRequestError, match="timeout"):
                    await llm.generate([5, 6], max_tokens=2, timeout=bad)
            assert (await llm.generate([5, 6], max_tokens=2, timeout=30, **GREEDY)).finished

    run(main())


def test_sync_llm_survives_an_engine_fault(llama_path):
    llm = LLM(llama_path, dtype="float32")
    inject_faults(llm, after_calls=2, times=1)
    with pytest.raises(EngineDeadError, match="injected engine fault"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=10, **GREEDY))
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0
    outs = llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=10, **GREEDY))
    assert [len(o.outputs[0].token_ids) for o in outs] == [10, 10]
