"""W-CPU throughput benchmark (see /work/shared/BENCHMARKS.md).

    python -m benchmarks.w_cpu [--scale 1.0] [--repeats 1] [--json out.json]
                               [--skip-asyncllm] [--skip-peers] [--with-cb] ...

Engines, all on the random-weight ``cpu-llama`` checkpoint (float32) and the same W-CPU requests:
  asyncllm             ``LLM.generate`` on all requests at once (greedy, ignore_eos, max_tokens = output length).
  hf-static            transformers ``generate`` in static batches of 32 (left padding + attention mask, greedy,
                       every batch runs to its longest request; only requested tokens count).
  hf-continuous        transformers continuous batching (``init_continuous_batching`` + ``add_request``); opt-in
                       with ``--with-cb`` because it is slow on CPU.

Throughput = requested output tokens / wall time from submission to the last token (prefill included), median of
``--repeats`` runs (each engine gets one untimed warm-up first unless ``--no-warmup``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable

from benchmarks.common import (
    CPU_LLAMA_SPEC,
    EOS_ID,
    PAD_ID,
    Workload,
    build_cpu_llama,
    machine_info,
    measure_matmul_gflops,
    roofline,
    w_cpu_workload,
)

STATIC_BATCH_SIZE = 32
ENGINE_ASYNCLLM = "asyncllm"
ENGINE_STATIC = "hf-static"
ENGINE_CB = "hf-continuous"
REFERENCE = ENGINE_STATIC


def log(msg: str) -> None:
    print(f"[w_cpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def heartbeat(label: str, every: float = 15.0):
    """Print a line every ``every`` seconds while a long, silent call runs."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def run() -> None:
        while not stop.wait(every):
            log(f"  ... {label}: {time.perf_counter() - t0:.0f}s elapsed")

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


# --------------------------------------------------------------------------------------------------------------------
# Engines. Each runner is built once (model load not timed) and then called per repeat; a call returns
# (wall seconds, generated token ids per request in workload order).
# --------------------------------------------------------------------------------------------------------------------

Runner = Callable[[Workload, bool], tuple[float, list[list[int]]]]


def make_asyncllm_runner(model_dir: str, llm_kwargs: dict[str, Any]) -> Runner:
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
    try:
        has_tqdm = "use_tqdm" in inspect.signature(llm.generate).parameters
    except (TypeError, ValueError):
        has_tqdm = False

    def run(w: Workload, progress: bool) -> tuple[float, list[list[int]]]:
        prompts = [list(r.prompt_token_ids) for r in w.requests]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
        extra = {"use_tqdm": True} if (progress and has_tqdm) else {}
        with heartbeat("asyncllm generate") if (progress and not has_tqdm) else _null():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, **extra)
            dt = time.perf_counter() - t0
        return dt, [list(o.outputs[0].token_ids) for o in outs]

    run.engine = llm  # type: ignore[attr-defined]
    return run


@contextmanager
def _null():
    yield


def _load_hf_model(model_dir: str, attn: str = "sdpa"):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _quiet_cb_logger()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


class _DropPsutilNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


def _quiet_cb_logger() -> None:
    """transformers' continuous batching logs an ERROR (and a warning) on CPU when psutil is missing although it
    carries on fine; the cache is sized explicitly here, so drop that noise."""
    lg = logging.getLogger("ContinuousBatchingLogger")
    if not any(isinstance(f, _DropPsutilNoise) for f in lg.filters):
        lg.addFilter(_DropPsutilNoise())


class _StepProgress:
    """A ``generate`` streamer that only advances a tqdm bar by the requested tokens produced at each step."""

    def __init__(self, bar: Any, max_tokens: list[int]) -> None:
        self.bar, self.max_tokens, self.step = bar, max_tokens, 0

    def put(self, value: Any) -> None:
        if getattr(value, "dim", lambda: 1)() > 1:  # the prompt, pushed once before decoding
            return
        self.step += 1
        self.bar.update(sum(1 for m in self.max_tokens if m >= self.step))

    def end(self) -> None:
        pass


