"""W-MOE: a Qwen3-MoE-shaped model on CPU against transformers, and against a dense model of the same active size.

    python -m benchmarks.w_moe [--batches 1,8,32] [--prompt-len 64] [--gen-len 64] [--repeats 1]
                               [--threads N] [--skip-transformers] [--json out.json]

Models (random weights, the toy tokenizer's vocabulary; made once in ``--work-dir``):

- ``moe``: Qwen3-MoE shape scaled down: 8 layers, hidden 512, 8 query / 4 KV heads of 64, 64 experts of
  intermediate 128, top-8 (renormalised), every layer sparse;
- ``dense``: Qwen3 with the same attention and one MLP of 8 x 128 = 1024 columns: the MoE model's active
  parameters per token, dense.

Workload: B requests of ``--prompt-len`` random token ids, ``--gen-len`` greedy tokens each (ignore_eos), all
submitted at once. Output tokens/s is B * gen-len over the wall time from submission to the last token (best
of ``--repeats`` after a warm-up). transformers runs ``generate`` on the same batch (equal lengths, no padding;
its default experts implementation). Decode step time: (time for gen-len tokens - time for 1 token) /
(gen-len - 1) at the batch, so prefill is taken out.

Targets (the MoE issue): asyncllm >= 3x transformers at batch 32; MoE decode step at batch 32 <= 2x the dense
model's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info
from benchmarks.measure import utc_now, write_report

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=1024, tie_word_embeddings=False)
MOE = dict(SHAPE, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=128, intermediate_size=1024,
           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
DENSE = dict(SHAPE, intermediate_size=8 * 128)
# --tiny (tests): the same two models at toy size
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TARGETS = {"vs_transformers_batch_32": 3.0, "moe_over_dense_step_batch_32": 2.0}


def log(message: str) -> None:
    print(f"[w_moe] {message}", file=sys.stderr, flush=True)


def model_configs(tiny: bool) -> dict[str, dict]:
    """The MoE model's and the dense model's config overrides."""
    if not tiny:
        return {"moe": MOE, "dense": DENSE}
    moe = {**MOE, **TINY}
    dense = {k: v for k, v in moe.items() if k in SHAPE}
    dense["intermediate_size"] = TINY["num_experts_per_tok"] * TINY["moe_intermediate_size"]
    return {"moe": moe, "dense": dense}


def ensure_model(work_dir: Path, kind: str, tiny: bool = False) -> Path:
    from asyncllm.toy.checkpoints import build_checkpoint

    target = work_dir / f"w_moe-{kind}{'-tiny' if tiny else ''}"
    if (target / "config.json").is_file():
        return target
    log(f"building {target.name} ...")
    tmp = target.with_name(target.name + ".tmp")
    build_checkpoint("qwen3_moe" if kind == "moe" else "qwen3", tmp, **model_configs(tiny)[kind])
    tmp.rename(target)
    return target


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed + batch)
    return [[rng.randrange(5, 1000) for _ in range(length)] for _ in range(batch)]


def time_asyncllm(llm, batch: int, prompt_len: int, gen_len: int, repeats: int) -> float:
    from asyncllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    batch_prompts = prompts(batch, prompt_len)
    llm.generate(batch_prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params)
        best = min(best, time.perf_counter() - start)
        assert all(len(o.outputs[0].token_ids) == gen_len for o in outs)
    return best


def time_transformers(model, batch: int, prompt_len: int, gen_len: int, repeats: int) -> float:
    import torch

    ids = torch.tensor(prompts(batch, prompt_len))
    kwargs = dict(do_sample=False, max_new_tokens=gen_len, min_new_tokens=gen_len, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            best = min(best, time.perf_counter() - start)
            assert out.shape[1] == prompt_len + gen_len
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from asyncllm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"asyncllm": {}, "transformers": {}, "step_ms_batch": {}}
    for kind in ("moe", "dense"):
        model_dir = ensure_model(args.work_dir, kind, args.tiny)
        llm = LLM(str(model_dir), dtype="float32", max_model_len=1024, max_num_seqs=max(args.batches),
                  skip_tokenizer_init=True, generation_config="none")
        try:
            for b in args.batches if kind == "moe" else [max(args.batches)]:
                seconds = time_asyncllm(llm, b, args.prompt_len, args.gen_len, args.repeats)
                results["asyncllm"].setdefault(kind, {})[str(b)] = round(b * args.gen_len / seconds, 1)
                log(f"asyncllm {kind} B={b}: {b * args.gen_len / seconds:.1f} tok/s")
            b = max(args.batches)
            one = time_asyncllm(llm, b, args.prompt_len, 1, args.repeats)
            full = time_asyncllm(llm, b, args.prompt_len, args.gen_len, args.repeats)
            results["step_ms_batch"][kind] = round(1000 * (full - one) / (args.gen_len - 1), 2)
            log(f"asyncllm {kind} decode step at B={b}: {results['step_ms_batch'][kind]} ms")
        finally:
            llm.close()
        if kind == "moe" and not args.skip_transformers:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            for b in args.batches:
                seconds = time_transformers(model, b, args.prompt_len, args.gen_len, args.repeats)
                results["transformers"][str(b)] = round(b * args.gen_len / seconds, 1)
                log(f"transformers moe B={b}: {b * args.gen_len / seconds:.1f} tok/s")
            del model
    mine, theirs = results["asyncllm"]["moe"], results["transformers"]  # (empty with --skip-transformers)
    results["vs_transformers"] = {b: round(mine[b] / theirs[b], 2) for b in mine if b in theirs}
    steps = results["step_ms_batch"]
    results["moe_over_dense_step"] = round(steps["moe"] / steps["dense"], 2)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="toy-sized models (the tests' smoke run)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "asyncllm" / "w_moe")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "w_moe.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    results = run(args)
    report = {"benchmark": "w_moe", "started": started, "machine": machine_info(), "argv": sys.argv[1:],
              "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "json"},
              "model": model_configs(args.tiny), "results": results, "targets": TARGETS}
    print(f"asyncllm MoE tok/s {results['asyncllm']['moe']}; transformers {results['transformers']}; "
          f"ratio {results['vs_transformers']}; decode step at B={max(args.batches)}: MoE "
          f"{results['step_ms_batch']['moe']} ms, dense {results['step_ms_batch']['dense']} ms "
          f"({results['moe_over_dense_step']}x)")
    write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
