"""The stall-free policy (engine/step_time.py, engine/step_budget.py, engine/scheduler.py) and request priority:
the step-time model learns what it is shown, prefill chunks are sized to the target with decodes first, the head of
the queue always advances, greedy output is unchanged, and lower priorities run first (preempting when needed)."""

from __future__ import annotations

import asyncio
import math
import random

import numpy as np
import pytest

from asyncllm import AsyncLLM, LLM, SamplingParams
from asyncllm.engine.kv_cache import KVCacheManager
from asyncllm.engine.request import EngineRequest, Sequence, SequenceStatus
from asyncllm.engine.scheduler import Scheduler
from asyncllm.engine.step_budget import AUTO_ITL_FACTOR, MIN_PREFILL_TOKENS, PrefillAllowance, StepBudget
from asyncllm.kernels.cpu_decode_stack import StackLimits
from asyncllm.engine.step_time import (
    StepFeatures, StepTimeModel, _nonnegative_lstsq, calibration_steps, eager_pass, prefill_pairs,
)
from asyncllm.errors import ConfigError, InvalidRequestError

from checkpoints import reference_greedy

# 2 ms per step, 50 us per token, 10 ns per decode context position, 1 ns per prefill query-key pair, no eager pass
TRUE = np.array([2e-3, 50e-6, 10e-9, 1e-9, 0.0])


def _synthetic_model() -> StepTimeModel:
    return StepTimeModel(TRUE.copy())


def _seq(request_id: str, prompt_len: int, priority: int = 0, max_tokens: int = 64) -> Sequence:
    request = EngineRequest(request_id, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                            max_tokens, priority=priority)
    return Sequence(request, 0, None)


def _decoding(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Run the prompts of ``seqs`` through the scheduler's books in one step and give each a sampled
    token: they decode from the next step on."""
    for seq in seqs:
        scheduler.add(seq)
    saved, scheduler.max_num_batched_tokens = scheduler.max_num_batched_tokens, 1 << 20
    saved_budget, scheduler.step_budget = scheduler.step_budget, None
    batch = scheduler.schedule()
    scheduler.max_num_batched_tokens, scheduler.step_budget = saved, saved_budget
    assert set(batch.seqs) == set(seqs)
    _advance(batch)


def _advance(batch) -> None:
    """What the engine does after a step: count the computed tokens; sample for those that are done."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


# ---- the step-time model ------------------------------------------------------------------------------------------

def test_model_learns_coefficients_from_observed_steps():
    rng = random.Random(0)
    model = StepTimeModel(np.array([1e-3, 1e-6, 0.0, 0.0]))  # a poor prior
    for _ in range(400):
        decodes = rng.randint(0, 64)
        context = sum(rng.randint(1, 800) for _ in range(decodes))
        chunk = rng.choice([0, 0, rng.randint(2, 512)])
        done = rng.randint(0, 512)
        features = StepFeatures(decodes + chunk, context, prefill_pairs(done, chunk) if chunk else 0.0)
        seconds = float(features.vector() @ TRUE) * rng.uniform(0.97, 1.03)
        if features.tokens:
            model.observe(features, seconds)
    assert model.coefficients[:3] == pytest.approx(TRUE[:3], rel=0.15)
    assert TRUE[3] / 2 < model.coefficients[3] < 2 * TRUE[3]  # a small share of any step: noisier
    probe = StepFeatures(300, 20_000, prefill_pairs(100, 236))
    assert model.predict(probe) == pytest.approx(float(probe.vector() @ TRUE), rel=0.03)


def test_calibration_points_are_kept_as_the_prior():
    model = StepTimeModel()
    assert not model.calibrated
    points = [(StepFeatures(1, 1), 2.05e-3), (StepFeatures(4, 4), 2.2e-3), (StepFeatures(1, 257), 2.06e-3),
              (StepFeatures(32, 0, prefill_pairs(0, 32)), 3.6e-3), (StepFeatures(128, 0, prefill_pairs(0, 128)),
                                                                    8.4e-3 + 8.3e-6)]
    model.calibrate_with(points)
    assert model.calibrated and np.all(model.coefficients >= 0)
    for features, seconds in points:
        assert model.predict(features) == pytest.approx(seconds, rel=0.1)


def test_nonnegative_least_squares():
    a = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 0.0], [1.0, 3.0, 0.0], [1.0, 4.0, 0.0]])
    b = np.array([3.0, 2.0, 1.0, 0.5])  # a falling line: the slope would be negative
    coef = _nonnegative_lstsq(a, b)
    assert np.all(coef >= 0) and coef[1] == 0 and coef[2] == 0
    assert coef[0] == pytest.approx(b.mean())


