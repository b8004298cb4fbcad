"""W-GPU throughput benchmark (workloads: docs/benchmarks.md): asyncllm against transformers'
continuous batching on the same GPU, and against the roofline.

    python -m benchmarks.w_gpu --out DIR [--budget-s 420] [--repeats 2] [--skip-peer] [--scale 1.0]

Model: ``qwen3-0.6b-shape`` (Qwen3Config with Qwen3-0.6B's shape), random bfloat16 weights built on
the GPU with transformers (seed 0), saved with the local toy tokenizer (generated ids beyond its
vocabulary decode to nothing; throughput counts tokens, not text).
Workload: nano-vllm's bench: ``random.seed(0)``; per request ``randint(100, 1024)`` prompt length,
then ``randint(0, 10000)`` ids; then all output lengths ``randint(100, 1024)``; temperature 0.6,
ignore_eos, max_model_len 4096 (142,827 prompt / 133,966 output tokens).
Throughput = requested output tokens / wall time from submission to the last token (prefill included).

The run keeps to ``--budget-s``: the transformers peer gets what is left (its deadline is recorded;
when it cannot finish, its throughput is that of the tokens it produced by the deadline, and the
JSON says ``truncated``). ``DIR/w_gpu.json`` is rewritten after every phase, so a run that is cut
short still leaves its figures.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import Request, Workload, machine_info, matmul_params
from benchmarks.measure import write_report

QWEN3_06B: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960,
    rms_norm_eps=1e-6)
MAX_MODEL_LEN = 4096
# --smoke: the same script end to end on CPU in a minute (a tiny model, a few requests); checks the
# driver, not performance.
SMOKE_SHAPE: dict[str, Any] = dict(QWEN3_06B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, intermediate_size=128, vocab_size=10240)
DEVICE = "cuda"
# (HBM bytes/s, dense bf16 FLOP/s) by device name; BENCHMARKS.md's H200 figures are the default.
GPU_PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12), "A100": (2.0e12, 312e12)}
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[w_gpu {time.perf_counter() - _T0:6.1f}s] {msg}", flush=True)


def w_gpu_workload(scale: float = 1.0) -> Workload:
    """nano-vllm's bench order: prompt lengths and ids request by request, then output lengths."""
    rng = random.Random(0)
    n = max(1, round(256 * scale))
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outputs = [rng.randint(100, 1024) for _ in range(n)]
    return Workload("W-GPU", [Request(p, o) for p, o in zip(prompts, outputs)], scale,
                    {"temperature": 0.6, "ignore_eos": True, "max_model_len": MAX_MODEL_LEN})


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model(out_dir: Path, shape: dict[str, Any]):
    """Random bf16 qwen3-0.6b-shape on the GPU, saved (with the toy tokenizer) for asyncllm to load."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncllm.toy.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_tokenizer

    config = Qwen3Config(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return model


# ---- engines: each returns (wall seconds, generated token counts) -----------------------------------

def asyncllm_runner(model_dir: Path, **engine_kwargs) -> tuple[Any, Callable[[Workload], tuple[float, list[int]]]]:
    from asyncllm import LLM, SamplingParams

    kwargs = dict(dtype="bfloat16", device=DEVICE, max_model_len=MAX_MODEL_LEN, max_num_seqs=256,
                  enable_prefix_caching=False, **engine_kwargs)  # repeats must not hit the last run's prefixes
    llm = LLM(str(model_dir), **kwargs)

    def run(w: Workload) -> tuple[float, list[int]]:
        params = [SamplingParams(temperature=0.6, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
        _sync()
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in w.requests], params, use_tqdm=False)
        return time.perf_counter() - t0, [len(o.outputs[0].token_ids) for o in outs]

    return llm, run


def cb_config(auto_flash: bool):
    """transformers' ContinuousBatchingConfig with the fields this version has (5.17 has no
    ``auto_switch_to_flash``; 5.24 has it); ``(config, fields dropped)``."""
    from transformers.generation import ContinuousBatchingConfig

    wanted = {"allow_block_sharing": False, "seed": 0, "auto_switch_to_flash": auto_flash}
    known = set(inspect.signature(ContinuousBatchingConfig).parameters)  # a dataclass's fields, or any class's arguments
    return (ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in known}),
            sorted(set(wanted) - known))


def hf_cb_run(model, w: Workload, deadline_s: float, auto_flash: bool) -> dict[str, Any]:
    """transformers continuous batching (defaults sized from GPU memory), streamed so that the
    tokens produced by the deadline are known even when the run cannot finish."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, eos_token_id=-1,
                           pad_token_id=2, max_new_tokens=max(r.max_tokens for r in w.requests))
    cb, dropped = cb_config(auto_flash)
    t0 = time.perf_counter()
    # no_grad, not inference_mode: transformers' generation thread (5.17) updates tensors made
    # here in place, which inference tensors forbid outside inference mode
    with torch.no_grad():
        mgr = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        if hasattr(mgr, "warmup"):
            mgr.warmup()  # captures its CUDA graphs before the clock starts
        mgr.start()
        setup_s = time.perf_counter() - t0
        try:
            result = _drain(mgr, w, deadline_s)
        finally:
            mgr.stop(block=True, timeout=30, hard_stop=True)
            mgr.destroy()
    result["setup_s"] = setup_s
    result["config_fields_missing"] = dropped
    result["attn_implementation"] = str(getattr(model.config, "_attn_implementation", "?"))
    return result


