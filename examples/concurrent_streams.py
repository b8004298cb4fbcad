"""Many concurrent streams, some of them cancelled, timed out or abandoned midway.

Run:  python examples/concurrent_streams.py [--model PATH] [--streams 50]

Whatever way a consumer leaves, its request is aborted and its KV blocks return to the pool:
the final stats show nothing running and no blocks in use.
"""

from __future__ import annotations

import asyncio
import random

from asyncllm import AsyncLLM
from asyncllm.toy import example_parser, parse_example_args


async def consume(llm: AsyncLLM, i: int, rng: random.Random) -> str:
    prompt = f"Stream number {i} says"
    style = rng.choice(["full", "full", "break", "timeout", "cancel"])
    if style == "timeout":
        async def read_slowly():
            async for _ in llm.stream(prompt, max_tokens=64, ignore_eos=True):
                await asyncio.sleep(0.01)
        try:
            await asyncio.wait_for(read_slowly(), timeout=0.05)
        except asyncio.TimeoutError:
            return "timed out"
    if style == "cancel":
        task = asyncio.create_task(llm.generate(prompt, max_tokens=64, ignore_eos=True))
        await asyncio.sleep(rng.random() * 0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "finished before the cancel"
    pieces = 0
    async for _ in llm.stream(prompt, max_tokens=32, ignore_eos=True):
        pieces += 1
        if style == "break" and pieces == 3:
            return "left after 3 pieces"
    return f"read all {pieces} pieces"


async def wait_until_idle(llm: AsyncLLM, timeout: float = 5.0) -> dict:
    """Aborts are applied at the engine's next step; wait for it to report an empty cache."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        stats = llm.stats()
        if stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0:
            break
        await asyncio.sleep(0.01)
    return llm.stats()


async def run(model: str, streams: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    async with AsyncLLM(model) as llm:
        outcomes = await asyncio.gather(*(consume(llm, i, rng) for i in range(streams)))
        stats = await wait_until_idle(llm)
    for outcome in sorted(set(outcomes)):
        print(f"{outcomes.count(outcome):4d} streams: {outcome}")
    print("engine after all of them:", stats)
    return {"outcomes": outcomes, "stats": stats}


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--streams", type=int, default=50)
    args = parse_example_args(parser)
    asyncio.run(run(args.model, args.streams))


if __name__ == "__main__":
    main()