def test_prefill_tokens_within_inverts_prefill_seconds():
    model = _synthetic_model()
    for context in (0, 100, 5000):
        for seconds in (1e-4, 5e-3, 0.05, 0.4):
            k = model.prefill_tokens_within(seconds, context)
            assert model.prefill_seconds(context, k) <= seconds + 1e-12
            assert model.prefill_seconds(context, k + 1) > seconds
    assert model.prefill_tokens_within(0.0, 0) == 0


def test_calibration_steps_fit_any_engine():
    for budget, blocks, block_size, seqs, max_len in [(2048, 1000, 16, 256, 2048), (8, 3, 4, 1, 12),
                                                      (64, 2, 16, 8, 20)]:
        for starts, lengths in calibration_steps(budget, blocks, block_size, seqs, max_len):
            assert sum(lengths) <= max(budget, len(lengths)) and len(lengths) <= seqs
            assert all(s + n <= min(max_len, blocks * block_size) for s, n in zip(starts, lengths))
            assert all(math.ceil((s + n) / block_size) <= blocks for s, n in zip(starts, lengths))


# ---- the scheduler under the policy -------------------------------------------------------------------------------

def _scheduler(max_itl_ms, budget: int = 4096, blocks: int = 4096, max_seqs: int = 64) -> Scheduler:
    step_budget = StepBudget(_synthetic_model(), max_itl_ms) if max_itl_ms is not None else None
    return Scheduler(KVCacheManager(blocks, 16, enable_prefix_caching=False), max_seqs, budget, 8, step_budget)


def test_decodes_go_first_and_the_prefill_chunk_fills_the_target():
    scheduler = _scheduler(20.0)
    decoders = [_seq(f"d{i}", 100) for i in range(8)]
    _decoding(scheduler, *decoders)
    long_prompt = _seq("long", 3000)
    scheduler.add(long_prompt)
    batch = scheduler.schedule()
    assert batch.seqs[:8] == decoders and batch.num_new_tokens[:8] == [1] * 8
    assert batch.seqs[8:] == [long_prompt]
    model = scheduler.step_budget.model
    decode_s = model.decode_seconds(8, 8 * 101)
    chunk = batch.num_new_tokens[8]
    # the largest chunk that keeps the predicted step within 20 ms
    assert decode_s + model.prefill_seconds(0, chunk) <= 0.020 < decode_s + model.prefill_seconds(0, chunk + 1)
    assert model.predict(StepFeatures.of_batch(batch)) == pytest.approx(decode_s + model.prefill_seconds(0, chunk))


def test_the_model_prices_the_eager_pass_past_the_decode_stack():
    """Steps the CPU decode stack does not run whole pay a fixed eager pass: the model learns its price apart
    from the tokens' and predicts both sides of the line."""
    true = np.array([2e-3, 50e-6, 10e-9, 1e-9, 8e-3])
    model = StepTimeModel(np.array([1e-3, 1e-6]))
    model.stack_limits = StackLimits(decode_rows=64, chained_rows=64, mixed_rows=64, mixed_context=1024)
    rng = random.Random(1)
    for _ in range(400):
        decodes, chunk = rng.randint(1, 40), rng.choice([0, rng.randint(2, 200)])
        counts = [1] * decodes + ([chunk] if chunk else [])
        features = StepFeatures(decodes + chunk, decodes * 50, prefill_pairs(0, chunk) if chunk else 0.0,
                                eager_pass(counts, [50] * decodes + [chunk], model.stack_limits))
        model.observe(features, float(features.vector() @ true) * rng.uniform(0.97, 1.03))
    assert model.eager_seconds == pytest.approx(8e-3, rel=0.15)
    assert model.coefficients[1] == pytest.approx(50e-6, rel=0.15)


