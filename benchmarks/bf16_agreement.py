"""Greedy agreement in bfloat16: asyncllm's ``dtype="bfloat16"`` against transformers in bfloat16, and both against
float32 (docs/cpu.md#bfloat16-on-cpu).

    python -m benchmarks.bf16_agreement [--prompts 8] [--prompt-len 64] [--new-tokens 64] [--model-dir DIR]
                                        [--json out.json]

Model: W-REAL's float32 SmolLM2-135M-Instruct directory (``benchmarks/w_real.py``), or ``--model-dir``. Prompts:
``--prompts`` English sentences from a fixed list, tokenized by the model's tokenizer, cut or padded with the
list's next sentence to ``--prompt-len`` tokens (the same for every engine). Each engine continues every prompt
greedily for ``--new-tokens`` tokens (EOS ignored):

- ``transformers-f32`` and ``transformers-bf16``: the model loaded with ``dtype=float32`` / ``bfloat16``, one
  prompt at a time, its KV cache (a plain forward loop, no generation config);
- ``asyncllm-f32`` and ``asyncllm-bf16``: ``LLM(dtype=...)``, every prompt in one ``generate`` call, so its decode
  steps hold all the prompts' rows (8 prompts: bf16 dot products, docs/cpu.md).

For each pair of engines: the share of positions where both picked the same token (counted up to the first
difference in each prompt, after which the texts are different continuations), the mean length of the common
prefix, and how many prompts agree all the way.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import utc_now, write_report

SENTENCES = [
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made.",
    "A good recipe for bread needs only flour, water, salt and yeast, but the baker's patience matters most.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and the oxygen we breathe.",
    "The city council met on Tuesday to discuss the new bicycle lanes and the budget for the public library.",
    "In mathematics, a prime number has exactly two divisors: one and itself, and there are infinitely many.",
    "The old lighthouse keeper climbed the spiral stairs every evening to light the lamp before the storm.",
    "Machine learning models learn patterns from examples instead of following rules written by programmers.",
    "Our team finished the quarterly report early, so we spent Friday afternoon planning the summer picnic.",
    "The river flooded the valley after three days of rain, and the farmers moved their animals to higher ground.",
    "When you write a letter to a friend, begin with a warm greeting and end with a question about their life.",
]
ENGINES = ("transformers-f32", "transformers-bf16", "asyncllm-f32", "asyncllm-bf16")
PAIRS = (("asyncllm-bf16", "transformers-bf16"), ("asyncllm-bf16", "transformers-f32"),
         ("transformers-bf16", "transformers-f32"), ("asyncllm-f32", "transformers-f32"),
         ("asyncllm-bf16", "asyncllm-f32"))


def make_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` token ids: sentence i, then the sentences after it, cut."""
    prompts = []
    for i in range(count):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += tokenizer.encode(SENTENCES[j % len(SENTENCES)] + " ", add_special_tokens=False)
            j += 1
        prompts.append(ids[:length])
    return prompts


def transformers_greedy(model_dir: Path, dtype_name: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model(ids, use_cache=True)
            past, new = out.past_key_values, []
            for _ in range(new_tokens):
                token = int(out.logits[0, -1].float().argmax())
                new.append(token)
                out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
            outputs.append(new)
    return outputs


def asyncllm_greedy(model_dir: Path, dtype: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from asyncllm import LLM, SamplingParams

    length = max(len(p) for p in prompts) + new_tokens
    llm = LLM(str(model_dir), dtype=dtype, max_model_len=length, skip_tokenizer_init=True, generation_config="none")
    try:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Common-prefix figures of two engines' continuations of the same prompts."""
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    total = sum(len(x) for x in a)
    return {"same_tokens_before_first_difference": round(sum(prefixes) / total, 4) if total else None,
            "mean_common_prefix": round(sum(prefixes) / len(prefixes), 2) if prefixes else None,
            "prompts_identical": sum(1 for x, y in zip(a, b) if x == y), "prompts": len(prefixes),
            "common_prefixes": prefixes}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bf16_agreement", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model-dir", type=Path, help="a Hugging Face directory instead of W-REAL's SmolLM2")
    p.add_argument("--work-dir", type=Path, default=None, help="W-REAL's work directory (where SmolLM2 is made)")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = utc_now()
    if args.model_dir is None:
        from benchmarks import w_real

        model_dir = w_real.ensure_hf_dir(args.work_dir or w_real.DEFAULT_WORK_DIR)
    else:
        model_dir = args.model_dir
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts, args.prompt_len)
    runs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for engine in ENGINES:
        kind, dtype = engine.split("-")
        t0 = time.perf_counter()
        if kind == "transformers":
            runs[engine] = transformers_greedy(model_dir, dtype, prompts, args.new_tokens)
        else:
            runs[engine] = asyncllm_greedy(model_dir, {"f32": "float32", "bf16": "bfloat16"}[dtype], prompts,
                                           args.new_tokens)
        seconds[engine] = round(time.perf_counter() - t0, 2)
        print(f"[bf16_agreement] {engine}: {seconds[engine]} s", flush=True)
    pairs = {f"{a} / {b}": agreement(runs[a], runs[b]) for a, b in PAIRS}
    print(f"\n{len(prompts)} prompts x {args.prompt_len} tokens, {args.new_tokens} greedy tokens each")
    print(f"{'pair':42} {'same tokens':>12} {'mean prefix':>12} {'identical':>10}")
    for name, figures in pairs.items():
        print(f"{name:42} {figures['same_tokens_before_first_difference']:12.3f} "
              f"{figures['mean_common_prefix']:12.1f} {figures['prompts_identical']:>6}/{figures['prompts']}")
    write_report(args.json, {"benchmark": "bf16_agreement", "started": started, "argv": sys.argv[1:],
                             "model": Path(model_dir).name, "prompts": len(prompts), "prompt_len": args.prompt_len,
                             "new_tokens": args.new_tokens, "seconds": seconds, "pairs": pairs, "outputs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
