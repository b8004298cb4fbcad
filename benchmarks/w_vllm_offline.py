"""W-VLLM's offline run, in a process of its own: one engine's ``LLM(...).generate`` over the given prompts.

    python benchmarks/w_vllm_offline.py --engine asyncllm|vllm --model DIR --dtype float32 --prompts FILE
                                        --gen-len 128 --out FILE [--max-num-seqs 64] [--max-model-len 1024]

Standalone on purpose (the standard library and the engine only): the vLLM run uses the vLLM venv's interpreter,
which has neither asyncllm nor this checkout on its path. ``--prompts``: a JSON list of token-id lists. Both
engines take the token ids as they are (no tokenizer on the way in), greedy, ``ignore_eos`` and exactly
``--gen-len`` new tokens per prompt. One untimed warm-up (as many prompts of at most 16 tokens, 4 new ones), then
the timed ``generate``. ``--out``: a JSON object with the load, warm-up and timed seconds, the generated token
count, tokens/s, and every prompt's generated ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def session_cpu_s() -> float:
    """CPU seconds used so far by the live processes of this process's session (vLLM's engine core too)."""
    sid, tick, total = os.getsid(0), os.sysconf("SC_CLK_TCK"), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                total += int(fields[11]) + int(fields[12])
    return total / tick


def _asyncllm(args, prompts, warm):
    from asyncllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, skip_tokenizer_init=True, generation_config="none",
              **({"kv_cache_memory": args.kv_cache_bytes} if args.kv_cache_bytes else {}))
    load_s = time.perf_counter() - t0

    def generate(batch, n):
        outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return load_s, generate, llm.close


def _vllm(args, prompts, warm):
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              seed=0, generation_config="vllm")
    load_s = time.perf_counter() - t0

    def generate(batch, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return load_s, generate, lambda: None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["asyncllm", "vllm"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", required=True, help="JSON file: a list of token-id lists")
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-bytes", type=int, default=0, help="asyncllm: KV cache bytes (vLLM: its env)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.prompts) as f:
        prompts = json.load(f)
    warm = [q[:16] for q in prompts]
    load_s, generate, close = (_asyncllm if args.engine == "asyncllm" else _vllm)(args, prompts, warm)
    try:
        t0 = time.perf_counter()
        generate(warm, min(4, args.gen_len))
        warmup_s = time.perf_counter() - t0
        cpu0 = session_cpu_s()
        t0 = time.perf_counter()
        outputs = generate(prompts, args.gen_len)
        wall = time.perf_counter() - t0
        cpu = session_cpu_s() - cpu0
    finally:
        close()
    tokens = sum(len(o) for o in outputs)
    result = {"engine": args.engine, "dtype": args.dtype, "prompts": len(prompts), "gen_len": args.gen_len,
              "load_s": round(load_s, 3), "warmup_s": round(warmup_s, 3), "wall_s": round(wall, 4),
              "generated_tokens": tokens, "tokens_per_s": tokens / wall,
              "cpu_s": round(cpu, 3), "cpu_ms_per_token": round(1000 * cpu / max(1, tokens), 3),
              "wrong_lengths": sum(1 for o in outputs if len(o) != args.gen_len), "outputs": outputs}
    with open(args.out, "w") as f:
        json.dump(result, f)
    print(f"offline {args.engine} {args.dtype}: {len(prompts)} x {args.gen_len} in {wall:.2f} s "
          f"({tokens / wall:.1f} tok/s; load {load_s:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