def make_static_runner(model_dir: str, batch_size: int = STATIC_BATCH_SIZE) -> Runner:
    import torch

    model = _load_hf_model(model_dir)

    def run(w: Workload, progress: bool) -> tuple[float, list[list[int]]]:
        from tqdm.auto import tqdm

        reqs = w.requests
        batches = [list(range(i, min(i + batch_size, len(reqs)))) for i in range(0, len(reqs), batch_size)]
        outputs: list[list[int]] = [[] for _ in reqs]
        bar = tqdm(total=w.output_tokens, desc=ENGINE_STATIC, unit="tok", disable=not progress, file=sys.stdout)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for idx in batches:
                plen = max(reqs[i].prompt_len for i in idx)
                new = max(reqs[i].max_tokens for i in idx)
                ids = torch.full((len(idx), plen), PAD_ID, dtype=torch.long)
                mask = torch.zeros((len(idx), plen), dtype=torch.long)
                for row, i in enumerate(idx):  # left padding
                    p = reqs[i].prompt_token_ids
                    ids[row, plen - len(p) :] = torch.tensor(p, dtype=torch.long)
                    mask[row, plen - len(p) :] = 1
                out = model.generate(
                    streamer=_StepProgress(bar, [reqs[i].max_tokens for i in idx]) if progress else None,
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=False,
                    max_new_tokens=new,
                    min_new_tokens=new,  # with eos suppressed until then: ignore_eos
                    pad_token_id=PAD_ID,
                    eos_token_id=EOS_ID,
                )
                for row, i in enumerate(idx):
                    outputs[i] = out[row, plen : plen + reqs[i].max_tokens].tolist()
        dt = time.perf_counter() - t0
        bar.close()
        return dt, outputs

    return run