def test_which_steps_the_stack_runs_whole():
    limits = StackLimits(decode_rows=64, chained_rows=8, mixed_rows=512, mixed_context=1024)
    assert limits.runs_whole([1] * 64, [9] * 64) and not limits.runs_whole([1] * 65, [9] * 65)  # decode-only
    assert limits.runs_whole([8], [8]) and not limits.runs_whole([9], [9])  # a prompt alone: the chained rows
    assert limits.runs_whole([1, 300], [5, 1000]) and not limits.runs_whole([1, 300], [5, 1025])  # mixed, and deep
    assert not limits.runs_whole([1, 512], [5, 512])  # 513 tokens
    assert eager_pass([1, 300], [5, 1025], limits) == 1 and eager_pass([1] * 500, [1] * 500, None) == 0


def test_a_chunk_stops_at_the_decode_stack_line_unless_crossing_pays():
    """With an eager pass of 10 ms past 64 tokens, a 20 ms target is better spent on a step that stays on the
    stack (its decodes plus the chunk up to the line) than on a longer step carrying a bigger chunk; a 100 ms
    target pays for the crossing many times over, and takes it. A chunk deep in its prompt meets the line at
    the stack's context instead."""
    line = StackLimits(decode_rows=64, chained_rows=64, mixed_rows=64, mixed_context=1024)

    def chunk(target_ms, limits=line):
        scheduler = _scheduler(target_ms)
        model = scheduler.step_budget.model
        model.coefficients[4], model.stack_limits = 10e-3, limits
        _decoding(scheduler, *[_seq(f"d{i}", 100) for i in range(16)])
        scheduler.add(_seq("long", 3000))
        batch = scheduler.schedule()
        predicted = model.predict(model.features(batch))
        assert predicted <= target_ms / 1e3 * (1 + 1e-9)
        return batch.num_new_tokens[16]

    assert chunk(20.0) == 64 - 16
    assert chunk(100.0) > 1000
    assert chunk(20.0, limits=None) > 200  # no stack: the target alone sizes the chunk
    model = _synthetic_model()
    model.coefficients[4], model.stack_limits = 10e-3, line
    deep = PrefillAllowance(4096, seconds=12e-3, model=model, min_tokens=1, fast_room=48, fast_context=1000,
                            step_seconds=3e-3)  # (min_tokens: not the head-of-queue rule here)
    assert deep.grant(990, 3000) == 10  # 990 tokens in: the chunk stops where the stack's context ends
    deep.spend(990, 10)
    assert deep.fast_room == 38 and deep.seconds == pytest.approx(12e-3 - model.prefill_seconds(990, 10))
    crossing = PrefillAllowance(4096, seconds=12e-3, model=model, fast_room=48, step_seconds=3e-3)
    crossing.spend(0, 60)  # past the line: the eager pass is paid once, and there is no line any more
    assert crossing.fast_room is None and crossing.seconds == pytest.approx(2e-3 - model.prefill_seconds(0, 60))


def test_auto_target_is_a_multiple_of_the_decode_step_of_the_whole_load():
    scheduler = _scheduler("auto")
    decoders = [_seq(f"d{i}", 50) for i in range(32)]
    _decoding(scheduler, *decoders)
    scheduler.add(_seq("long", 5000))
    batch = scheduler.schedule()
    model = scheduler.step_budget.model
    decode_s = model.decode_seconds(32, 32 * 51)
    # the reference step counts the waiting request as one more decoding row with its context
    target = AUTO_ITL_FACTOR * model.decode_seconds(33, 32 * 51 + 5000)
    assert scheduler.step_budget.last_target_seconds == pytest.approx(target)
    predicted = model.predict(StepFeatures.of_batch(batch))
    assert 0.9 * target < predicted <= target * (1 + 1e-9)  # filled, not left empty
    assert predicted > AUTO_ITL_FACTOR * decode_s  # more room than the decoding rows alone would give


def test_a_deep_queue_widens_the_auto_target_up_to_max_num_seqs():
    def first_chunk(waiting: int, max_seqs: int) -> int:
        scheduler = _scheduler("auto", max_seqs=max_seqs)
        _decoding(scheduler, *[_seq(f"d{i}", 50) for i in range(4)])
        for i in range(waiting):
            scheduler.add(_seq(f"w{i}", 5000))  # longer than the token budget: never a burst
        return scheduler.schedule().num_new_tokens[4]

    assert first_chunk(1, 64) < first_chunk(20, 64) < first_chunk(50, 64)
    assert first_chunk(20, 8) == first_chunk(50, 8)  # only max_num_seqs can ever decode together


