"""What int8 weights cost in accuracy on a real model (docs/benchmarks.md, W-REAL).

    python -m benchmarks.int8_accuracy [--json out.json] [--new-tokens 32]

SmolLM2-135M-Instruct in float32 (the directory W-REAL makes: ``~/.cache/asyncllm/w_real/smollm2-f32-hf``, or
``--model-dir``) against the same weights as int8: ``quantization="int8"`` (one scale per output channel) and,
when W-REAL's ``smollm2-q8_0.gguf`` exists, the Q8_0 GGUF (groups of 32, as llama.cpp stores them).

- Log-likelihood: every text of :data:`TEXTS` is scored (``prompt_logprobs``); reported are the mean per-token
  log-likelihood of each variant, the mean absolute per-token difference against float32, and the share of
  positions where the variant's top-1 token equals float32's (teacher-forced agreement).
- Greedy: each of :data:`QUESTIONS` as a chat prompt, ``--new-tokens`` greedy tokens; reported are the share of
  answers identical to float32's and the mean length of the common prefix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from asyncllm.demo import CHAT_QUESTIONS

TEXTS = [
    "The capital of France is Paris, a city known for its museums, its cafes and the Eiffel Tower.",
    "Water boils at one hundred degrees Celsius at sea level, and it freezes at zero degrees.",
    "In 1969, Neil Armstrong became the first person to walk on the surface of the Moon.",
    "A healthy breakfast might include oatmeal, fresh fruit, yogurt and a glass of orange juice.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "The mitochondria is the part of the cell that produces most of its chemical energy.",
    "Photosynthesis turns sunlight, water and carbon dioxide into glucose and oxygen.",
    "To make a cup of tea, boil water, pour it over the tea leaves and wait three minutes.",
    "Shakespeare wrote many plays, including Hamlet, Macbeth and Romeo and Juliet.",
    "The Pacific Ocean is the largest and deepest of the world's five oceans.",
    "Exercise improves mood, strengthens the heart and helps people sleep better at night.",
    "A computer program is a sequence of instructions that a computer follows to complete a task.",
    "The human heart has four chambers: two atria on top and two ventricles below.",
    "Mount Everest, on the border of Nepal and China, is the highest mountain above sea level.",
    "Learning a new language takes practice, patience and a lot of listening.",
    "The train leaves the station at nine o'clock and arrives in the city two hours later.",
]
QUESTIONS = CHAT_QUESTIONS + ["How many legs does a spider have?", "What is photosynthesis?"]


def score(llm, texts: list[str]) -> list[list[tuple[int, float, int]]]:
    """Per text, per position after the first: (token, its log-probability, the top-1 token)."""
    from asyncllm import SamplingParams

    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=1))
    result = []
    for out in outs:
        rows = []
        for position, token in enumerate(out.prompt_token_ids[1:], start=1):
            entry = out.prompt_logprobs[position]
            rows.append((token, entry[token], max(entry.items(), key=lambda kv: kv[1])[0]))
        result.append(rows)
    return result


def greedy(llm, questions: list[str], new_tokens: int) -> list[list[int]]:
    from asyncllm import SamplingParams

    prompts = [[{"role": "user", "content": q}] for q in questions]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens))]


def compare(reference_scores, reference_greedy, scores, answers) -> dict:
    diffs, agree, total, ll = [], 0, 0, []
    for ref_rows, rows in zip(reference_scores, scores):
        for (token, ref_lp, ref_top), (_, lp, top) in zip(ref_rows, rows):
            diffs.append(abs(lp - ref_lp))
            ll.append(lp)
            agree += top == ref_top
            total += 1
    prefixes = []
    for ref, got in zip(reference_greedy, answers):
        common = 0
        while common < min(len(ref), len(got)) and ref[common] == got[common]:
            common += 1
        prefixes.append(common)
    return {"mean_loglik_per_token": round(statistics.mean(ll), 4),
            "mean_abs_loglik_diff_vs_f32": round(statistics.mean(diffs), 4),
            "teacher_forced_top1_agreement": round(agree / total, 4), "scored_tokens": total,
            "greedy_identical_answers": f"{sum(a == b for a, b in zip(reference_greedy, answers))}/{len(answers)}",
            "greedy_mean_common_prefix": round(statistics.mean(prefixes), 2),
            "greedy_answer_tokens": [len(a) for a in answers]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = Path.home() / ".cache" / "asyncllm" / "w_real"
    parser.add_argument("--model-dir", default=str(work / "smollm2-f32-hf"))
    parser.add_argument("--q8-gguf", default=str(work / "smollm2-q8_0.gguf"))
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from asyncllm import LLM

    from benchmarks.measure import utc_now, write_report

    engine = dict(max_model_len=512, max_num_seqs=16, generation_config="none")
    variants = {"float32": (args.model_dir, {}), "int8 (per channel)": (args.model_dir, {"quantization": "int8"})}
    if Path(args.q8_gguf).is_file():
        variants["Q8_0 GGUF as int8 (groups of 32)"] = (args.q8_gguf, {})
    results, reference = {}, None
    for name, (model, extra) in variants.items():
        t0 = time.perf_counter()
        llm = LLM(model, **engine, **extra)
        scores, answers = score(llm, TEXTS), greedy(llm, QUESTIONS, args.new_tokens)
        if reference is None:
            reference = (scores, answers)
            results[name] = {"mean_loglik_per_token": round(statistics.mean(lp for rows in scores for _, lp, _ in rows), 4)}
        else:
            results[name] = compare(*reference, scores, answers)
        print(f"{name}: {json.dumps(results[name])} ({time.perf_counter() - t0:.1f} s)", flush=True)
        del llm
    report = {"workload": "int8 accuracy on SmolLM2-135M-Instruct", "date": utc_now(), "command": " ".join(sys.argv),
              "texts": len(TEXTS), "questions": len(QUESTIONS), "new_tokens": args.new_tokens, "results": results}
    if args.json:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
