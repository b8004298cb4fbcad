"""Quantized experts on CPU: the W-MOE model's experts as float32 and as quantized checkpoints store them.

    python -m benchmarks.moe_quantized [--formats float,gptq4,gptq8,fp8] [--batches 1,32] [--repeats 2]
                                       [--tiny] [--json out.json]

The model is W-MOE's (benchmarks/w_moe.py: 8 layers, hidden 512, 64 experts of 128 columns, top-8; random
weights). Each quantized checkpoint is written from it by asyncllm/toy/quantized.py (GPTQ 4-bit and 8-bit
symmetric, groups of 128; FP8 in 128 x 128 blocks) into ``--work-dir``. Reported per format: the bytes one
layer's experts take in memory, and output tokens/s at each batch (``--prompt-len`` random token ids,
``--gen-len`` greedy tokens each, all submitted at once; best of ``--repeats`` after a warm-up).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info
from benchmarks.measure import utc_now, write_report
from benchmarks.w_moe import ensure_model, time_asyncllm

FORMATS = ("float", "gptq4", "gptq8", "fp8")


def log(message: str) -> None:
    print(f"[moe_quantized] {message}", file=sys.stderr, flush=True)


def ensure_format(work_dir: Path, source: Path, fmt: str, tiny: bool) -> Path:
    """The W-MOE checkpoint as format ``fmt`` (written once into ``work_dir``)."""
    from asyncllm.toy import quantized as qc

    if fmt == "float":
        return source
    target = work_dir / f"{source.name}-{fmt}"
    if (target / "config.json").is_file():
        return target
    group = 32 if tiny else 128
    log(f"writing {target.name} ...")
    tmp = target.with_name(target.name + ".tmp")
    writers = {"gptq4": lambda: qc.write_gptq(source, tmp, bits=4, group_size=group, sym=True),
               "gptq8": lambda: qc.write_gptq(source, tmp, bits=8, group_size=group, sym=True),
               "fp8": lambda: qc.write_fp8_block(source, tmp, block=(group, group))}
    writers[fmt]()
    tmp.rename(target)
    return target


def expert_bytes(llm) -> int:
    """The bytes the first layer's experts take (packed values, scales and zero points, or the float stacks)."""
    stack = llm.engine.runner.model.model.layers[0].mlp.experts
    if stack.quantized is not None:
        return stack.quantized.held_bytes()
    return stack.w13.nbytes + stack.w2.nbytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    from asyncllm import LLM

    source = ensure_model(args.work_dir, "moe", args.tiny)
    results: dict[str, Any] = {}
    for fmt in args.formats:
        model_dir = ensure_format(args.work_dir, source, fmt, args.tiny)
        llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=max(args.batches),
                  skip_tokenizer_init=True, generation_config="none")
        try:
            row = {"expert_mib_per_layer": round(expert_bytes(llm) / 2**20, 2), "tok_s": {}}
            for b in args.batches:
                seconds = time_asyncllm(llm, b, args.prompt_len, args.gen_len, args.repeats)
                row["tok_s"][str(b)] = round(b * args.gen_len / seconds, 1)
            log(f"{fmt}: {row}")
            results[fmt] = row
        finally:
            llm.close()
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", type=lambda s: s.split(","), default=list(FORMATS))
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="the toy-sized W-MOE model (the tests' smoke run)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "asyncllm" / "w_moe")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "moe_quantized.json")
    args = parser.parse_args(argv)
    unknown = [f for f in args.formats if f not in FORMATS]
    if unknown:
        parser.error(f"--formats: unknown {', '.join(unknown)} (choose from {', '.join(FORMATS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    results = run(args)
    report = {"benchmark": "moe_quantized", "started": started, "machine": machine_info(), "argv": sys.argv[1:],
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
              "results": results}
    for fmt, row in results.items():
        print(f"{fmt}: {row['expert_mib_per_layer']} MiB of experts a layer; tok/s {row['tok_s']}")
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
