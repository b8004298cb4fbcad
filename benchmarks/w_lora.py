"""W-LORA: W-CPU's requests spread round-robin over 16 rank-16 adapters (all attention and MLP
projections) plus some base-model requests; throughput relative to the base model alone.

    python -m benchmarks.w_lora [--scale 1.0] [--adapters 16] [--rank 16] [--json out.json]

Both runs go through one ``LLM`` in the same process, alternating, so they share the machine's mood.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import DEFAULT_CACHE_DIR, build_cpu_llama, machine_info, w_cpu_workload

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE_SHARE = 5  # every 5th request uses the base model


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


def run_once(llm, workload, loras) -> float:
    from asyncllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload.requests]
    start = time.perf_counter()
    llm.generate([r.prompt_token_ids for r in workload.requests], params, lora=loras)
    return workload.output_tokens / (time.perf_counter() - start)


def measure(model_dir: str, scale: float, adapters: int, rank: int, repeats: int) -> dict:
    from asyncllm import LLM, LoRARequest

    paths = build_adapters(Path(model_dir), adapters, rank, DEFAULT_CACHE_DIR / "lora")
    workload = w_cpu_workload(scale=scale)
    loras = [None if i % BASE_SHARE == 0 else LoRARequest(f"a{i % adapters}", str(paths[i % adapters]))
             for i in range(len(workload.requests))]
    llm = LLM(model_dir, dtype="float32", max_loras=adapters, max_lora_rank=rank)
    llm.generate([[11] * 8] * 2, lora=[None, loras[1]])  # warm-up, and loads the first adapter
    base, mixed = [], []
    for i in range(repeats):
        base.append(run_once(llm, workload, [None] * len(loras)))
        mixed.append(run_once(llm, workload, loras))
        print(f"[w-lora] repeat {i + 1}/{repeats}: base {base[-1]:.0f} tok/s, lora {mixed[-1]:.0f} tok/s",
              file=sys.stderr, flush=True)
    base_tps, lora_tps = sorted(base)[len(base) // 2], sorted(mixed)[len(mixed) // 2]
    return {"workload": {**workload.summary(), "adapters": adapters, "rank": rank,
                         "base_requests": sum(x is None for x in loras)},
            "base_tokens_per_s": round(base_tps, 1), "lora_tokens_per_s": round(lora_tps, 1),
            "lora_vs_base": round(lora_tps / base_tps, 3), "runs": {"base": base, "lora": mixed},
            "machine": machine_info()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result = measure(args.model_dir or str(build_cpu_llama()), args.scale, args.adapters, args.rank, args.repeats)
    result["command"] = "python -m benchmarks.w_lora " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"W-LORA: base {result['base_tokens_per_s']:.0f} tok/s, {args.adapters} adapters "
          f"{result['lora_tokens_per_s']:.0f} tok/s = {100 * result['lora_vs_base']:.0f}% of base")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