def test_a_wave_of_short_prompts_is_a_burst_that_takes_the_whole_budget():
    """As many short prompts waiting as half the decoding streams, and at least BURST_MIN_ROWS: the step takes the
    whole token budget (the wave's first tokens come at prefill speed); fewer, or prompts longer than the budget,
    or a fixed target: chunked to the target as before."""
    def step(decoding: int, waiting: int, length: int = 128, itl="auto", budget: int = 4096):
        scheduler = _scheduler(itl, budget=budget)
        _decoding(scheduler, *[_seq(f"d{i}", 128) for i in range(decoding)])
        for i in range(waiting):
            scheduler.add(_seq(f"w{i}", length))
        batch = scheduler.schedule()
        return sum(batch.num_new_tokens[decoding:]), scheduler.step_budget

    prefill, budget = step(16, 8)
    assert prefill == 8 * 128 and budget.num_bursts == 1  # the whole wave in one step
    prefill, budget = step(16, 7)
    assert prefill < 7 * 128 and budget.num_bursts == 0  # below half the decoding streams: chunked
    assert step(16, 24, budget=2048)[0] == 2048 - 16  # a burst is still bounded by the token budget (with the decodes)
    prefill, budget = step(16, 8, length=5000)
    assert prefill < 4096 and budget.num_bursts == 0  # long prompts: a document, not a wave
    prefill, budget = step(16, 8, itl=20.0)
    assert prefill < 8 * 128 and budget.num_bursts == 0  # a fixed target never bursts
    for decoding, waiting, bursts in ((1, 1, 0), (2, 3, 0), (2, 4, 1)):  # a wave is at least BURST_MIN_ROWS
        assert step(decoding, waiting)[1].num_bursts == bursts, (decoding, waiting)


def test_a_burst_goes_on_until_its_wave_is_in_and_no_further():
    """A wave larger than one step's budget: the next step bursts too although the prompts left are too few to
    start a burst, and once the wave is in, a lone newcomer is chunked as before."""
    scheduler = _scheduler("auto", budget=16 + 4 * 128 + 50)
    _decoding(scheduler, *[_seq(f"d{i}", 128) for i in range(16)])
    wave = [_seq(f"w{i}", 128) for i in range(8)]
    for seq in wave:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert sum(first.num_new_tokens[16:]) == 4 * 128 + 50 and scheduler.step_budget.num_bursts == 1
    _advance(first)
    second = scheduler.schedule()  # 20 decoding, 4 of the wave left: under the threshold of 10 alone
    assert scheduler.step_budget.burst_threshold(20) > 4
    assert scheduler.step_budget.num_bursts == 2 and sum(second.num_new_tokens[20:]) == 3 * 128 + 78
    _advance(second)
    late = _seq("late", 500)  # within the budget, but alone
    scheduler.add(late)
    third = scheduler.schedule()
    assert third.seqs[-1] is late and scheduler.step_budget.num_bursts == 2
    assert third.num_new_tokens[-1] < 500 - 16 - 24  # chunked to the target: no wave now


def test_without_decodes_or_target_prefills_take_the_whole_budget():
    for itl in (20.0, None):
        scheduler = _scheduler(itl, budget=512)
        scheduler.add(_seq("a", 3000))
        batch = scheduler.schedule()
        assert batch.num_new_tokens == [512]  # nothing decodes: no stream to protect
    scheduler = _scheduler(None, budget=512)
    _decoding(scheduler, _seq("d", 10))
    scheduler.add(_seq("b", 3000))
    assert scheduler.schedule().num_new_tokens == [1, 511]


def test_the_head_of_the_queue_advances_every_step_however_tight_the_target():
    scheduler = _scheduler(0.001)  # 1 us: the decodes alone exceed it
    _decoding(scheduler, *[_seq(f"d{i}", 200) for i in range(16)])
    prompt = _seq("p", 200)
    scheduler.add(prompt)
    scheduler.add(_seq("q", 200))  # behind it: gets nothing while the head is unfinished
    steps = 0
    while prompt.num_output_tokens == 0:
        batch = scheduler.schedule()
        assert batch.num_new_tokens[:16] == [1] * 16
        assert batch.seqs[16:] == [prompt] and batch.num_new_tokens[16] == min(MIN_PREFILL_TOKENS, 200 - 32 * steps)
        _advance(batch)
        steps += 1
    assert steps == math.ceil(200 / MIN_PREFILL_TOKENS)


# ---- priority -----------------------------------------------------------------------------------------------------

