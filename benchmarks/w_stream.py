"""W-STREAM: how streams feel while new prompts keep arriving (workloads: docs/benchmarks.md): inter-token latency
p50/p99/max, time to first token and throughput at concurrency 16 and 64, with the stall-free policy on
(``max_itl_ms="auto"``) and off (``max_itl_ms=None``, throughput mode).

    python -m benchmarks.w_stream [--levels 16,64] [--requests-per-client 4] [--repeats 2] [--scale 1.0]
                                  [--arrival-interval 0.25] [--json out.json]

Two ``AsyncLLM`` engines on ``cpu-llama`` (float32), one per policy, open side by side (the idle one sleeps); at every
level the same requests run through both, ``--repeats`` times in alternating order (throughput mode first, then
the policy first, ...), with the prefix cache emptied before each run; a mode's figures pool all its runs
(tokens/s = all tokens / all wall time, percentiles over every gap and first token).
Concurrency ``c`` means ``c`` closed-loop clients that join one every ``--arrival-interval`` seconds (client ``i``
begins at ``i * interval``; at 64 streams requests end, and so arrive, every ~0.34 s on the slower of the two VMs
of docs/benchmarks.md and every ~0.145 s on the faster one: the ramp adds to that), each streaming a request with ``stream_outputs`` and submitting its next one as soon as the previous
ends: prompts keep arriving while the other streams decode, without the all-at-once burst W-SCALE measures. Requests: prompt
length log-uniform in [16, 1024] tokens, output length uniform in [32, 256] (``random.Random(seed)``; ``--scale``
shrinks both ranges), ``requests-per-client * c`` of them. Latency is the consumer's: TTFT from the request's own
submission, ITL = gaps between its tokens. The policy run also records the step-time model's prediction of each
step it shaped against the step's measured time.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from typing import Any

from benchmarks.common import Request, Workload, build_cpu_llama
from benchmarks.measure import (
    finish_report, fmt_ms, loadavg, model_config, percentile, reset_prefix_cache, summarize_ms, utc_now,
)

DEFAULT_LEVELS = (16, 64)
MODES = {"throughput": None, "stall-free": "auto"}  # max_itl_ms of each engine
SIZES = {"full": [], "quick": ["--requests-per-client", "2", "--repeats", "1", "--scale", "0.5"],
         "tiny": ["--levels", "2,4", "--requests-per-client", "1", "--repeats", "2", "--scale", "0.05",
                  "--arrival-interval", "0.02"]}


def stream_workload(vocab_size: int, count: int, scale: float = 1.0, seed: int = 0) -> Workload:
    """``count`` requests: prompt length log-uniform in [16, 1024] * scale, output length U[32, 256] * scale, ids
    U[10, vocab). Draw order per request: prompt length, output length, then the prompt ids."""
    if scale <= 0:
        raise ValueError("scale must be > 0")
    rng = random.Random(seed)
    p_lo, p_hi = max(2, round(16 * scale)), max(3, round(1024 * scale))
    o_lo, o_hi = max(2, round(32 * scale)), max(3, round(256 * scale))
    reqs = []
    for _ in range(count):
        plen = int(round(math.exp(rng.uniform(math.log(p_lo), math.log(p_hi)))))
        olen = rng.randint(o_lo, o_hi)
        reqs.append(Request([rng.randint(10, vocab_size - 1) for _ in range(plen)], olen))
    return Workload("W-STREAM", reqs, scale, {"prompt_len_range": [p_lo, p_hi], "prompt_len_dist": "log-uniform",
                                              "output_len_range": [o_lo, o_hi], "seed": seed})


async def _client(llm: Any, delay: float, queue: list, results: list) -> None:
    """After ``delay`` seconds, take requests off the shared list until it is empty; record (submission time,
    token times)."""
    await asyncio.sleep(delay)
    while queue:
        index, req = queue.pop(0)
        start = time.perf_counter()
        times: list[float] = []
        async for delta in llm.stream_outputs(req.prompt_token_ids, temperature=0, max_tokens=req.max_tokens,
                                              ignore_eos=True):
            now = time.perf_counter()
            times.extend([now] * len(delta.outputs[0].token_ids))
        results[index] = (start, times)


class PredictionLog:
    """Wraps the engine's step-time model while installed: (predicted, measured) seconds of every step it learns."""

    def __init__(self, engine: Any) -> None:
        self.model = engine.step_time
        self.pairs: list[tuple[float, float]] = []

    def __enter__(self) -> "PredictionLog":
        observe = self.model.observe

        def recording(features, seconds):
            self.pairs.append((self.model.predict(features), seconds))
            observe(features, seconds)

        self.model.observe = recording
        return self

    def __exit__(self, *exc) -> None:
        del self.model.observe



