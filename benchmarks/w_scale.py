"""W-SCALE: how cost grows with work (workloads: docs/benchmarks.md): W-CPU's request mix at concurrency 1, 4,
16 and 64; output tokens/s, inter-token latency p50/p99 and KV-cache utilization at each level.

    python -m benchmarks.w_scale [--levels 1,4,16,64] [--scale 1.0] [--json out.json]

One ``AsyncLLM`` on ``cpu-llama`` (float32). Concurrency ``c`` means ``c`` closed-loop clients: each streams a
request with ``stream_outputs`` and submits the next as soon as its previous one ends, so at most ``c`` requests are
in the engine at once. Level ``c`` serves the first ``max(--min-requests, 4c)`` requests of the W-CPU mix (capped at
the whole mix), which keeps concurrency 1 to a few seconds. Latency is the consumer's: TTFT from the request's own
submission, ITL = gaps between its tokens. KV-cache utilization is sampled in the engine thread after every step:
token slots whose KV is computed for the running sequences / token slots of the KV blocks held (``kv_blocks_used`` *
``block_size``); reported as the per-step mean, the minimum and the token-weighted figure. The prefix cache is
emptied before each level (the levels share requests).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from benchmarks.common import Workload, build_cpu_llama, w_cpu_workload
from benchmarks.measure import (
    StepRecorder, finish_report, fmt_ms, loadavg, model_config, reset_prefix_cache, summarize_ms, utc_now,
)

DEFAULT_LEVELS = (1, 4, 16, 64)
SIZES = {"full": [], "quick": ["--scale", "0.25"], "tiny": ["--scale", "0.1", "--levels", "1,4", "--min-requests", "2"]}


async def _client(llm: Any, queue: list, results: list, bar: Any) -> None:
    """Take requests off the shared list until it is empty; record (submission time, token times, token ids)."""
    while queue:
        index, req = queue.pop(0)
        start = time.perf_counter()
        times: list[float] = []
        ids: list[int] = []
        async for delta in llm.stream_outputs(req.prompt_token_ids, temperature=0, max_tokens=req.max_tokens,
                                              ignore_eos=True):
            now = time.perf_counter()
            new = delta.outputs[0].token_ids
            times.extend([now] * len(new))
            ids.extend(new)
            bar.update(len(new))
        results[index] = (start, times, ids)


async def run_level(llm: Any, workload: Workload, concurrency: int, progress: bool) -> dict[str, Any]:
    """Serve ``workload`` with ``concurrency`` closed-loop clients; figures of the level."""
    from tqdm.auto import tqdm

    reset_prefix_cache(llm.engine)  # levels share requests: none may start from an earlier level's KV
    queue = list(enumerate(workload.requests))
    results: list[Any] = [None] * len(queue)
    recorder = StepRecorder(llm.engine)
    with recorder.installed(), tqdm(total=workload.output_tokens, desc=f"concurrency {concurrency}", unit="tok",
                                    disable=not progress, file=sys.stdout) as bar:
        start = time.perf_counter()
        await asyncio.gather(*(_client(llm, queue, results, bar) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = [times[0] - t0 for t0, times, _ in results if times]
    gaps = [b - a for _, times, _ in results for a, b in zip(times, times[1:])]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": workload.output_tokens,
        "generated_tokens": sum(len(ids) for _, _, ids in results),
        "wall_s": wall,
        "tokens_per_s": workload.output_tokens / wall,
        "ttft_ms": summarize_ms(ttfts),
        "itl_ms": summarize_ms(gaps),
        "kv_utilization": recorder.kv_utilization(),
        "engine_steps": len(recorder.step_s),
    }


def level_workload(mix: Workload, concurrency: int, min_requests: int) -> Workload:
    count = min(len(mix.requests), max(min_requests, 4 * concurrency))
    return Workload(mix.name, mix.requests[:count], mix.scale, dict(mix.params))


async def measure(model_dir: str, levels: list[int], scale: float, min_requests: int, progress: bool) -> dict:
    from asyncllm import AsyncLLM

    mix = w_cpu_workload(model_config(model_dir)["vocab_size"], scale=scale)
    async with AsyncLLM(model_dir, dtype="float32", device="cpu") as llm:
        await llm.generate([11] * 16, temperature=0, max_tokens=4, ignore_eos=True)  # warm-up
        rows = [await run_level(llm, level_workload(mix, c, min_requests), c, progress) for c in levels]
        block_size = llm.engine.kv.block_size
    return {"workload": mix.summary(), "block_size": block_size, "levels": rows}


def print_table(report: dict[str, Any]) -> None:
    print("\nW-SCALE: W-CPU mix at rising concurrency (closed-loop clients); latency in ms, consumer side")
    hdr = (f"{'conc.':>5} {'requests':>8} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} "
           f"{'KV util':>8} {'KV min':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in report["levels"]:
        kv = r["kv_utilization"]
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        print(f"{r['concurrency']:>5} {r['requests']:>8} {r['tokens_per_s']:>8.1f} {fmt_ms(r['ttft_ms']['p50']):>9} "
              f"{fmt_ms(r['itl_ms']['p50']):>8} {fmt_ms(r['itl_ms']['p99']):>8} {pct(kv['weighted']):>8} "
              f"{pct(kv['min']):>7}")
    print("targets (BENCHMARKS.md): KV-cache utilization >= 96%; throughput rising with concurrency", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="concurrency levels")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the W-CPU mix (1.0 = 64 requests)")
    parser.add_argument("--min-requests", type=int, default=8, help="fewest requests served at any level")
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",")]
        assert levels and min(levels) >= 1
    except (ValueError, AssertionError):
        parser.error("--levels must be a comma-separated list of positive integers")
    load_start = loadavg()
    model_dir = args.model_dir or str(build_cpu_llama())
    report: dict[str, Any] = {"benchmark": "W-SCALE", "date": utc_now(),
                              "command": "python -m benchmarks.w_scale " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv)}
    report.update(asyncio.run(measure(model_dir, levels, args.scale, args.min_requests, not args.no_progress)))
    report["measurement"] = __doc__.split("\n\n")[2].replace("\n", " ")
    return finish_report(report, model_dir, load_start, args.json, print_table)


if __name__ == "__main__":
    main()
