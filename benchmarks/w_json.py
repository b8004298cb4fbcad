"""W-JSON: 32 requests constrained by a JSON schema of an object with 5 typed fields, against the
same requests unconstrained (workloads: docs/benchmarks.md).

    python -m benchmarks.w_json [--requests 32] [--repeats 3] [--json out.json]

Both runs use the ``cpu-llama`` checkpoint (float32), greedy decoding and the same random-id
prompts. The constrained run ends each request when its JSON is complete (or at ``--max-tokens``);
the unconstrained run then generates exactly as many tokens per request (``ignore_eos``), so both
produce the same number of tokens and throughput = tokens / wall time compares like with like.
Runs alternate (constrained, unconstrained) and the medians are reported; the prefix cache is emptied
before every timed run, so each one prefills its prompts.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from benchmarks.common import CPU_LLAMA_SPEC, build_cpu_llama
from benchmarks.measure import loadavg, machine_record, reset_prefix_cache, utc_now, write_report

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "active", "role", "tags"],
}
# Every field is bounded: a random-weight model picks digits and characters at random, so an
# unbounded string or a plain "number" (unlimited fraction digits) would run to max_tokens.


def workload(requests: int, seed: int = 0) -> list[list[int]]:
    """Random-id prompts of U[16, 128] tokens (``random.Random(seed)``), as the other workloads."""
    rng = random.Random(seed)
    vocab = CPU_LLAMA_SPEC["vocab_size"]
    return [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 128))] for _ in range(requests)]


def _timed(llm, prompts, params) -> tuple[float, list]:
    # every run starts cold: otherwise the first constrained run would prefill the prompts and every
    # later run (of either kind) would find them in the prefix cache
    reset_prefix_cache(llm.engine)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def _valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # jsonschema is a test dependency; parse-only without it
        return isinstance(value, dict)
    try:
        jsonschema.validate(value, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def measure(model_dir: str, requests: int, repeats: int, max_tokens: int) -> dict:
    from asyncllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32")
    prompts = workload(requests)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=SCHEMA)
    llm.generate(prompts[:4], constrained)  # warm-up: builds the grammar tokenizer, compiles the schema
    runs: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    lengths: list[int] = []
    valid = 0
    for i in range(repeats):
        seconds, outputs = _timed(llm, prompts, constrained)
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        # decode the tokens alone: the random-id prompts end in partial UTF-8 that the
        # incremental detokenizer completes into the first characters of the text
        valid = sum(_valid(llm.tokenizer.decode(o.outputs[0].token_ids)) for o in outputs)
        runs["constrained"].append(sum(lengths) / seconds)
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        seconds, _ = _timed(llm, prompts, free)
        runs["unconstrained"].append(sum(lengths) / seconds)
        print(f"\r[w-json] repeat {i + 1}/{repeats}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    tput = {name: statistics.median(values) for name, values in runs.items()}
    compiler = llm.inputs.grammars
    return {
        "workload": {"name": "W-JSON", "requests": requests, "schema": SCHEMA, "max_tokens": max_tokens,
                     "output_tokens": sum(lengths), "mean_output_len": round(sum(lengths) / requests, 1)},
        "throughput_tok_s": {k: round(v, 1) for k, v in tput.items()},
        "runs_tok_s": {k: [round(v, 1) for v in vs] for k, vs in runs.items()},
        "ratio_constrained_over_unconstrained": round(tput["constrained"] / tput["unconstrained"], 3),
        # each constrained run against the unconstrained run right after it: less exposed to a
        # shared machine's load drifting between runs than the ratio of medians
        "ratio_median_of_pairs": round(statistics.median(
            c / u for c, u in zip(runs["constrained"], runs["unconstrained"])), 3),
        "valid_json_outputs": f"{valid}/{requests}",
        "grammar_cache": {"hits": compiler.hits, "misses": compiler.misses},
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_json", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    model_dir = args.model_dir or str(build_cpu_llama())
    load_start = loadavg()
    result = {"benchmark": "W-JSON", "date": utc_now(),
              **measure(model_dir, args.requests, args.repeats, args.max_tokens)}
    result["machine"] = machine_record(load_start)
    result["command"] = "python -m benchmarks.w_json " + " ".join(argv if argv is not None else sys.argv[1:])
    tput = result["throughput_tok_s"]
    print(f"W-JSON ({args.requests} requests, {result['workload']['output_tokens']} output tokens per run)")
    print(f"  constrained    {tput['constrained']:8.1f} tok/s")
    print(f"  unconstrained  {tput['unconstrained']:8.1f} tok/s")
    print(f"  ratio          {result['ratio_constrained_over_unconstrained']:8.3f}  (target >= 0.90; "
          f"median of paired runs {result['ratio_median_of_pairs']:.3f})")
    print(f"  valid JSON     {result['valid_json_outputs']}")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
