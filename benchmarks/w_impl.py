"""W-IMPL: the cost of the transformers backend, on one checkpoint run both ways.

    python -m benchmarks.w_impl [--model DIR] [--prompts 32] [--prompt-len 128] [--output-len 64] [--json out.json]

The same float32 checkpoint (default: the benchmarks' cpu-llama) is loaded with
``model_impl="native"`` and with ``model_impl="transformers"``, in turns (``--rounds``); each run
generates ``--prompts`` greedy continuations offline, and a batch-1 decode is timed as well.
Reports output tokens per second, batch-1 milliseconds per token, the ratio of the two
implementations, and whether their greedy outputs are identical.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from benchmarks.common import build_cpu_llama
from benchmarks.measure import loadavg, machine_record, model_config, utc_now, write_report

SIZES = {"full": [], "quick": ["--prompts", "8", "--output-len", "32", "--rounds", "1"],
         "tiny": ["--prompts", "2", "--prompt-len", "8", "--output-len", "4", "--rounds", "1"]}


def _run(model_dir: str, impl: str, prompts: list[list[int]], output_len: int) -> dict:
    from asyncllm import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32", model_impl=impl)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    begin = time.perf_counter()
    outputs = llm.generate(prompts, greedy)
    batch_s = time.perf_counter() - begin
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    begin = time.perf_counter()
    llm.generate(prompts[:1], greedy)
    single_s = time.perf_counter() - begin
    return {"tokens": tokens, "seconds": round(batch_s, 4), "tokens_per_s": round(tokens / batch_s, 2),
            "batch1_ms_per_token": round(1000 * single_s / output_len, 3),
            "outputs": [o.outputs[0].token_ids for o in outputs]}


def measure(model_dir: str, prompts: int, prompt_len: int, output_len: int, rounds: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    vocab = model_config(model_dir)["vocab_size"]
    batch = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    runs: dict[str, list[dict]] = {"native": [], "transformers": []}
    for r in range(rounds):
        for impl in ("native", "transformers"):
            print(f"\r[w-impl] round {r + 1}/{rounds}: {impl}        ", end="", file=sys.stderr, flush=True)
            runs[impl].append(_run(model_dir, impl, batch, output_len))
    print(file=sys.stderr)
    best = {impl: max(rs, key=lambda x: x["tokens_per_s"]) for impl, rs in runs.items()}
    fastest_b1 = {impl: min(x["batch1_ms_per_token"] for x in rs) for impl, rs in runs.items()}
    return {
        "benchmark": "W-IMPL", "date": utc_now(),
        "workload": {"prompts": prompts, "prompt_len": prompt_len, "output_len": output_len, "rounds": rounds},
        "native": {k: v for k, v in best["native"].items() if k != "outputs"} | {"batch1_ms_per_token": fastest_b1["native"]},
        "transformers": {k: v for k, v in best["transformers"].items() if k != "outputs"}
                        | {"batch1_ms_per_token": fastest_b1["transformers"]},
        "throughput_ratio": round(best["transformers"]["tokens_per_s"] / best["native"]["tokens_per_s"], 3),
        "batch1_ratio": round(fastest_b1["transformers"] / fastest_b1["native"], 3),
        "identical_outputs": best["native"]["outputs"] == best["transformers"]["outputs"],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_impl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the cached cpu-llama)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    load_start = loadavg()
    model_dir = args.model or str(build_cpu_llama())
    result = measure(model_dir, args.prompts, args.prompt_len, args.output_len, args.rounds)
    result["machine"] = machine_record(load_start)
    result["command"] = "python -m benchmarks.w_impl " + " ".join(argv if argv is not None else sys.argv[1:])
    n, t = result["native"], result["transformers"]
    print(f"W-IMPL ({args.prompts} prompts x {args.output_len} tokens)")
    print(f"  native        {n['tokens_per_s']:9.1f} tok/s   batch 1 {n['batch1_ms_per_token']:7.2f} ms/token")
    print(f"  transformers  {t['tokens_per_s']:9.1f} tok/s   batch 1 {t['batch1_ms_per_token']:7.2f} ms/token")
    print(f"  transformers / native: throughput x{result['throughput_ratio']}, batch-1 time x{result['batch1_ratio']}; "
          f"identical outputs: {result['identical_outputs']}")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