def test_waiting_queue_orders_by_priority_then_arrival():
    scheduler = _scheduler(None, budget=10_000)
    seqs = [_seq("late-low", 20, priority=5), _seq("urgent", 20, priority=-1), _seq("normal-1", 20),
            _seq("normal-2", 20), _seq("urgent-2", 20, priority=-1)]
    for seq in seqs:
        scheduler.add(seq)
    assert [s.request_id for s in scheduler.waiting] == ["urgent", "urgent-2", "normal-1", "normal-2", "late-low"]
    assert scheduler.waiting.num_tokens == sum(seq.num_tokens for seq in seqs)
    scheduler.finish(seqs[2])
    assert len(scheduler.waiting) == 4 and seqs[2] not in scheduler.waiting
    assert scheduler.waiting.num_tokens == sum(seq.num_tokens for seq in seqs) - seqs[2].num_tokens
    batch = scheduler.schedule()
    assert [s.request_id for s in batch.seqs] == ["urgent", "urgent-2", "normal-2", "late-low"]


def test_a_better_priority_preempts_the_worst_running_for_a_seat():
    scheduler = _scheduler(None, max_seqs=2)
    low, mid = _seq("low", 20, priority=9), _seq("mid", 20, priority=1)
    _decoding(scheduler, low, mid)
    urgent = _seq("urgent", 20, priority=0)
    scheduler.add(urgent)
    batch = scheduler.schedule()
    assert low.status is SequenceStatus.WAITING and low.num_computed_tokens == 0 and low in scheduler.waiting
    assert batch.seqs == [mid, urgent] and scheduler.num_preemptions == 1
    _advance(batch)
    same = _seq("same", 20, priority=1)  # no worse priority is running now: it waits
    scheduler.add(same)
    assert scheduler.schedule().seqs == [mid, urgent]
    assert same in scheduler.waiting and same.status is SequenceStatus.WAITING and scheduler.num_preemptions == 1


# ---- engines ------------------------------------------------------------------------------------------------------

def _recording_batches(llm_engine) -> list[list[int]]:
    shapes: list[list[int]] = []
    schedule = llm_engine.scheduler.schedule

    def recording():
        batch = schedule()
        shapes.append(list(batch.num_new_tokens))
        return batch

    llm_engine.scheduler.schedule = recording
    return shapes


def test_greedy_output_is_unchanged_by_small_prefill_chunks(llama_dir):
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randint(20, 150))] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = reference_greedy(llama_dir, prompts, 10)
    llm = LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=64, max_itl_ms=0.001, block_size=8)
    shapes = _recording_batches(llm.engine)
    assert llm.engine.step_time.calibrated
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # decoding steps carried prefill chunks of the minimum size beside their decodes
    assert any(1 in shape and MIN_PREFILL_TOKENS in shape for shape in shapes)
    assert llm.engine.step_time.num_observed == len([s for s in shapes if s])
    assert llm.stats()["itl_target_ms"] == 0  # a fixed 0.001 ms target rounds to nothing
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_wave_arriving_while_a_stream_decodes_is_one_burst_and_counted(llama_dir):
    """AsyncLLM (auto target): six short prompts submitted together while one stream decodes take the whole token
    budget in one step (stats and the scheduler agree), and every stream still gets its tokens."""
    async def main():
        async with AsyncLLM(str(llama_dir), dtype="float32") as allm:
            shapes = _recording_batches(allm.engine)
            params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
            agen = allm.stream_outputs([5, 6, 7], params)
            first = await agen.__anext__()  # decoding now
            wave = [allm.generate([10 + i] * 20, temperature=0, max_tokens=4, ignore_eos=True) for i in range(6)]
            outs = await asyncio.gather(*wave)
            rest = [delta async for delta in agen]
            tokens = sum(len(d.outputs[0].token_ids) for d in [first, *rest])
            return tokens, outs, allm.stats(), allm.engine.scheduler.step_budget.num_bursts, shapes

    tokens, outs, stats, bursts, shapes = asyncio.run(main())
    assert tokens == 48 and all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert stats["num_prefill_bursts"] == bursts >= 1
    assert any(shape[0] == 1 and shape[1:] == [20] * 6 for shape in shapes)  # the decode beside the whole wave


