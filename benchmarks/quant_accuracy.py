"""How close each quantized format stays to float32 on SmolLM2 (docs/benchmarks.md, "Quantized checkpoints").

    python -m benchmarks.quant_accuracy [--formats gptq4,awq4,...] [--json out.json]

W-REAL's float32 SmolLM2-135M-Instruct directory is quantized to each format (``asyncllm/toy/quantized.py``,
round to nearest; the other tensors stay float32), loaded by asyncllm, and compared with the float32 model on
a fixed set of texts:

- mean log-likelihood per token of the texts (prompt logprobs), and its difference from float32's;
- greedy agreement: the share of the first 64 greedy tokens, over 8 prompts, equal to float32's at the same
  position, and the mean position of the first difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from benchmarks import w_real
from benchmarks.measure import utc_now, write_report

TEXTS = [
    "The old lighthouse keeper climbed the spiral stairs every evening, lit the lamp, and watched the ships "
    "pass through the narrow strait until dawn.",
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and "
    "release oxygen as a by-product.",
    "To make a simple tomato sauce, warm olive oil in a pan, add garlic, then crushed tomatoes, salt and basil, "
    "and let it simmer for twenty minutes.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "The treaty was signed in 1648 and ended thirty years of war across central Europe, redrawing the map of "
    "the continent.",
    "A continuous-batching scheduler admits new requests between decoding steps, so short answers never wait "
    "behind long ones.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures high in the mountains.",
    "She opened the letter slowly, read the first line twice, and then sat down by the window without a word.",
]
GREEDY_TOKENS = 64


def _formats() -> dict[str, Callable[[Path, Path], Path]]:
    import torch

    from asyncllm.toy import quantized as q

    f32 = torch.float32
    return {
        "gptq-4bit-g128": lambda s, d: q.write_gptq(s, d, bits=4, group_size=128, sym=True, dtype=f32),
        "gptq-4bit-g128-asym": lambda s, d: q.write_gptq(s, d, bits=4, group_size=128, sym=False,
                                                         checkpoint_format="gptq_v2", dtype=f32),
        "gptq-8bit-g128": lambda s, d: q.write_gptq(s, d, bits=8, group_size=128, sym=True, dtype=f32),
        "awq-4bit-g64": lambda s, d: q.write_awq(s, d, group_size=64, dtype=f32),
        "ct-w4a16-g64": lambda s, d: q.write_compressed_tensors(s, d, "W4A16", group_size=64, dtype=f32),
        "ct-w8a8": lambda s, d: q.write_compressed_tensors(s, d, "W8A8", dtype=f32),
        "ct-fp8-channel": lambda s, d: q.write_compressed_tensors(s, d, "FP8", dtype=f32),
        "fp8-block-128": lambda s, d: q.write_fp8_block(s, d, block=(128, 128), dtype=f32),
    }


def measure(model: str, texts: list[list[int]], prompts: list[list[int]]) -> dict[str, Any]:
    """Per-token log-likelihood of each text and the greedy continuations of the prompts."""
    from asyncllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", max_model_len=1024, skip_tokenizer_init=True, generation_config="none")
    try:
        scored = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        lls = []
        for text, out in zip(texts, scored):
            lls.append([entry[token] for token, entry in zip(text[1:], out.prompt_logprobs[1:])])
        greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True),
                              use_tqdm=False)
        return {"loglik": lls, "greedy": [list(o.outputs[0].token_ids) for o in greedy]}
    finally:
        llm.close()


def compare(mine: dict, base: dict) -> dict[str, Any]:
    flat = [x for text in mine["loglik"] for x in text]
    flat_base = [x for text in base["loglik"] for x in text]
    same = [sum(a == b for a, b in zip(m, f)) / len(f) for m, f in zip(mine["greedy"], base["greedy"])]
    first = [next((i for i, (a, b) in enumerate(zip(m, f)) if a != b), len(f))
             for m, f in zip(mine["greedy"], base["greedy"])]
    return {"mean_loglik": statistics.fmean(flat), "mean_loglik_diff": statistics.fmean(flat) - statistics.fmean(flat_base),
            "mean_abs_token_loglik_diff": statistics.fmean(abs(a - b) for a, b in zip(flat, flat_base)),
            "greedy_agreement": statistics.fmean(same), "mean_first_difference": statistics.fmean(first)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(_formats()))
    p.add_argument("--work-dir", type=Path, default=w_real.DEFAULT_WORK_DIR)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    hf_dir = w_real.ensure_hf_dir(args.work_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    texts = [tokenizer(t)["input_ids"] for t in TEXTS]
    prompts = [text[:12] for text in texts]
    base = measure(str(hf_dir), texts, prompts)
    rows: dict[str, Any] = {"float32": compare(base, base)}
    for name in args.formats.split(","):
        target = args.work_dir / f"accuracy-{name}"
        if not (target / "config.json").is_file():
            w_real.log(f"making {target.name} ...")
            _formats()[name](hf_dir, target)
        rows[name] = compare(measure(str(target), texts, prompts), base)
        rows[name]["checkpoint_mib"] = round(sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2**20, 1)
        w_real.log(f"{name}: {rows[name]}")
    print(f"\n{'format':22} {'mean loglik':>11} {'diff':>8} {'|diff|/tok':>10} {'greedy same':>11} {'first diff':>10}")
    for name, r in rows.items():
        print(f"{name:22} {r['mean_loglik']:11.4f} {r['mean_loglik_diff']:8.4f} {r['mean_abs_token_loglik_diff']:10.4f}"
              f" {r['greedy_agreement']:11.3f} {r['mean_first_difference']:10.1f}")
    write_report(args.json, {"benchmark": "quant_accuracy", "started": utc_now(), "argv": sys.argv[1:], "texts": TEXTS,
                             "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
