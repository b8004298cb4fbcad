"""W-CPU throughput benchmark (workloads: docs/benchmarks.md).

    python -m benchmarks.w_cpu [--scale 1.0] [--repeats 1] [--peer-repeats N] [--json out.json]
                               [--skip-asyncllm] [--skip-peers] [--with-cb] ...

Engines, all on the random-weight ``cpu-llama`` checkpoint (float32) and the same W-CPU requests:
  asyncllm             ``LLM.generate`` on all requests at once (greedy, ignore_eos, max_tokens = output length).
  hf-static            transformers ``generate`` in static batches of 32 (left padding + attention mask, greedy,
                       every batch runs to its longest request; only requested tokens count).
  hf-continuous        transformers continuous batching (``init_continuous_batching`` + ``add_request``); opt-in
                       with ``--with-cb`` because it is slow on CPU.

Throughput = requested output tokens / wall time from submission to the last token (prefill included), median of
``--repeats`` runs (each engine gets one untimed warm-up first unless ``--no-warmup``).
Latency, per request, from the run with the median wall time: time to first token = first token's time - the
submission of all requests; inter-token latency = gaps between a request's consecutive tokens. Token times:
asyncllm, the end of the engine step that produced the token (``EngineCore.step`` wrapped); hf-static, the end of
each ``generate`` step of the request's batch (a streamer); hf-continuous, transformers' own per-token timestamps.
asyncllm's prefix cache is emptied before each timed run (the repeats send the same prompts).
Peak memory: what the engine adds to the process's peak RSS (benchmarks/measure.py ``MemoryMeter``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

from benchmarks.common import Workload, build_cpu_llama, machine_info, measure_matmul_gflops, roofline, w_cpu_workload
from benchmarks.measure import (
    MEMORY_METHOD, MemoryMeter, RunResult, StepRecorder, fmt_ms, latency_report, loadavg, model_config,
    reset_prefix_cache, utc_now, write_report,
)
from benchmarks.peers import (  # noqa: F401 (re-exported: the peers used to live here)
    ENGINE_CB, ENGINE_STATIC, STATIC_BATCH_SIZE, Runner, make_cb_runner, make_static_runner,
)

ENGINE_ASYNCLLM = "asyncllm"
REFERENCE = ENGINE_STATIC
ASYNCLLM_TIMING = "end of the engine step that produced the token (EngineCore.step wrapped; LLM front)"
# Sizes for the runner (python -m benchmarks): extra arguments per size.
SIZES = {
    "full": ["--repeats", "3", "--peer-repeats", "1", "--with-cb"],
    "quick": ["--scale", "0.25", "--with-cb"],
    "tiny": ["--scale", "0.06", "--no-warmup", "--gflops", "100", "--with-cb", "--cb-page-size", "16"],
}


def log(msg: str) -> None:
    print(f"[w_cpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_asyncllm_runner(model_dir: str, llm_kwargs: dict[str, Any]) -> Runner:
    """``LLM.generate`` over all requests at once, with every token stamped at the end of its engine step."""
    try:
        from asyncllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001 - any import failure means the engine is not usable yet
        raise RuntimeError(
            f"cannot import asyncllm ({type(e).__name__}: {e}); is the package built? "
            "Run with --skip-asyncllm to benchmark the peers only."
        ) from e

    kwargs = {"dtype": "float32", "device": "cpu", **llm_kwargs}
    log(f"asyncllm: constructing LLM({model_dir!r}, {', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
    t0 = time.perf_counter()
    llm = LLM(model_dir, **kwargs)
    log(f"asyncllm: engine ready in {time.perf_counter() - t0:.1f}s")

    def run(w: Workload, progress: bool) -> RunResult:
        prompts = [list(r.prompt_token_ids) for r in w.requests]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
        reset = reset_prefix_cache(llm.engine)  # repeats send the same prompts: none may start from the last run's KV
        recorder = StepRecorder(llm.engine)
        with recorder.installed():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=progress)
            dt = time.perf_counter() - t0
        times = [recorder.token_times.get(o.request_id, []) for o in outs]
        extra = {"kv_utilization": recorder.kv_utilization(), "engine_steps": len(recorder.step_s),
                 "prefix_cache_reset": reset}
        return RunResult(dt, [list(o.outputs[0].token_ids) for o in outs], t0, times, ASYNCLLM_TIMING, extra)

    run.engine = llm  # type: ignore[attr-defined]
    return run


# --------------------------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------------------------


def _agreement(a: list[list[int]], b: list[list[int]], k: int = 8) -> float:
    """Share of requests whose first ``k`` generated tokens are identical (greedy; informational only, since float
    rounding can flip near-ties on random weights)."""
    if not a or len(a) != len(b):
        return float("nan")
    return sum(1 for x, y in zip(a, b) if x[:k] == y[:k]) / len(a)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="shrink the workload (requests and lengths); 1.0 = W-CPU")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the median is reported")
    p.add_argument("--peer-repeats", type=int, default=None,
                   help="timed runs of the transformers peers (default: --repeats); they are slow and steady")
    p.add_argument("--json", metavar="PATH", help="write all figures to this JSON file")
    p.add_argument("--model-dir", help="use this checkpoint dir instead of the cached cpu-llama build")
    p.add_argument(
        "--cache-dir",
        help="checkpoint directory to build/reuse cpu-llama in (default ~/.cache/asyncllm-bench/cpu-llama)",
    )
    p.add_argument("--skip-asyncllm", action="store_true", help="do not run asyncllm (peers only)")
    p.add_argument("--skip-peers", action="store_true", help="do not run the transformers peers")
    p.add_argument("--with-cb", action="store_true", help="also run transformers continuous batching (slow on CPU)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run of each engine")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave torch's default)")
    p.add_argument("--gflops", type=float, default=None, help="pin the matmul GFLOP/s used for the roofline")
    p.add_argument("--static-batch-size", type=int, default=STATIC_BATCH_SIZE)
    p.add_argument("--cb-page-size", type=int, default=64, help="page size for transformers continuous batching")
    p.add_argument("--cb-max-batch-tokens", type=int, default=512, help="token budget per CB step")
    p.add_argument(
        "--llm-kwargs",
        default="{}",
        help='extra JSON keyword arguments for asyncllm.LLM, e.g. \'{"max_num_batched_tokens": 512}\'',
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.skip_asyncllm and args.skip_peers:
        p.error("--skip-asyncllm and --skip-peers leave nothing to run")
    try:
        args.llm_kwargs = json.loads(args.llm_kwargs)
        assert isinstance(args.llm_kwargs, dict)
    except (ValueError, AssertionError):
        p.error("--llm-kwargs must be a JSON object")
    return args


def _factories(args: argparse.Namespace, model_dir: str) -> list[tuple[str, Callable[[], Runner]]]:
    factories: list[tuple[str, Callable[[], Runner]]] = []
    if not args.skip_asyncllm:
        factories.append((ENGINE_ASYNCLLM, lambda: make_asyncllm_runner(model_dir, args.llm_kwargs)))
    if not args.skip_peers:
        factories.append((ENGINE_STATIC, lambda: make_static_runner(model_dir, args.static_batch_size)))
        if args.with_cb:
            factories.append((ENGINE_CB, lambda: make_cb_runner(model_dir, args.cb_page_size,
                                                                 args.cb_max_batch_tokens)))
    return factories


def _start_engines(factories, warm: Workload, no_warmup: bool, results: dict) -> tuple[dict, dict]:
    """Build (and warm up) each engine; returns (runners, memory meters). Failures are recorded and skipped."""
    runners: dict[str, Runner] = {}
    meters: dict[str, MemoryMeter] = {}
    for name, factory in factories:
        entry: dict[str, Any] = {"engine": name, "status": "ok", "wall_s": [], "error": None, "runs": []}
        results[name] = entry
        meters[name] = MemoryMeter()
        try:
            t0 = time.perf_counter()
            runners[name] = factory()
            entry["setup_s"] = time.perf_counter() - t0
            if not no_warmup:
                log(f"{name}: warm-up ({len(warm.requests)} short requests)")
                runners[name](warm, False)
            meters[name].setup_done()
        except Exception as e:  # noqa: BLE001 - report and carry on with the other engines
            entry.update(status="error", error=f"{type(e).__name__}: {e}")
            log(f"{name}: FAILED to start: {entry['error']}")
            if not isinstance(e, RuntimeError) or "cannot import asyncllm" not in str(e):
                traceback.print_exc()
            runners.pop(name, None)
    return runners, meters


def _record_run(entry: dict, res: RunResult, workload: Workload) -> None:
    got = [len(o) for o in res.outputs]
    want = [r.max_tokens for r in workload.requests]
    entry["wall_s"].append(res.wall_s)
    entry["generated_tokens"] = sum(got)
    entry["length_mismatches"] = sum(1 for g, t in zip(got, want) if g != t)
    entry["timed_tokens"] = sum(len(t) for t in res.token_times)
    entry["runs"].append({"wall_s": res.wall_s, **latency_report(res.start, res.token_times), **res.extra})
    entry["latency_timing"] = res.timing
    if entry["length_mismatches"]:
        log(f"{entry['engine']}: WARNING {entry['length_mismatches']} requests did not return max_tokens tokens")


def _run_repeats(args, runners: dict, meters: dict, results: dict, workload: Workload) -> dict[str, list[list[int]]]:
    """Timed runs, engines interleaved within each repeat so that machine noise hits them alike."""
    outputs: dict[str, list[list[int]]] = {}
    peer_repeats = args.repeats if args.peer_repeats is None else args.peer_repeats
    for rep in range(max(args.repeats, peer_repeats)):
        for name, runner in list(runners.items()):
            if rep >= (args.repeats if name == ENGINE_ASYNCLLM else peer_repeats):
                continue
            log(f"{name}: run {rep + 1} ...")
            try:
                with meters[name].run():
                    res = runner(workload, not args.no_progress)
            except Exception as e:  # noqa: BLE001
                results[name].update(status="error", error=f"{type(e).__name__}: {e}")
                log(f"{name}: FAILED: {results[name]['error']}")
                traceback.print_exc()
                runners.pop(name)
                continue
            _record_run(results[name], res, workload)
            outputs[name] = res.outputs
            log(f"{name}: run {rep + 1}: {res.wall_s:.2f}s, {workload.output_tokens / res.wall_s:.1f} tok/s")
    return outputs


def _figures(results: dict, meters: dict, workload: Workload, roof: dict, outputs: dict) -> None:
    """Medians, latencies of the median run, memory, shares of the roofline and ratios to the peers."""
    for name, entry in results.items():
        entry["memory"] = meters[name].report()
        if not entry["wall_s"]:
            continue
        entry["median_wall_s"] = statistics.median(entry["wall_s"])
        entry["tokens_per_s"] = workload.output_tokens / entry["median_wall_s"]
        entry["tokens_per_s_runs"] = [workload.output_tokens / t for t in entry["wall_s"]]
        entry["best_tokens_per_s"] = max(entry["tokens_per_s_runs"])
        entry["roofline_share"] = entry["tokens_per_s"] / roof["roofline_tokens_per_s"]
        median_run = min(entry["runs"], key=lambda r: abs(r["wall_s"] - entry["median_wall_s"]))
        entry["ttft_ms"], entry["itl_ms"] = median_run["ttft_ms"], median_run["itl_ms"]
        if "kv_utilization" in median_run:
            entry["kv_utilization"] = median_run["kv_utilization"]
        if entry["status"] == "error":
            entry["status"] = "partial"
    for name, entry in results.items():
        tps = entry.get("tokens_per_s")
        for peer in (ENGINE_STATIC, ENGINE_CB):
            ref = results.get(peer, {}).get("tokens_per_s")
            entry[f"ratio_to_{peer.replace('-', '_')}"] = (tps / ref) if (tps and ref) else None
        if name != REFERENCE and name in outputs and REFERENCE in outputs:
            entry["greedy_prefix8_agreement_with_hf_static"] = _agreement(outputs[name], outputs[REFERENCE])
            entry["greedy_full_agreement_with_hf_static"] = _agreement(outputs[name], outputs[REFERENCE], 10**9)


def _print_table(results: dict, roof: dict, repeats: int) -> None:
    print()
    print(f"tok/s = median of up to {repeats} run(s); TTFT / ITL in ms (p50 / p99) from the median run; "
          "peak = peak RSS delta; roofline = share of the compute floor")
    hdr = (f"{'engine':<14} {'tok/s':>8} {'x static':>8} {'x CB':>6} {'roofline':>8} {'TTFT p50':>9} "
           f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'peak MB':>8}  status")
    print(hdr)
    print("-" * len(hdr))
    for name, e in results.items():
        tps = e.get("tokens_per_s")
        ratio = lambda r: f"{r:.2f}x" if r else "-"  # noqa: E731
        share = f"{100 * e['roofline_share']:.1f}%" if "roofline_share" in e else "-"
        ttft, itl = e.get("ttft_ms", {}), e.get("itl_ms", {})
        mem = e.get("memory", {}).get("peak_rss_delta_mb")
        err = f": {e['error']}" if e["error"] else ""
        print(f"{name:<14} {tps or float('nan'):>8.1f} {ratio(e.get('ratio_to_hf_static')):>8} "
              f"{ratio(e.get('ratio_to_hf_continuous')):>6} {share:>8} {fmt_ms(ttft.get('p50')):>9} "
              f"{fmt_ms(ttft.get('p99')):>9} {fmt_ms(itl.get('p50')):>8} {fmt_ms(itl.get('p99')):>8} "
              f"{fmt_ms(mem):>8}  {e['status']}{err}")
    print(f"{'roofline':<14} {roof['roofline_tokens_per_s']:>8.1f} {'':>8} {'':>6} {'100.0%':>8}  "
          f"({roof['matmul_gflops']:.0f} GFLOP/s matmul, {roof['total_flops'] / 1e12:.3f} TFLOP, "
          f"floor {roof['floor_seconds']:.2f}s)")
    print("targets (BENCHMARKS.md): asyncllm >= 3x hf-static and >= 60% of roofline", flush=True)


def _roofline(workload: Workload, cfg: dict, pinned: float | None, first: list[float]) -> dict:
    """The best matmul rate seen before and after the runs (the machine is shared and noisy), unless pinned."""
    runs = first + ([measure_matmul_gflops()] if pinned is None else [])
    gflops = pinned if pinned is not None else max(runs)
    roof = roofline(workload, gflops, cfg)
    roof["gflops_source"] = "--gflops" if pinned is not None else "measured"
    roof["gflops_measurements"] = runs
    log(f"roofline: {roof['total_flops'] / 1e12:.3f} TFLOP at {gflops:.1f} GFLOP/s matmul -> floor "
        f"{roof['floor_seconds']:.2f}s = {roof['roofline_tokens_per_s']:.0f} tok/s")
    return roof


def _methods(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """How each figure was measured, and the engines' entries."""
    return {
        "reference": REFERENCE,
        "latency_measurement": {
            ENGINE_ASYNCLLM: ASYNCLLM_TIMING,
            ENGINE_STATIC: results.get(ENGINE_STATIC, {}).get("latency_timing"),
            ENGINE_CB: results.get(ENGINE_CB, {}).get("latency_timing"),
            "definition": "TTFT = first token time - submission of all requests; ITL = gaps between a request's "
                          "consecutive tokens; percentiles over requests (TTFT) and tokens (ITL) of the median run",
        },
        "memory_measurement": MEMORY_METHOD,
        "results": results,
    }


