"""W-LATENCY: one request at a time (128-token prompt, 128 output tokens), measured by the consumer.

    python -m benchmarks.w_latency [--requests 20] [--json out.json]

Time to first token and inter-token latency are taken where the application sees them: between
items of ``llm.stream_outputs()``. The engine's own step time is recorded alongside, so the cost
of delivery (thread hand-off, detokenization, event-loop wake-up) is the difference of the two.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

from benchmarks.common import build_cpu_llama
from benchmarks.measure import loadavg, machine_record, model_config, percentile, utc_now, write_report

SIZES = {"full": [], "quick": ["--requests", "5"],
         "tiny": ["--requests", "2", "--prompt-len", "8", "--output-len", "6"]}


def _time_engine_steps(llm) -> list[float]:
    """Wrap the engine's step() to record how long each one takes (engine thread side)."""
    durations: list[float] = []
    step = llm.engine.step

    def timed_step():
        start = time.perf_counter()
        outputs = step()
        if outputs:
            durations.append(time.perf_counter() - start)
        return outputs

    llm.engine.step = timed_step
    return durations


async def measure(model_dir: str, requests: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    from asyncllm import AsyncLLM

    rng = random.Random(seed)
    vocab = model_config(model_dir)["vocab_size"]
    ttfts, gaps, tokens = [], [], 0
    async with AsyncLLM(model_dir, dtype="float32") as llm:
        await llm.generate([11] * prompt_len, max_tokens=4, ignore_eos=True)  # warm-up
        steps = _time_engine_steps(llm)
        for i in range(requests):
            prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
            start = last = time.perf_counter()
            first = True
            async for delta in llm.stream_outputs(prompt, temperature=0, max_tokens=output_len, ignore_eos=True):
                now = time.perf_counter()
                tokens += len(delta.outputs[0].token_ids)
                if first:
                    ttfts.append(now - start)
                    first = False
                else:
                    gaps.append(now - last)
                last = now
            print(f"\r[w-latency] request {i + 1}/{requests}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    decode_steps = sorted(steps)[: max(1, len(steps) - requests)]  # drop the prefill steps (the slowest)
    ms = lambda v: round(v * 1000, 3)  # noqa: E731
    step_p50 = statistics.median(decode_steps)
    # a stream whose tokens all arrived in one item has no gaps (a tiny run on a machine loaded from outside can)
    itl_p50 = statistics.median(gaps) if gaps else None
    return {
        "benchmark": "W-LATENCY",
        "date": utc_now(),
        "workload": {"name": "W-LATENCY", "requests": requests, "prompt_len": prompt_len, "output_len": output_len},
        "tokens_received": tokens,
        "deliveries": len(ttfts) + len(gaps),
        "ttft_ms": {"p50": ms(statistics.median(ttfts)), "p99": ms(percentile(ttfts, 99))},
        "itl_ms": {"p50": ms(itl_p50) if gaps else None, "p99": ms(percentile(gaps, 99)) if gaps else None},
        "engine_decode_step_ms": {"p50": ms(step_p50), "p99": ms(percentile(decode_steps, 99))},
        "delivery_overhead_ms_p50": ms(itl_p50 - step_p50) if gaps else None,
        "latency_measurement": "consumer side: gaps between items of AsyncLLM.stream_outputs (one request at a "
                               "time); engine step = EngineCore.step wall time in the engine thread, the "
                               "slowest `requests` steps (the prefills) dropped",
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    load_start = loadavg()
    model_dir = args.model_dir or str(build_cpu_llama())
    result = asyncio.run(measure(model_dir, args.requests, args.prompt_len, args.output_len))
    result["machine"] = machine_record(load_start)
    result["command"] = "python -m benchmarks.w_latency " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"W-LATENCY ({args.requests} requests, {args.prompt_len} prompt / {args.output_len} output tokens)")
    print(f"  time to first token  p50 {result['ttft_ms']['p50']:8.2f} ms   p99 {result['ttft_ms']['p99']:8.2f} ms")
    itl = result["itl_ms"]
    if itl["p50"] is None:
        print("  inter-token latency  none: every stream arrived in one item")
    else:
        print(f"  inter-token latency  p50 {itl['p50']:8.2f} ms   p99 {itl['p99']:8.2f} ms")
    print(f"  engine decode step   p50 {result['engine_decode_step_ms']['p50']:8.2f} ms   "
          f"p99 {result['engine_decode_step_ms']['p99']:8.2f} ms")
    if result["delivery_overhead_ms_p50"] is not None:
        print(f"  delivery overhead    p50 {result['delivery_overhead_ms_p50']:8.3f} ms")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