def test_throughput_mode_is_the_llm_default_and_auto_the_async_default(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32")
    assert llm.engine.scheduler.step_budget is None and not llm.engine.step_time.calibrated
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert llm.stats()["itl_target_ms"] == 0

    async def main():
        async with AsyncLLM(str(llama_dir), dtype="float32") as allm:
            budget = allm.engine.scheduler.step_budget
            assert budget is not None and budget.fixed_seconds is None and allm.engine.step_time.calibrated
            out = await allm.generate([5, 6, 7], temperature=0, max_tokens=4, ignore_eos=True)
            target = budget.last_target_seconds
            assert target is not None and allm.stats()["itl_target_ms"] == round(1000 * target)
            return out

    assert len(asyncio.run(main()).outputs[0].token_ids) == 4


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), "fast", True, [10]])
def test_max_itl_ms_is_validated(llama_dir, bad):
    with pytest.raises(ConfigError, match="max_itl_ms"):
        LLM(str(llama_dir), max_itl_ms=bad)


def test_priority_is_validated(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32")
    for bad in ("high", 1.5, True, 2**40):
        with pytest.raises(InvalidRequestError, match="priority") as info:
            llm.generate([[5, 6]], SamplingParams(max_tokens=2), priority=bad)
        assert info.value.field == "priority"
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate([[5, 6], [7, 8]], SamplingParams(max_tokens=2), priority=[0])
    assert llm.stats()["num_waiting"] == 0


def test_an_urgent_stream_overtakes_a_running_batch_job(llama_dir):
    params = dict(temperature=0, ignore_eos=True)
    batch_prompt, urgent_prompt = [11, 12, 13, 14], [21, 22, 23]

    async def main():
        async with AsyncLLM(str(llama_dir), dtype="float32", max_num_seqs=1) as llm:
            alone = (await llm.generate(batch_prompt, max_tokens=200, **params)).outputs[0].token_ids
            order: list[str] = []

            async def run(name, prompt, max_tokens, priority):
                out = await llm.generate(prompt, max_tokens=max_tokens, priority=priority, **params)
                order.append(name)
                return out.outputs[0].token_ids

            job = asyncio.create_task(run("batch", batch_prompt, 200, 10))
            while llm.stats()["num_running"] == 0:
                await asyncio.sleep(0.005)
            urgent = await run("urgent", urgent_prompt, 5, 0)
            batch_tokens = await job
            stats = llm.stats()
        return alone, batch_tokens, order, urgent, stats

    alone, batch_tokens, order, urgent, stats = asyncio.run(main())
    assert order == ["urgent", "batch"]  # one seat: the urgent request took it from the batch job
    assert stats["num_preemptions"] >= 1 and stats["kv_blocks_used"] == 0
    assert batch_tokens == alone  # recomputed after its preemption: the same greedy tokens
    assert urgent == reference_greedy(llama_dir, [urgent_prompt], 5)[0]


def test_server_requests_carry_their_priority(llama_dir):
    from asyncllm.server import create_app
    from server_helpers import assert_error, request

    seen: list[int] = []

    async def make():
        return AsyncLLM(str(llama_dir), dtype="float32")

    llm = asyncio.run(make())
    add = llm.engine.add_request

    def recording(engine_request):
        seen.append(engine_request.priority)
        add(engine_request)

    llm.engine.add_request = recording
    try:
        app = create_app(llm)
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "priority": -3}
        assert request(app, "POST", "/v1/completions", json=body).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 7}
        assert request(app, "POST", "/v1/chat/completions", json=chat).status_code == 200
        assert request(app, "POST", "/v1/completions", json={**body, "priority": None}).status_code == 200
        assert seen == [-3, 7, 0]
        for bad in ("high", 1.5, 2**40):
            assert_error(request(app, "POST", "/v1/completions", json={**body, "priority": bad}), 400, "priority")
    finally:
        llm.close()


def test_serve_flags_reach_the_engine_arguments():
    from asyncllm.cli import build_parser

    parse = lambda *flags: build_parser().parse_args(["serve", "model", *flags])  # noqa: E731
    assert parse().max_itl_ms == "auto" and parse().max_num_batched_tokens is None
    assert parse("--max-itl-ms", "none").max_itl_ms is None
    assert parse("--max-itl-ms", "AUTO").max_itl_ms == "auto"
    assert parse("--max-itl-ms", "40", "--max-num-batched-tokens", "512").max_itl_ms == 40.0
    for bad in ("0", "-3", "fast", "inf"):
        with pytest.raises(SystemExit):
            parse("--max-itl-ms", bad)
