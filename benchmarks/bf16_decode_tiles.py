"""Decode steps under ``dtype="bfloat16"`` on CPU, by how the bf16 panels multiply (docs/cpu.md#bfloat16-on-cpu).

    python -m benchmarks.bf16_decode_tiles [--model-dir DIR] [--batches 8,16,32,64] [--rounds 3]
                                           [--new-tokens 64] [--json out.json]

Model: W-REAL's float32 SmolLM2-135M-Instruct directory (``benchmarks/w_real.py``), or ``--model-dir``, loaded
once with ``dtype="bfloat16"``. For each batch size, ``--batches`` requests of 16 random prompt tokens each run
``--new-tokens`` greedy tokens, all in one ``generate``; each engine step is timed, and the median of the steps
after every prompt has its first token (the decode steps, all rows) is the figure. Three ways, in turns, ``--rounds`` times:

- ``amx``: the decode stack with AMX tiles (``tdpbf16ps``) for steps of ``amx_rows()`` rows and more, where the
  build has AMX-BF16 and the OS granted the tile state (otherwise this way is left out, with the reason);
- ``vdpbf16ps``: the decode stack with AMX switched off (``set_amx_rows(0)``): AVX512-BF16 dot products;
- ``onednn``: no decode stack: every projection a oneDNN bf16 matmul (which uses AMX itself where it can).

Reported: ms per decode step, best and worst of the rounds, and the speed-ups against ``vdpbf16ps``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

from benchmarks import w_real
from benchmarks.measure import StepRecorder, utc_now, write_report


def step_ms(llm: Any, prompts: list[dict], new_tokens: int) -> float:
    """Median milliseconds of the decode steps of ``prompts`` run together for ``new_tokens`` greedy tokens (the
    steps after the first token of every prompt, so prefill is left out)."""
    from asyncllm import SamplingParams

    recorder = StepRecorder(llm.engine)
    with recorder.installed():
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    first_tokens = max(times[0] for times in recorder.token_times.values())
    decode = [s for s, end in zip(recorder.step_s, _step_ends(recorder)) if end > first_tokens]
    return statistics.median(decode) * 1e3


def _step_ends(recorder: StepRecorder) -> list[float]:
    """When each recorded step ended: the token times are those ends, one per step that produced output."""
    return sorted({t for times in recorder.token_times.values() for t in times})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batches", default="8,16,32,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (one prefill token, then decode steps)")

    from asyncllm import LLM
    from asyncllm.kernels import cpu_decode_stack

    model_dir = args.model_dir or w_real.default_hf_dir()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model_dir, dtype="bfloat16", device="cpu", max_model_len=256, skip_tokenizer_init=True,
              max_num_seqs=max(batches), generation_config="none", enable_prefix_caching=False)
    runner = llm.engine.runner
    stack = runner.decode_stack
    amx_rows = cpu_decode_stack.amx_rows()
    ways = ["amx", "vdpbf16ps", "onednn"]
    skipped: dict[str, str] = {}
    if not amx_rows:
        ways.remove("amx")
        skipped["amx"] = "no AMX-BF16 in this build, or the OS did not grant the tile state"
    if stack is None or not cpu_decode_stack.bf16_dot_rows():
        skipped.update({w: "no bf16 decode stack here (needs AVX512-BF16)" for w in ways if w != "onednn"})
        ways = ["onednn"]
    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    try:
        for batch in batches:
            prompts = [{"prompt_token_ids": [rng.randrange(17, 250) for _ in range(16)]} for _ in range(batch)]
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(args.rounds):
                for way in ways:
                    cpu_decode_stack.set_amx_rows(amx_rows if way == "amx" else 0)
                    runner.decode_stack = None if way == "onednn" else stack
                    times[way].append(step_ms(llm, prompts, args.new_tokens))
            row: dict[str, Any] = {"batch": batch}
            for way, values in times.items():
                row[f"{way}_ms"] = [round(min(values), 2), round(max(values), 2)]
            if "vdpbf16ps" in times:
                base = min(times["vdpbf16ps"])
                for way in ways:
                    row[f"{way}_speedup"] = round(base / min(times[way]), 2)
            rows.append(row)
            print(f"B={batch}: " + ", ".join(f"{w} {row[f'{w}_ms'][0]:.1f}-{row[f'{w}_ms'][1]:.1f} ms"
                                             for w in ways), flush=True)
    finally:
        runner.decode_stack = stack
        cpu_decode_stack.set_amx_rows(amx_rows)
    write_report(args.json, {"workload": "bf16_decode_tiles", "time": utc_now(), "model_dir": model_dir,
                             "amx_rows": amx_rows, "dp_rows": cpu_decode_stack.bf16_dot_rows(),
                             "new_tokens": args.new_tokens, "rounds": args.rounds, "skipped": skipped,
                             "rows": rows})
    for way, why in skipped.items():
        print(f"{way}: skipped ({why})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
