"""What an application sees when things go wrong, and how it carries on without a restart.

Run:  python examples/resilient_service.py [--model PATH]

Four scenes on one AsyncLLM: a bad request (InvalidRequestError naming the field), a deadline
(``timeout=`` aborts and frees the blocks), a burst beyond ``max_waiting_requests``
(EngineOverloadedError, HTTP 429 in the server), and an engine fault injected into the forward pass
(every open stream gets EngineDeadError, the engine resets itself and the next request is served).
"""

from __future__ import annotations

import asyncio
import time

from asyncllm import AsyncLLM
from asyncllm.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestTimeoutError
from asyncllm.toy import example_parser, parse_example_args


async def bad_request(llm: AsyncLLM) -> str:
    try:
        await llm.generate("Hello", seed=2**64)
    except InvalidRequestError as exc:
        return f"refused, field {exc.field!r}: {exc}"
    return "accepted?!"


async def deadline(llm: AsyncLLM) -> str:
    # A deadline of about 40 tokens' time (at most 0.2 s) for an answer that would run to the context's end
    # (hundreds of tokens): it fires whatever the machine's speed.
    begin = time.perf_counter()
    await llm.generate("Warm up", max_tokens=16, ignore_eos=True)
    limit = max(0.005, round(min(0.2, 40 * (time.perf_counter() - begin) / 16), 3))
    pieces = 0
    try:
        async for _ in llm.stream("A very long story", max_tokens=None, ignore_eos=True, timeout=limit):
            pieces += 1
    except RequestTimeoutError as exc:
        return f"{exc} after {pieces} pieces"
    return "finished before the deadline"


async def burst(llm: AsyncLLM, size: int) -> str:
    async def one(i: int) -> str:
        try:
            await llm.generate(f"Request {i}", max_tokens=8, ignore_eos=True)
            return "served"
        except EngineOverloadedError:
            return "overloaded"

    outcomes = await asyncio.gather(*(one(i) for i in range(size)))
    return f"{outcomes.count('served')} served, {outcomes.count('overloaded')} told to retry later"


async def engine_fault(llm: AsyncLLM) -> str:
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}

    def failing_once(*args, **kwargs):  # stands in for an out-of-memory error or a kernel bug
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real_execute(*args, **kwargs)

    llm.engine.runner.execute = failing_once
    try:
        results = await asyncio.gather(*(llm.generate(f"Stream {i}", max_tokens=32, ignore_eos=True)
                                         for i in range(4)), return_exceptions=True)
    finally:
        llm.engine.runner.execute = real_execute
    failed = sum(isinstance(r, EngineDeadError) for r in results)
    stats = llm.stats()
    after = await llm.generate("Are you back?", max_tokens=4)
    return (f"{failed} streams got EngineDeadError; then {stats['num_running']} running, "
            f"{stats['kv_blocks_used']} blocks used; next request: {len(after.outputs[0].token_ids)} tokens "
            f"(restarts so far: {llm.num_restarts})")


async def run(model: str) -> dict[str, str]:
    async with AsyncLLM(model, max_num_seqs=4, max_waiting_requests=4) as llm:
        report = {"bad request": await bad_request(llm), "deadline": await deadline(llm),
                  "burst of 16": await burst(llm, 16), "engine fault": await engine_fault(llm)}
    for scene, what in report.items():
        print(f"{scene:>13}: {what}")
    return report


def main() -> None:
    args = parse_example_args(example_parser(__doc__))
    asyncio.run(run(args.model))


if __name__ == "__main__":
    main()