def prediction_summary(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    """How well the step-time model predicted the steps: |predicted - measured| / measured, and the steps."""
    if not pairs:
        return {"steps": 0}
    errors = [abs(p - m) / m for p, m in pairs if m > 0]
    return {"steps": len(pairs), "median_abs_error_pct": round(100 * percentile(errors, 50), 1),
            "p90_abs_error_pct": round(100 * percentile(errors, 90), 1),
            "step_ms": summarize_ms([m for _, m in pairs])}


def _max_ms(values: list[float]) -> float | None:
    return round(1000 * max(values), 3) if values else None


async def run_once(llm: Any, workload: Workload, concurrency: int, interval: float) -> dict[str, Any]:
    """Serve ``workload`` with ``concurrency`` closed-loop clients joining ``interval`` seconds apart."""
    reset_prefix_cache(llm.engine)  # both policies serve the same requests: neither may start from the other's KV
    queue = list(enumerate(workload.requests))
    results: list[Any] = [None] * len(queue)
    steps_before = llm.engine.step_time.num_observed
    with PredictionLog(llm.engine) as log:
        start = time.perf_counter()
        await asyncio.gather(*(_client(llm, i * interval, queue, results) for i in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = [times[0] - t0 for t0, times in results if times]
    gaps = [b - a for _, times in results for a, b in zip(times, times[1:])]
    return {"requests": len(results), "generated_tokens": sum(len(times) for _, times in results), "wall_s": wall,
            "ttfts": ttfts, "gaps": gaps,
            "step_pairs": log.pairs if llm.engine.step_time.num_observed > steps_before else []}


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over all its runs at a level."""
    ttfts = [t for r in runs for t in r["ttfts"]]
    gaps = [g for r in runs for g in r["gaps"]]
    itl = summarize_ms(gaps)
    itl["max"] = _max_ms(gaps)
    ttft = summarize_ms(ttfts)
    ttft["max"] = _max_ms(ttfts)
    generated = sum(r["generated_tokens"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    return {
        "runs": len(runs),
        "requests": sum(r["requests"] for r in runs),
        "generated_tokens": generated,
        "wall_s": round(wall, 6),
        "tokens_per_s": generated / wall,
        "tokens_per_s_each_run": [round(r["generated_tokens"] / r["wall_s"], 1) for r in runs],
        "ttft_ms": ttft,
        "itl_ms": itl,
        "itl_p99_over_p50": round(itl["p99"] / itl["p50"], 2) if itl["p50"] else None,
        "step_time_model": prediction_summary([pair for r in runs for pair in r["step_pairs"]]),
    }


def compare(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's checks at one level: the policy run against throughput mode."""
    base, policy = runs["throughput"], runs["stall-free"]
    return {
        "throughput_ratio": _ratio(policy["tokens_per_s"], base["tokens_per_s"], 3),
        "ttft_p99_ratio": _ratio(policy["ttft_ms"]["p99"], base["ttft_ms"]["p99"], 2),
        "itl_p99_over_p50": policy["itl_p99_over_p50"],
        "itl_p99_ratio": _ratio(policy["itl_ms"]["p99"], base["itl_ms"]["p99"], 3),
    }


def _ratio(a: float | None, b: float | None, digits: int) -> float | None:
    """a / b, or None where either is missing or b is 0 (a run whose tokens all came in one chunk has no gaps:
    on a machine loaded from outside, a tiny run can)."""
    return round(a / b, digits) if a is not None and b else None


async def measure(model_dir: str, levels: list[int], per_client: int, scale: float, interval: float,
                  repeats: int) -> dict:
    from asyncllm import AsyncLLM

    vocab = model_config(model_dir)["vocab_size"]
    engines = {mode: AsyncLLM(model_dir, dtype="float32", device="cpu", max_itl_ms=itl) for mode, itl in MODES.items()}
    try:
        for llm in engines.values():
            await llm.generate([11] * 16, temperature=0, max_tokens=4, ignore_eos=True)  # warm-up
        rows = []
        for c in levels:
            workload = stream_workload(vocab, per_client * c, scale, seed=c)
            raw: dict[str, list] = {mode: [] for mode in engines}
            for repeat in range(repeats):
                order = list(engines) if repeat % 2 == 0 else list(reversed(engines))
                for mode in order:
                    raw[mode].append(await run_once(engines[mode], workload, c, interval))
            runs = {mode: pooled(raw[mode]) for mode in engines}
            rows.append({"concurrency": c, "requests": len(workload.requests), "workload": workload.summary(),
                         "runs": runs, "comparison": compare(runs)})
        from asyncllm.engine.step_time import describe

        model = describe(engines["stall-free"].engine.step_time)
    finally:
        for llm in engines.values():
            await llm.aclose()
    return {"levels": rows, "step_time_model": model}


def print_table(report: dict[str, Any]) -> None:
    print("\nW-STREAM: closed-loop clients joining over time, prompts 16-1024 tokens; latency in ms, consumer side")
    hdr = (f"{'conc.':>5} {'policy':>11} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
           f"{'ITL max':>8} {'p99/p50':>7}")
    print(hdr)
    print("-" * len(hdr))
    for level in report["levels"]:
        for mode, r in level["runs"].items():
            print(f"{level['concurrency']:>5} {mode:>11} {r['tokens_per_s']:>7.1f} {fmt_ms(r['ttft_ms']['p50']):>9} "
                  f"{fmt_ms(r['ttft_ms']['p99']):>9} {fmt_ms(r['itl_ms']['p50']):>8} {fmt_ms(r['itl_ms']['p99']):>8} "
                  f"{fmt_ms(r['itl_ms']['max']):>8} {r['itl_p99_over_p50'] or 0:>7.2f}")
        c = level["comparison"]
        print(f"      stall-free / throughput: tok/s x{c['throughput_ratio'] or 0:.3f}, "
              f"TTFT p99 x{c['ttft_p99_ratio'] or 0:.2f}")
    print("targets (issue 17): ITL p99 <= 4x p50; throughput >= 0.9x throughput mode; TTFT p99 <= 2x", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default=",".join(map(str, DEFAULT_LEVELS)), help="concurrency levels")
    parser.add_argument("--requests-per-client", type=int, default=4, help="requests per client (default 4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode per level (default 2)")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the prompt and output length ranges")
    parser.add_argument("--arrival-interval", type=float, default=0.25, help="seconds between client starts")
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="accepted for the suite runner; prints nothing")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.levels.split(",")]
        assert levels and min(levels) >= 1 and args.requests_per_client >= 1 and args.arrival_interval >= 0
        assert args.repeats >= 1
    except (ValueError, AssertionError):
        parser.error("--levels must be positive integers, --requests-per-client and --repeats >= 1, "
                     "--arrival-interval >= 0")
    load_start = loadavg()
    model_dir = args.model_dir or str(build_cpu_llama())
    report: dict[str, Any] = {"benchmark": "W-STREAM", "date": utc_now(),
                              "command": "python -m benchmarks.w_stream " + " ".join(sys.argv[1:] if argv is None
                                                                                      else argv)}
    report.update(asyncio.run(measure(model_dir, levels, args.requests_per_client, args.scale, args.arrival_interval,
                                        args.repeats)))
    report["measurement"] = __doc__.split("\n\n")[2].replace("\n", " ")
    return finish_report(report, model_dir, load_start, args.json, print_table)


if __name__ == "__main__":
    main()