def _drain(mgr, w: Workload, deadline_s: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    ids = [mgr.add_request(list(r.prompt_token_ids), max_new_tokens=r.max_tokens, streaming=True,
                           eos_token_id=-1) for r in w.requests]
    produced = dict.fromkeys(ids, 0)
    finished: set[str] = set()
    last = t0
    while len(finished) < len(ids) and time.perf_counter() - t0 < deadline_s:
        res = mgr.get_result(timeout=0.5)
        if res is None:
            if not mgr.is_running():
                raise RuntimeError("transformers continuous batching stopped unexpectedly")
            continue
        if res.error is not None:
            raise RuntimeError(f"request {res.request_id} failed: {res.error}")
        produced[res.request_id] = max(produced[res.request_id], len(res.generated_tokens))
        last = time.perf_counter()
        if res.is_finished():
            finished.add(res.request_id)
    tokens = sum(produced.values())
    return {"wall_s": last - t0, "tokens": tokens, "tokens_per_s": tokens / max(last - t0, 1e-9),
            "requests_finished": len(finished), "truncated": len(finished) < len(ids), "deadline_s": deadline_s}


# ---- roofline ----------------------------------------------------------------------------------------

def gpu_roofline(w: Workload, device_name: str) -> dict[str, Any]:
    """Floor of an ideal schedule: every prompt prefilled at peak FLOP/s, then all requests decode
    together, each step costing max(bytes / bandwidth, flops / peak) with bytes = weights + every
    live sequence's KV, flops = 2 * batch * params + 4 * context * layers * heads * head_dim."""
    name = next((k for k in GPU_PEAKS if k in device_name), None)
    bandwidth, peak = GPU_PEAKS[name or "H200"]
    cfg = QWEN3_06B
    params = matmul_params(cfg)
    layers, heads, kv_heads, hd = (cfg[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "head_dim"))
    weight_bytes, kv_token_bytes, attn = 2 * params, 2 * layers * kv_heads * hd * 2, 4 * layers * heads * hd
    prompt_tokens = sum(r.prompt_len for r in w.requests)
    prompt_ctx = sum(r.prompt_len * (r.prompt_len + 1) // 2 for r in w.requests)
    prefill_s = max((2 * params * prompt_tokens + attn * prompt_ctx) / peak, weight_bytes / bandwidth)
    decode_s, kv_bytes = 0.0, 0.0
    for step in range(1, max(r.max_tokens for r in w.requests)):
        live = [r.prompt_len + step for r in w.requests if r.max_tokens > step]
        ctx = sum(live)
        kv_bytes += ctx * kv_token_bytes
        decode_s += max((weight_bytes + ctx * kv_token_bytes) / bandwidth, (2 * len(live) * params + attn * ctx) / peak)
    floor_s = prefill_s + decode_s
    return {"gpu_assumed": name or "H200 (unknown device: BENCHMARKS.md figures)", "hbm_bytes_per_s": bandwidth,
            "peak_flops": peak, "matmul_params": params, "kv_read_bytes": kv_bytes, "floor_s": floor_s,
            "prefill_floor_s": prefill_s, "roofline_tokens_per_s": w.output_tokens / floor_s}


# ---- driver ------------------------------------------------------------------------------------------

class Report:
    """The JSON report, rewritten after every phase."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path, self.deadline = path, _T0 + budget_s
        self.data: dict[str, Any] = {"benchmark": "W-GPU", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                     "budget_s": budget_s, "notes": []}

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def save(self) -> None:
        self.data["elapsed_s"] = time.perf_counter() - _T0
        write_report(self.path, self.data)


def bench_asyncllm(model_dir: Path, w: Workload, args, report: Report) -> None:
    t0 = time.perf_counter()
    llm, run = asyncllm_runner(model_dir, kv_cache_memory=int(args.kv_gib * 2**30),
                               attention_backend=args.backend, enable_cuda_graphs=not args.no_graphs)
    runner = llm.engine.runner
    entry: dict[str, Any] = {"setup_s": time.perf_counter() - t0, "backend": runner.backend.name,
                             "cuda_graph_buckets": runner.cuda_graphs.buckets if runner.cuda_graphs else None,
                             "kv_blocks": runner.num_blocks, "wall_s": []}
    report.data["asyncllm"] = entry
    report.save()  # a run cut short after set-up still says how far it got
    log(f"asyncllm ready in {entry['setup_s']:.1f}s ({entry['backend']}, graphs {entry['cuda_graph_buckets']})")
    t0 = time.perf_counter()
    run(Workload("warm-up", [Request(r.prompt_token_ids, 32) for r in w.requests[:16]]))
    entry["warmup_s"] = time.perf_counter() - t0
    report.save()
    for rep in range(args.repeats):
        if rep and report.remaining() < entry["wall_s"][-1] + args.peer_reserve_s:
            report.data["notes"].append(f"asyncllm: {rep} run(s) only, to keep the time budget")
            break
        dt, counts = run(w)
        entry["wall_s"].append(dt)
        entry["length_mismatches"] = sum(c != r.max_tokens for c, r in zip(counts, w.requests))
        entry["tokens_per_s"] = w.output_tokens / statistics.median(entry["wall_s"])
        log(f"asyncllm run {rep + 1}: {dt:.2f}s, {w.output_tokens / dt:,.0f} tok/s")
        report.save()
    entry["stats"] = llm.stats()
    if runner.cuda_graphs is not None and report.remaining() > args.peer_reserve_s + 60:
        graphs_ablation(model_dir, w, run, args, report)
    del llm, run


def graphs_ablation(model_dir: Path, w: Workload, graph_run, args, report: Report) -> None:
    """A decode-heavy slice of the workload with CUDA graphs on (the engine above) and off."""
    small = Workload("W-GPU slice", [Request(r.prompt_token_ids[:128], 128) for r in w.requests[:64]])
    entry: dict[str, Any] = {"workload": "first 64 requests, prompts cut to 128 tokens, 128 output tokens"}
    entry["graphs_wall_s"] = graph_run(small)[0]
    eager, eager_run = asyncllm_runner(model_dir, kv_cache_memory=8 * 2**30, enable_cuda_graphs=False,
                                       attention_backend=args.backend)
    eager_run(Workload("warm-up", small.requests[:4]))
    entry["eager_wall_s"] = eager_run(small)[0]
    entry["graphs_speedup"] = entry["eager_wall_s"] / entry["graphs_wall_s"]
    report.data["cuda_graphs_ablation"] = entry
    log(f"graphs ablation: {entry['graphs_wall_s']:.2f}s with, {entry['eager_wall_s']:.2f}s without")
    report.save()
    del eager, eager_run


def bench_peer(hf_model, w: Workload, args, report: Report) -> None:
    deadline = max(30.0, min(args.peer_timeout, report.remaining() - 45))
    log(f"transformers continuous batching: deadline {deadline:.0f}s")
    try:
        result = hf_cb_run(hf_model, w, deadline, auto_flash=True)
    except Exception as e:  # noqa: BLE001 - e.g. a flash kernel that would need the hub: retry on sdpa
        if "auto_switch_to_flash" in cb_config(True)[1]:
            raise  # this version has no flash switch: a retry would run the same configuration
        report.data["notes"].append(f"peer with auto_switch_to_flash failed ({type(e).__name__}: {e}); sdpa used")
        deadline = max(30.0, min(args.peer_timeout, report.remaining() - 30))
        result = hf_cb_run(hf_model, w, deadline, auto_flash=False)
    if result["truncated"]:
        report.data["notes"].append(
            f"peer did not finish within {deadline:.0f}s: its throughput is tokens produced by then / time")
    report.data["hf_continuous_batching"] = result
    report.save()
    log(f"peer: {result['tokens']:,} tokens in {result['wall_s']:.1f}s, {result['tokens_per_s']:,.0f} tok/s"
        f"{' (truncated)' if result['truncated'] else ''}")


def summarize(report: Report) -> None:
    d = report.data
    ours = d.get("asyncllm", {}).get("tokens_per_s")
    peer = d.get("hf_continuous_batching", {}).get("tokens_per_s")
    roof = d.get("roofline", {}).get("roofline_tokens_per_s")
    d["summary"] = {
        "asyncllm_tokens_per_s": ours, "peer_tokens_per_s": peer, "roofline_tokens_per_s": roof,
        "x_peer": ours / peer if ours and peer else None, "roofline_fraction": ours / roof if ours and roof else None,
        "targets": {"roofline_fraction>=0.5": bool(ours and roof and ours / roof >= 0.5),
                    "x_peer>=5": bool(ours and peer and ours / peer >= 5)}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w_gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for w_gpu.json")
    p.add_argument("--budget-s", type=float, default=420.0, help="wall-time budget for the whole benchmark")
    p.add_argument("--repeats", type=int, default=2, help="timed asyncllm runs (median reported), budget permitting")
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the 256 requests (1.0 = W-GPU)")
    p.add_argument("--kv-gib", type=float, default=64.0, help="asyncllm KV cache (the workload peaks near 60 GiB)")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--no-graphs", action="store_true", help="asyncllm without CUDA graphs")
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--peer-timeout", type=float, default=180.0, help="most seconds the peer's timed run may take")
    p.add_argument("--peer-reserve-s", type=float, default=150.0, help="time kept for the peer (init + run)")
    p.add_argument("--smoke", action="store_true", help="CPU dry run of the script: tiny model, 8 requests")
    args = p.parse_args(argv)
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.scale, args.kv_gib, args.backend, args.repeats = min(args.scale, 8 / 256), 0.25, "torch", 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "w_gpu.json", args.budget_s)
    w = w_gpu_workload(args.scale)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (smoke run on CPU)"
    report.data.update(workload=w.summary(), machine=machine_info(), gpu=gpu, roofline=gpu_roofline(w, gpu),
                       smoke=args.smoke)
    log(f"{w.summary()['num_requests']} requests, {w.prompt_tokens:,} prompt / {w.output_tokens:,} output tokens; "
        f"roofline {report.data['roofline']['roofline_tokens_per_s']:,.0f} tok/s")
    status = 0
    with tempfile.TemporaryDirectory(prefix="w_gpu-") as tmp:
        hf_model = build_model(Path(tmp), SMOKE_SHAPE if args.smoke else QWEN3_06B)
        log("model built and saved")
        report.save()
        for name, phase in (("asyncllm", lambda: bench_asyncllm(Path(tmp), w, args, report)),
                            ("peer", lambda: None if args.skip_peer else bench_peer(hf_model, w, args, report))):
            try:
                phase()
            except Exception as e:  # noqa: BLE001 - record, keep going, exit non-zero
                status = 1
                report.data.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
                log(f"{name} FAILED: {type(e).__name__}: {e}")
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            summarize(report)
            report.save()
    log(f"summary: {json.dumps(report.data['summary'])}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