def _preimport() -> None:
    """Import the engines' code before any memory is measured, so that no engine is charged for the imports."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    try:
        import asyncllm  # noqa: F401
        import asyncllm.engine.core  # noqa: F401
    except Exception:  # noqa: BLE001 - reported when the engine is built
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    _preimport()

    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = loadavg()
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load_start and load_start[0] > 0.5 * ncpu:
        log(f"WARNING: the machine is busy (1-min load {load_start[0]:.1f} on {ncpu} CPUs); CPU thread pools "
            "oversubscribe badly, so figures from this run may be far too low")
    model_dir = str(args.model_dir or build_cpu_llama(args.cache_dir))
    cfg = model_config(model_dir)
    workload = w_cpu_workload(cfg["vocab_size"], scale=args.scale)
    ws = workload.summary()
    log(f"workload W-CPU scale={args.scale}: {ws['num_requests']} requests, {ws['prompt_tokens']} prompt + "
        f"{ws['output_tokens']} output tokens; model {model_dir}; torch threads {torch.get_num_threads()}")
    gflops_first = [measure_matmul_gflops()] if args.gflops is None else []
    warm = w_cpu_workload(cfg["vocab_size"], scale=0.05, seed=1)  # lazy init, allocator, first-call overheads

    results: dict[str, dict[str, Any]] = {}
    runners, meters = _start_engines(_factories(args, model_dir), warm, args.no_warmup, results)
    outputs = _run_repeats(args, runners, meters, results, workload)
    roof = _roofline(workload, cfg, args.gflops, gflops_first)
    _figures(results, meters, workload, roof, outputs)
    _print_table(results, roof, max(args.repeats, args.peer_repeats or 0))

    report = {
        "benchmark": "W-CPU",
        "date": utc_now(),
        "command": [sys.executable, "-m", "benchmarks.w_cpu", *(sys.argv[1:] if argv is None else argv)],
        "args": dict(vars(args)),
        "machine": {**machine_info(), "torch_num_threads": torch.get_num_threads(),
                    "loadavg_start": load_start, "loadavg_end": loadavg()},
        "model": {"name": "cpu-llama" if not args.model_dir else "custom", "dir": model_dir, "config": cfg,
                  "dtype": "float32"},
        "workload": ws,
        "roofline": roof,
        **_methods(results),
    }
    if args.json:
        write_report(args.json, report)
        log(f"wrote {args.json}")
    return 0 if all(e["status"] == "ok" for e in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