def make_cb_runner(model_dir: str, page_size: int, max_batch_tokens: int) -> Runner:
    import torch
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = _load_hf_model(model_dir)

    def run(w: Workload, progress: bool) -> tuple[float, list[list[int]]]:
        from tqdm.auto import tqdm

        # Size the paged cache for the whole workload at once (the default sizes it from total RAM, and its attention
        # masks scale with the cache size, which is needlessly slow on CPU).
        num_blocks = sum(math.ceil((r.prompt_len + r.max_tokens) / page_size) for r in w.requests) + 2
        cb_config = ContinuousBatchingConfig(
            page_size=page_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_memory_percent=0.5,
            allow_block_sharing=False,
            seed=0,
        )
        gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(r.max_tokens for r in w.requests),
            eos_token_id=-1,
            pad_token_id=PAD_ID,
        )
        with torch.inference_mode():
            mgr = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
            mgr.start()
            try:
                bar = tqdm(total=len(w.requests), desc=ENGINE_CB, unit="req", disable=not progress, file=sys.stdout)
                t0 = time.perf_counter()
                rids = [
                    mgr.add_request(list(r.prompt_token_ids), max_new_tokens=r.max_tokens, eos_token_id=-1)
                    for r in w.requests
                ]
                results: dict[str, Any] = {}
                while len(results) < len(rids):
                    res = mgr.get_result(timeout=1.0)
                    if res is None:
                        if not mgr.is_running():
                            raise RuntimeError("transformers continuous batching thread stopped unexpectedly")
                        continue
                    if res.is_finished():
                        if res.error is not None:
                            raise RuntimeError(f"continuous batching request {res.request_id} failed: {res.error}")
                        results[res.request_id] = res
                        bar.update(1)
                dt = time.perf_counter() - t0
                bar.close()
            finally:
                mgr.stop(block=True, timeout=10)
                mgr.destroy()
        return dt, [list(results[rid].generated_tokens) for rid in rids]

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


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="shrink the workload (requests and lengths); 1.0 = W-CPU")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine; the median is reported")
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
    p.add_argument("--no-progress", action="store_true", help="no progress bars / heartbeat lines")
    args = p.parse_args(argv)
    if args.skip_asyncllm and args.skip_peers:
        p.error("--skip-asyncllm and --skip-peers leave nothing to run")
    try:
        args.llm_kwargs = json.loads(args.llm_kwargs)
        assert isinstance(args.llm_kwargs, dict)
    except (ValueError, AssertionError):
        p.error("--llm-kwargs must be a JSON object")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    progress = not args.no_progress
    load_start = _loadavg()
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load_start and load_start[0] > 0.5 * ncpu:
        log(
            f"WARNING: the machine is busy (1-min load {load_start[0]:.1f} on {ncpu} CPUs); CPU thread pools "
            "oversubscribe badly, so figures from this run may be far too low"
        )

    model_dir = str(args.model_dir or build_cpu_llama(args.cache_dir))
    workload = w_cpu_workload(CPU_LLAMA_SPEC["vocab_size"], scale=args.scale)
    ws = workload.summary()
    log(
        f"workload W-CPU scale={args.scale}: {ws['num_requests']} requests, {ws['prompt_tokens']} prompt + "
        f"{ws['output_tokens']} output tokens; model {model_dir}; torch threads {torch.get_num_threads()}"
    )
    gflops_runs = [measure_matmul_gflops()] if args.gflops is None else []
    if gflops_runs:
        log(f"matmul: {gflops_runs[0]:.1f} GFLOP/s (float32 1024^3, best of 10; measured again at the end)")
    # A tiny workload for warm-ups (lazy init, allocator, first-call overheads), same model.
    warm = w_cpu_workload(CPU_LLAMA_SPEC["vocab_size"], scale=0.05, seed=1)

    factories: list[tuple[str, Callable[[], Runner]]] = []
    if not args.skip_asyncllm:
        factories.append((ENGINE_ASYNCLLM, lambda: make_asyncllm_runner(model_dir, args.llm_kwargs)))
    if not args.skip_peers:
        factories.append((ENGINE_STATIC, lambda: make_static_runner(model_dir, args.static_batch_size)))
        if args.with_cb:
            factories.append(
                (ENGINE_CB, lambda: make_cb_runner(model_dir, args.cb_page_size, args.cb_max_batch_tokens))
            )

    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Runner] = {}
    for name, factory in factories:
        entry: dict[str, Any] = {"engine": name, "status": "ok", "wall_s": [], "error": None}
        results[name] = entry
        try:
            t0 = time.perf_counter()
            runners[name] = factory()
            entry["setup_s"] = time.perf_counter() - t0
            if not args.no_warmup:
                log(f"{name}: warm-up ({len(warm.requests)} short requests)")
                runners[name](warm, False)
        except Exception as e:  # noqa: BLE001 - report and carry on with the other engines
            entry.update(status="error", error=f"{type(e).__name__}: {e}")
            log(f"{name}: FAILED to start: {entry['error']}")
            if not isinstance(e, RuntimeError) or "cannot import asyncllm" not in str(e):
                traceback.print_exc()
            runners.pop(name, None)

    outputs: dict[str, list[list[int]]] = {}
    # Interleave engines within each repeat so that machine noise hits them alike.
    for rep in range(args.repeats):
        for name, runner in list(runners.items()):
            entry = results[name]
            log(f"{name}: run {rep + 1}/{args.repeats} ...")
            try:
                dt, outs = runner(workload, progress)
            except Exception as e:  # noqa: BLE001
                entry.update(status="error", error=f"{type(e).__name__}: {e}")
                log(f"{name}: FAILED: {entry['error']}")
                traceback.print_exc()
                runners.pop(name)
                continue
            entry["wall_s"].append(dt)
            outputs[name] = outs
            got = [len(o) for o in outs]
            want = [r.max_tokens for r in workload.requests]
            entry["generated_tokens"] = sum(got)
            entry["length_mismatches"] = sum(1 for g, t in zip(got, want) if g != t)
            if entry["length_mismatches"]:
                log(f"{name}: WARNING {entry['length_mismatches']} requests did not return max_tokens tokens")
            log(f"{name}: run {rep + 1}: {dt:.2f}s, {workload.output_tokens / dt:.1f} tok/s")

    # Roofline: the best matmul rate seen before and after the runs (the machine is shared and noisy), unless pinned.
    if args.gflops is None:
        gflops_runs.append(measure_matmul_gflops())
        gflops = max(gflops_runs)
    else:
        gflops = args.gflops
    roof = roofline(workload, gflops)
    roof["gflops_source"] = "--gflops" if args.gflops is not None else "measured"
    roof["gflops_measurements"] = gflops_runs
    log(
        f"roofline: {roof['total_flops'] / 1e12:.3f} TFLOP at {gflops:.1f} GFLOP/s matmul -> floor "
        f"{roof['floor_seconds']:.2f}s = {roof['roofline_tokens_per_s']:.0f} tok/s"
    )

    # Figures.
    for name, entry in results.items():
        if entry["wall_s"]:
            entry["median_wall_s"] = statistics.median(entry["wall_s"])
            entry["tokens_per_s"] = workload.output_tokens / entry["median_wall_s"]
            entry["tokens_per_s_runs"] = [workload.output_tokens / t for t in entry["wall_s"]]
            entry["best_tokens_per_s"] = max(entry["tokens_per_s_runs"])
            entry["roofline_share"] = entry["tokens_per_s"] / roof["roofline_tokens_per_s"]
            if entry["status"] == "error":
                entry["status"] = "partial"
    ref = results.get(REFERENCE, {}).get("tokens_per_s")
    for name, entry in results.items():
        tps = entry.get("tokens_per_s")
        entry["ratio_to_hf_static"] = (tps / ref) if (tps and ref) else None
        if name != REFERENCE and name in outputs and REFERENCE in outputs:
            entry["greedy_prefix8_agreement_with_hf_static"] = _agreement(outputs[name], outputs[REFERENCE])
            entry["greedy_full_agreement_with_hf_static"] = _agreement(outputs[name], outputs[REFERENCE], 10**9)

    # Table.
    print()
    print(f"tok/s = median of {args.repeats} run(s); best = fastest run; roofline = share of the compute floor")
    hdr = f"{'engine':<15} {'tok/s':>9} {'best':>9} {'wall s':>8} {'x hf-static':>12} {'roofline':>9}  status"
    print(hdr)
    print("-" * len(hdr))
    nan = float("nan")
    for name, e in results.items():
        tps = e.get("tokens_per_s")
        ratio = e.get("ratio_to_hf_static")
        share = f"{100 * e['roofline_share']:.1f}%" if "roofline_share" in e else "-"
        ratio_s = f"{ratio:.2f}x" if ratio else "-"
        err = f": {e['error']}" if e["error"] else ""
        print(
            f"{name:<15} {tps if tps is not None else nan:>9.1f} {e.get('best_tokens_per_s', nan):>9.1f} "
            f"{e.get('median_wall_s', nan):>8.2f} {ratio_s:>12} {share:>9}  {e['status']}{err}"
        )
    print(
        f"{'roofline':<15} {roof['roofline_tokens_per_s']:>9.1f} {'':>9} {roof['floor_seconds']:>8.2f} {'':>12} "
        f"{'100.0%':>9}  ({gflops:.0f} GFLOP/s matmul, {roof['total_flops'] / 1e12:.3f} TFLOP)"
    )
    print("targets (BENCHMARKS.md): asyncllm >= 3x hf-static and >= 60% of roofline", flush=True)

    report = {
        "benchmark": "W-CPU",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [sys.executable, "-m", "benchmarks.w_cpu", *(sys.argv[1:] if argv is None else argv)],
        "args": {k: v for k, v in vars(args).items()},
        "machine": {
            **machine_info(),
            "torch_num_threads": torch.get_num_threads(),
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
        },
        "model": {"name": "cpu-llama", "dir": model_dir, "config": CPU_LLAMA_SPEC, "dtype": "float32"},
        "workload": ws,
        "roofline": roof,
        "reference": REFERENCE,
        "results": results,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {args.json}")

    ok = all(e["status"] == "ok" for e in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
