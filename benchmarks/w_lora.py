"""W-LORA: W-CPU's requests spread round-robin over 16 rank-16 adapters (all attention and MLP
projections) plus some base-model requests; throughput relative to the base model alone.

    python -m benchmarks.w_lora [--scale 1.0] [--adapters 16] [--rank 16] [--json out.json]

Both runs go through one ``LLM`` in the same process, alternating, so they share the machine's mood.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

from benchmarks.common import DEFAULT_CACHE_DIR, build_cpu_llama, w_cpu_workload
from benchmarks.measure import (
    StepRecorder, loadavg, model_config, reset_prefix_cache, split_latencies, summarize_ms, utc_now, write_report,
    machine_record,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_SHARE = 5  # every 5th request uses the base model
SIZES = {"full": [], "quick": ["--scale", "0.25", "--adapters", "4"],
         "tiny": ["--scale", "0.06", "--adapters", "2", "--rank", "4"]}


def build_adapters(model_dir: Path, count: int, rank: int, cache: Path) -> list[Path]:
    """``count`` PEFT adapters with random non-zero weights, built once and cached."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [cache / f"r{rank}-{i}" for i in range(count)]
    missing = [p for p in paths if not (p / "adapter_model.safetensors").exists()]
    if missing:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for path in missing:
            print(f"[w-lora] building adapter {path.name}", file=sys.stderr, flush=True)
            torch.manual_seed(int(path.name.split("-")[-1]))
            model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                    init_lora_weights=False))
            model.save_pretrained(path)
            base = model.unload()
    return paths


def adapter_cache(model_dir: Path) -> Path:
    """Adapters are built per base model: one cache folder per checkpoint (its path and config)."""
    key = f"{model_dir.resolve()}\n{(model_dir / 'config.json').read_text()}"
    return DEFAULT_CACHE_DIR / "lora" / hashlib.sha256(key.encode()).hexdigest()[:12]


def run_once(llm, workload, loras) -> tuple[float, float, list[list[float]]]:
    """(tokens/s, start, per-request token times at the end of the engine step that produced them)."""
    from asyncllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests]
    reset_prefix_cache(llm.engine)  # base and LoRA runs send the same prompts: no run may reuse another's KV
    recorder = StepRecorder(llm.engine)
    with recorder.installed():
        start = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in workload.requests], params, lora=loras)
        wall = time.perf_counter() - start
    times = [recorder.token_times.get(o.request_id, []) for o in outs]
    return workload.output_tokens / wall, start, times


def _latencies(runs: list[tuple[float, float, list[list[float]]]]) -> dict:
    ttfts, gaps = [], []
    for _, start, times in runs:
        t, g = split_latencies(start, times)
        ttfts += t
        gaps += g
    return {"ttft_ms": summarize_ms(ttfts), "itl_ms": summarize_ms(gaps),
            "timed_tokens": sum(len(t) for t in runs[-1][2])}


def measure(model_dir: str, scale: float, adapters: int, rank: int, repeats: int,
            adapter_dir: str | None = None) -> dict:
    from asyncllm import LLM, LoRARequest

    paths = build_adapters(Path(model_dir), adapters, rank, Path(adapter_dir or adapter_cache(Path(model_dir))))
    workload = w_cpu_workload(model_config(model_dir)["vocab_size"], scale=scale)
    loras = [None if i % BASE_SHARE == 0 else LoRARequest(f"a{i % adapters}", str(paths[i % adapters]))
             for i in range(len(workload.requests))]
    llm = LLM(model_dir, dtype="float32", max_loras=adapters, max_lora_rank=rank)
    llm.generate([[11] * 8] * 2, lora=[None, loras[1]])  # warm-up, and loads the first adapter
    base, mixed = [], []
    for i in range(repeats):
        base.append(run_once(llm, workload, [None] * len(loras)))
        mixed.append(run_once(llm, workload, loras))
        print(f"[w-lora] repeat {i + 1}/{repeats}: base {base[-1][0]:.0f} tok/s, lora {mixed[-1][0]:.0f} tok/s",
              file=sys.stderr, flush=True)
    base_tps = sorted(r[0] for r in base)[len(base) // 2]
    lora_tps = sorted(r[0] for r in mixed)[len(mixed) // 2]
    return {"benchmark": "W-LORA", "date": utc_now(),
            "workload": {**workload.summary(), "adapters": adapters, "rank": rank,
                         "base_requests": sum(x is None for x in loras)},
            "base_tokens_per_s": round(base_tps, 1), "lora_tokens_per_s": round(lora_tps, 1),
            "lora_vs_base": round(lora_tps / base_tps, 3),
            "runs": {"base": [r[0] for r in base], "lora": [r[0] for r in mixed]},
            "latency": {"base": _latencies(base), "lora": _latencies(mixed)},
            "latency_measurement": "end of the engine step that produced each token (LLM front); percentiles "
                                   "over all requests (TTFT) and tokens (ITL) of all repeats",
            "target": "LoRA throughput at least 70% of the base model's"}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--adapter-dir", help="where to build/reuse the adapters (default: a per-model cache folder)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    load_start = loadavg()
    result = measure(args.model_dir or str(build_cpu_llama()), args.scale, args.adapters, args.rank, args.repeats,
                     args.adapter_dir)
    result["machine"] = machine_record(load_start)
    result["command"] = "python -m benchmarks.w_lora " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"W-LORA: base {result['base_tokens_per_s']:.0f} tok/s, {args.adapters} adapters "
          f"{result['lora_tokens_per_s']:.0f} tok/s = {100 * result['lora_vs_base']:.0f}% of base")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
