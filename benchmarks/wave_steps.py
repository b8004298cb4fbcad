"""Where a wave of streams spends its first tokens: each engine step of closed-loop streams, and cold against warm
prefill steps, under ``dtype="bfloat16"`` on CPU (docs/benchmarks.md, W-VLLM's 32-stream TTFT tail).

    python -m benchmarks.wave_steps [--model-dir DIR] [--streams 32] [--prompt-len 128] [--new-tokens 128]
                                    [--cold-repeats 3] [--json out.json]

Model: W-REAL's float32 SmolLM2-135M-Instruct directory (``benchmarks/w_real.py``), or ``--model-dir``.

- **Cold steps**: a fresh ``LLM`` (bf16), then dummy prefill steps straight on its runner, ``--cold-repeats`` times
  each: the engine's token budget as rows of ``--prompt-len`` tokens, then three quarters of it. The first of each
  size pays what a process's first step of that size pays (oneDNN primitives for the row count, buffers faulted in).
- **Wave**: ``AsyncLLM`` (bf16), ``--streams`` closed-loop streams over twice as many random prompts of
  ``--prompt-len`` ids, ``--new-tokens`` greedy tokens each, after a warm-up of 16-token prompts (as W-VLLM's).
  Every step that carries prompt tokens is listed: when it began (ms after the first request), how long the model
  ran, its decode rows, prompt tokens and prompt rows; then the decode-only steps' median and the TTFTs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from typing import Any

from benchmarks import w_real
from benchmarks.measure import utc_now, write_report


def cold_steps(model_dir: str, prompt_len: int, repeats: int, max_model_len: int) -> list[dict[str, Any]]:
    """Milliseconds of each dummy prefill step, in order, per step size."""
    from asyncllm import LLM
    from asyncllm.engine.step_time import dummy_step

    llm = LLM(model_dir, dtype="bfloat16", device="cpu", max_model_len=max_model_len, skip_tokenizer_init=True,
              generation_config="none")
    try:
        runner, budget = llm.engine.runner, llm.engine.token_budget
        length = min(prompt_len, budget)
        per_row_blocks = -(-length // runner.block_size)
        out = []
        for tokens in (budget, budget * 3 // 4):
            rows = max(1, min(tokens // length, runner.num_blocks // per_row_blocks, llm.engine.config.max_num_seqs))
            times = []
            for _ in range(repeats):
                step = dummy_step([0] * rows, [length] * rows, runner.block_size, runner.num_blocks)
                start = time.perf_counter()
                runner.execute(step).logits.argmax(dim=-1).tolist()
                times.append(round(1e3 * (time.perf_counter() - start), 1))
            out.append({"tokens": rows * length, "rows": rows, "ms": times})
            print(f"cold steps: {rows * length} prompt tokens: " + " / ".join(f"{t:.1f}" for t in times) + " ms",
                  flush=True)
        return out
    finally:
        llm.close()


async def wave(model_dir: str, streams: int, prompt_len: int, new_tokens: int, max_model_len: int) -> dict[str, Any]:
    """The steps and TTFTs of ``streams`` closed-loop streams over ``2 * streams`` prompts."""
    from asyncllm import AsyncLLM, SamplingParams

    llm = AsyncLLM(model_dir, dtype="bfloat16", device="cpu", max_model_len=max_model_len,
                   max_num_seqs=max(64, streams), skip_tokenizer_init=True, generation_config="none")
    engine = llm.engine
    steps: list[tuple[float, float, int, int, int]] = []
    run = engine._run

    def timed_run(batch):  # the model's part of a step, with what the step carried
        counts = list(batch.num_new_tokens)
        begin = time.perf_counter()
        try:
            return run(batch)
        finally:
            steps.append((begin, time.perf_counter() - begin, sum(1 for n in counts if n == 1),
                          sum(n for n in counts if n > 1), sum(1 for n in counts if n > 1)))

    engine._run = timed_run
    try:
        vocab = engine.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(17, vocab) for _ in range(prompt_len)] for _ in range(2 * streams)]
        warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        await asyncio.gather(*(llm.generate({"prompt_token_ids": p[:16][::-1]}, warm) for p in prompts[:streams]))
        steps.clear()
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        queue, ttfts, tokens = list(prompts), [], 0

        async def stream() -> None:
            nonlocal tokens
            while queue:
                prompt = queue.pop(0)
                sent, first = time.perf_counter(), True
                async for out in llm.stream_outputs({"prompt_token_ids": prompt}, params):
                    if first:
                        ttfts.append(time.perf_counter() - sent)
                        first = False
                    tokens += len(out.outputs[0].token_ids)

        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(streams)))
        wall = time.perf_counter() - t0
    finally:
        engine._run = run
        await llm.aclose()
    prefill = [{"at_ms": round(1e3 * (b - t0)), "ms": round(1e3 * d, 1), "decode_rows": dr, "prompt_tokens": pt,
                "prompt_rows": pr} for b, d, dr, pt, pr in steps if pt]
    decode = [d for _, d, _, pt, _ in steps if not pt]
    ttfts.sort()
    report = {"tokens_per_s": round(tokens / wall, 1), "wall_s": round(wall, 2),
              "ttft_ms": {"p50": round(1e3 * ttfts[len(ttfts) // 2]), "max": round(1e3 * ttfts[-1])},
              "prompt_steps": prefill, "decode_steps": len(decode),
              "decode_step_ms_median": round(1e3 * statistics.median(decode), 1) if decode else None}
    print(f"wave: {report['tokens_per_s']} tok/s, TTFT p50 {report['ttft_ms']['p50']} ms, max "
          f"{report['ttft_ms']['max']} ms; {len(decode)} decode-only steps, median "
          f"{report['decode_step_ms_median']} ms", flush=True)
    for s in prefill:
        print(f"  at {s['at_ms']:>6} ms: {s['ms']:7.1f} ms, {s['decode_rows']} decodes beside {s['prompt_tokens']} "
              f"prompt tokens in {s['prompt_rows']} rows", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--cold-repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("streams", "prompt_len", "new_tokens", "cold_repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    model_dir = args.model_dir or w_real.default_hf_dir()
    max_model_len = args.prompt_len + args.new_tokens + 16
    cold = cold_steps(model_dir, args.prompt_len, args.cold_repeats, max_model_len)
    waves = asyncio.run(wave(model_dir, args.streams, args.prompt_len, args.new_tokens, max_model_len))
    write_report(args.json, {"workload": "wave_steps", "time": utc_now(), "model_dir": model_dir,
                             "streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                             "cold_steps": cold, "wave": waves})
    return 0


if __name__ == "__main__":
    sys.exit(main())
