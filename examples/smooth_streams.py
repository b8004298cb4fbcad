"""Streams that keep flowing while long prompts arrive, and an interactive request ahead of batch jobs.

Run:  python examples/smooth_streams.py [--model PATH]

Two scenes. First, four streams decode while four long prompts arrive; the same thing runs with the
inter-token latency target on (``max_itl_ms="auto"``, AsyncLLM's default) and off (``None``), and the
longest gap the streams saw is printed for both, with the largest prefill chunk a step carried. Second,
batch jobs at ``priority=10`` hold every seat (``max_num_seqs=2``) when an interactive request arrives at
``priority=0``: it takes a seat from a batch job (which is recomputed later, same tokens) and finishes
first. See docs/async.md.
"""

from __future__ import annotations

import asyncio
import time

from asyncllm import AsyncLLM
from asyncllm.toy import example_parser, parse_example_args

LONG_PROMPT = list(range(20, 20 + 400))  # token ids: no tokenizer needed for the shape of the load


async def _stream_gaps(llm: AsyncLLM, prompt: list[int], max_tokens: int, started: asyncio.Event) -> float:
    """Stream one request; the longest gap between two of its tokens, in seconds. ``started`` is set at
    its first token."""
    last, longest = None, 0.0
    async for _ in llm.stream_outputs(prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True):
        now = time.perf_counter()
        if last is not None:
            longest = max(longest, now - last)
        last = now
        started.set()
    return longest


def _record_chunks(llm: AsyncLLM) -> list[int]:
    """The largest prefill chunk of every step that also decoded (what the policy bounds)."""
    chunks: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        if 1 in batch.num_new_tokens:
            chunks.append(max(batch.num_new_tokens))
        return batch

    llm.engine.scheduler.schedule = recording
    return chunks


async def arrivals(model: str, max_itl_ms) -> dict[str, float]:
    """Four streams decoding; four long prompts arrive while they do."""
    async with AsyncLLM(model, max_itl_ms=max_itl_ms, max_num_batched_tokens=1024) as llm:
        chunks = _record_chunks(llm)
        started = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(_stream_gaps(llm, [5 + i, 6, 7], 96, started[i])) for i in range(4)]
        await asyncio.gather(*(event.wait() for event in started))  # every stream is decoding now
        newcomers = [llm.generate(LONG_PROMPT + [i], max_tokens=4, ignore_eos=True) for i in range(4)]
        await asyncio.gather(*newcomers)
        gaps = await asyncio.gather(*streams)
        return {"longest gap ms": round(1000 * max(gaps), 1), "largest chunk beside decodes": max(chunks, default=0)}


async def priorities(model: str) -> list[str]:
    """Two batch jobs hold both seats; an interactive request overtakes them. Returns the finishing order."""
    order: list[str] = []
    async with AsyncLLM(model, max_num_seqs=2) as llm:
        async def job(name: str, prompt: list[int], max_tokens: int, priority: int) -> None:
            await llm.generate(prompt, max_tokens=max_tokens, ignore_eos=True, priority=priority)
            order.append(name)

        batch = [asyncio.create_task(job(f"batch-{i}", [30 + i, 31, 32], 150, 10)) for i in range(2)]
        while llm.stats()["num_running"] < 2:
            await asyncio.sleep(0.005)
        await job("interactive", [40, 41, 42], 8, 0)
        await asyncio.gather(*batch)
        order.append(f"(preemptions: {llm.stats()['num_preemptions']})")
    return order


async def run(model: str) -> dict:
    report = {"target on": await arrivals(model, "auto"), "target off": await arrivals(model, None),
              "finishing order": await priorities(model)}
    for scene, what in report.items():
        print(f"{scene:>15}: {what}")
    return report


def main() -> None:
    args = parse_example_args(example_parser(__doc__))
    asyncio.run(run(args.model))


if __name__ == "__main__":
    main()
