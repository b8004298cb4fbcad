"""W-PREFIX: 64 requests sharing a 192-token prefix, each with a distinct 32-token suffix, 32 output tokens;
time to first token and throughput with and without prefix caching (workloads: docs/benchmarks.md).

    python -m benchmarks.w_prefix [--scale 1.0] [--repeats 3] [--json out.json]

Two ``AsyncLLM`` engines on ``cpu-llama`` (float32), ``enable_prefix_caching=True`` and ``False``, built side by
side; the repeats alternate between them (in turn first), so the machine's mood hits both alike.
Warm-up: when all 64 requests arrive in the same step nothing is cached yet (the prefix is being computed by all of
them at once), so each engine first serves one request with the shared prefix (and a suffix of its own, one output
token) before the timed runs. Both modes get the same warm-up. Every repeat draws new suffixes, so only the
shared prefix can ever be found in the cache.
Timing is the consumer's: all requests are submitted at once, each streamed with ``stream_outputs``; a token's time
is when its delta reaches the stream. TTFT = first token - submission; ITL = gaps between a request's tokens;
percentiles over all requests (tokens) of all repeats. Throughput = requested output tokens / wall time (median).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

from benchmarks.common import Request, Workload, _scaled, build_cpu_llama
from benchmarks.measure import (
    MEMORY_METHOD, MemoryMeter, RunResult, finish_report, fmt_ms, latency_report, loadavg, model_config,
    split_latencies, summarize_ms, utc_now,
)

MODES = {"prefix-cache": True, "no-cache": False}
TARGET_TTFT_RATIO = 3.0
LATENCY_METHOD = ("consumer side: all requests submitted at once and streamed with AsyncLLM.stream_outputs; a token's "
                  "time is when its delta reaches the stream; TTFT = first token - submission, ITL = gaps between a "
                  "request's tokens; percentiles pooled over all requests of all repeats")
SIZES = {"full": [], "quick": ["--scale", "0.5", "--repeats", "1"], "tiny": ["--scale", "0.2", "--repeats", "1"]}


def prefix_workload(vocab_size: int, scale: float = 1.0, seed: int = 0, repeat: int = 0) -> Workload:
    """The shared prefix depends on ``seed`` only; the suffixes also on ``repeat``. Ids are U[10, vocab)."""
    n, prefix_len, suffix_len, out_len = (_scaled(x, scale) for x in (64, 192, 32, 32))
    prefix_rng, suffix_rng = random.Random(seed), random.Random(seed * 1000 + repeat + 1)
    prefix = [prefix_rng.randint(10, vocab_size - 1) for _ in range(prefix_len)]
    reqs = [Request(prefix + [suffix_rng.randint(10, vocab_size - 1) for _ in range(suffix_len)], out_len)
            for _ in range(n)]
    params = {"prefix_len": prefix_len, "suffix_len": suffix_len, "output_len": out_len, "seed": seed}
    return Workload("W-PREFIX", reqs, scale, params)


async def _stream_one(llm: Any, prompt: list[int], max_tokens: int, bar: Any) -> tuple[list[float], list[int]]:
    times: list[float] = []
    ids: list[int] = []
    async for delta in llm.stream_outputs(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True):
        now = time.perf_counter()
        new = delta.outputs[0].token_ids
        times.extend([now] * len(new))
        ids.extend(new)
        bar.update(len(new))
    return times, ids


async def timed_run(llm: Any, workload: Workload, label: str, progress: bool) -> RunResult:
    """Submit every request at once and stream them all; the prefix-cache counters of the run go in ``extra``."""
    from tqdm.auto import tqdm

    before = llm.stats()
    with tqdm(total=workload.output_tokens, desc=label, unit="tok", disable=not progress, file=sys.stdout) as bar:
        start = time.perf_counter()
        done = await asyncio.gather(*(_stream_one(llm, r.prompt_token_ids, r.max_tokens, bar)
                                      for r in workload.requests))
        wall = time.perf_counter() - start
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    extra = {"prefix_cache_queried_tokens": queries, "prefix_cache_hit_tokens": hits}
    return RunResult(wall, [ids for _, ids in done], start, [t for t, _ in done], "consumer (stream_outputs)", extra)


async def warm_up(llm: Any, workload: Workload, vocab_size: int) -> None:
    """One request with the shared prefix and a suffix no timed request has, so that only the prefix is cached."""
    prefix_len = workload.params["prefix_len"]
    rng = random.Random(-1)
    suffix = [rng.randint(10, vocab_size - 1) for _ in range(workload.params["suffix_len"])]
    await llm.generate(workload.requests[0].prompt_token_ids[:prefix_len] + suffix, temperature=0, max_tokens=1,
                       ignore_eos=True)


def summarize_mode(runs: list[RunResult], workload: Workload, meter: MemoryMeter) -> dict[str, Any]:
    """Median throughput, latency percentiles pooled over the runs, prefix-cache hit rate, memory."""
    walls = [r.wall_s for r in runs]
    ttfts, gaps = [], []
    for r in runs:
        t, g = split_latencies(r.start, r.token_times)
        ttfts += t
        gaps += g
    queried = sum(r.extra["prefix_cache_queried_tokens"] for r in runs)
    hits = sum(r.extra["prefix_cache_hit_tokens"] for r in runs)
    return {
        "wall_s": walls,
        "median_wall_s": statistics.median(walls),
        "tokens_per_s": workload.output_tokens / statistics.median(walls),
        "generated_tokens": sum(len(o) for o in runs[-1].outputs),
        "ttft_ms": summarize_ms(ttfts),
        "itl_ms": summarize_ms(gaps),
        "prefix_cache_hit_rate": (hits / queried) if queried else 0.0,
        "prefix_cache_hit_tokens": hits,
        "runs": [{"wall_s": r.wall_s, **latency_report(r.start, r.token_times), **r.extra} for r in runs],
        "memory": meter.report(),
    }


async def measure(model_dir: str, scale: float, repeats: int, progress: bool) -> dict[str, Any]:
    from asyncllm import AsyncLLM

    vocab = model_config(model_dir)["vocab_size"]
    engines, meters = {}, {}
    for mode, caching in MODES.items():
        meters[mode] = MemoryMeter()
        engines[mode] = AsyncLLM(model_dir, dtype="float32", device="cpu", enable_prefix_caching=caching)
        await warm_up(engines[mode], prefix_workload(vocab, scale), vocab)
        meters[mode].setup_done()
    runs: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    try:
        for rep in range(repeats):
            workload = prefix_workload(vocab, scale, repeat=rep)
            order = list(MODES) if rep % 2 == 0 else list(reversed(MODES))
            for mode in order:
                with meters[mode].run():
                    runs[mode].append(await timed_run(engines[mode], workload, f"{mode} {rep + 1}/{repeats}",
                                                      progress))
    finally:
        for llm in engines.values():
            await llm.aclose()
    results = {mode: summarize_mode(runs[mode], workload, meters[mode]) for mode in MODES}
    return {"workload": workload.summary(), "results": results, **_ratios(results)}


def _ratios(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    cached, uncached = results["prefix-cache"], results["no-cache"]
    div = lambda a, b: (a / b) if (a is not None and b) else None  # noqa: E731
    return {
        "ttft_p50_ratio": div(uncached["ttft_ms"]["p50"], cached["ttft_ms"]["p50"]),
        "ttft_p99_ratio": div(uncached["ttft_ms"]["p99"], cached["ttft_ms"]["p99"]),
        "throughput_ratio": div(cached["tokens_per_s"], uncached["tokens_per_s"]),
        "target": f"TTFT (p50) with caching at least {TARGET_TTFT_RATIO:g}x lower than without",
    }


def print_table(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(f"\nW-PREFIX: {w['num_requests']} requests, {w['prefix_len']}-token shared prefix + {w['suffix_len']}-token "
          f"suffix, {w['output_len']} output tokens; TTFT / ITL in ms over all repeats")
    hdr = (f"{'mode':<13} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
           f"{'cache hits':>10} {'peak MB':>8}")
    print(hdr)
    print("-" * len(hdr))
    for mode, r in report["results"].items():
        print(f"{mode:<13} {r['tokens_per_s']:>8.1f} {fmt_ms(r['ttft_ms']['p50']):>9} {fmt_ms(r['ttft_ms']['p99']):>9} "
              f"{fmt_ms(r['itl_ms']['p50']):>8} {fmt_ms(r['itl_ms']['p99']):>8} "
              f"{100 * r['prefix_cache_hit_rate']:>9.1f}% {fmt_ms(r['memory']['peak_rss_delta_mb']):>8}")
    ratio = report["ttft_p50_ratio"]
    print(f"TTFT p50 without / with caching: {ratio:.2f}x (target >= {TARGET_TTFT_RATIO:g}x); throughput with / "
          f"without: {report['throughput_ratio']:.2f}x", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_prefix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="shrink requests and lengths (1.0 = W-PREFIX)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per mode (median throughput)")
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    load_start = loadavg()
    model_dir = args.model_dir or str(build_cpu_llama())
    report = {"benchmark": "W-PREFIX", "date": utc_now(),
              "command": "python -m benchmarks.w_prefix " + " ".join(sys.argv[1:] if argv is None else argv)}
    report.update(asyncio.run(measure(model_dir, args.scale, args.repeats, not args.no_progress)))
    report["warmup"] = "one request with the shared prefix (own suffix, 1 output token) per engine, both modes"
    report["latency_measurement"] = LATENCY_METHOD
    report["memory_measurement"] = MEMORY_METHOD
    return finish_report(report, model_dir, load_start, args.json, print_table)


if __name__ == "__main__":
    main()
