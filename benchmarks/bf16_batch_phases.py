"""A batch's prefill and its decode steps under ``dtype="bfloat16"`` on CPU, by how prefill attention runs.

    python -m benchmarks.bf16_batch_phases [--model-dir DIR] [--batch 64] [--prompt-len 128] [--new-tokens 128]
                                           [--rounds 3] [--ways fused,bf16-sdpa,float32-sdpa] [--json out.json]

Model: W-REAL's float32 SmolLM2-135M-Instruct directory (``benchmarks/w_real.py``), or ``--model-dir``, loaded once
with ``dtype="bfloat16"`` (bf16 KV cache, the default). Per round and way, in turns: ``--batch`` random prompts of
``--prompt-len`` token ids (new ones every call, so no prefix-cache hit) in one ``LLM.generate`` with
``max_tokens=1`` (the prefill, seconds), then another such batch with ``--new-tokens`` greedy tokens; the decode step
is (that time - the prefill's) / (new tokens - 1). Figures: the best and worst round. Ways
(docs/cpu.md#bfloat16-on-cpu):

- ``fused``: what the engine does here: on AMX CPUs prefill SDPA in bf16 with q/k/v bf16 from qkv to o;
- ``bf16-sdpa``: bf16 SDPA, but the attention layers convert to float32 and back around it;
- ``float32-sdpa``: prefill SDPA in float32 over the widened cache (what CPUs without AMX run).

Decode steps are the same code in every way (the decode stack); they show the machine's drift between ways.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from benchmarks import w_real
from benchmarks.measure import utc_now, write_report

WAYS = ("fused", "bf16-sdpa", "float32-sdpa")


def _set_way(way: str) -> None:
    from asyncllm.kernels import cpu_attention
    from asyncllm.model.decoder import Attention

    Attention.bf16_prefill = way == "fused"
    native = cpu_attention.amx_attention.__wrapped__  # the undecided probe (the module's is cached)
    cpu_attention.amx_attention = (lambda: False) if way == "float32-sdpa" else (lambda: True)
    cpu_attention.amx_attention.__wrapped__ = native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    unknown = [w for w in ways if w not in WAYS]
    if unknown or not ways:
        parser.error(f"--ways: unknown {unknown}; choose from {', '.join(WAYS)}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token, then decode steps)")

    from asyncllm import LLM, SamplingParams
    from asyncllm.kernels import cpu_attention
    from asyncllm.model.decoder import Attention

    model_dir = args.model_dir or w_real.default_hf_dir()
    llm = LLM(model_dir, dtype="bfloat16", device="cpu", max_model_len=args.prompt_len + args.new_tokens + 16,
              max_num_seqs=args.batch, skip_tokenizer_init=True, generation_config="none")
    vocab = llm.engine.vocab_size
    rng = random.Random(0)

    def prompts() -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(17, vocab) for _ in range(args.prompt_len)]}
                for _ in range(args.batch)]

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts(), params, use_tqdm=False)
        return time.perf_counter() - start

    saved = (Attention.bf16_prefill, cpu_attention.amx_attention)
    native = bool(cpu_attention.amx_attention())
    prefill: dict[str, list[float]] = {w: [] for w in ways}
    step: dict[str, list[float]] = {w: [] for w in ways}
    try:
        timed(2)  # warm-up: oneDNN primitives, the kernels' builds
        for _ in range(args.rounds):
            for way in ways:
                _set_way(way)
                p = timed(1)
                full = timed(args.new_tokens)
                prefill[way].append(p)
                step[way].append((full - p) / (args.new_tokens - 1) * 1e3)
    finally:
        Attention.bf16_prefill, cpu_attention.amx_attention = saved
        llm.close()
    rows: list[dict[str, Any]] = []
    for way in ways:
        row = {"way": way, "prefill_s": [round(min(prefill[way]), 6), round(max(prefill[way]), 6)],
               "decode_step_ms": [round(min(step[way]), 2), round(max(step[way]), 2)]}
        rows.append(row)
        print(f"{way}: prefill {row['prefill_s'][0]:.3f}-{row['prefill_s'][1]:.3f} s, decode step "
              f"{row['decode_step_ms'][0]:.1f}-{row['decode_step_ms'][1]:.1f} ms", flush=True)
    write_report(args.json, {"workload": "bf16_batch_phases", "time": utc_now(), "model_dir": model_dir,
                             "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                             "rounds": args.rounds, "amx_attention_here": native, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
