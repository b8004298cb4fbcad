"""What the grammar compile guard costs: a child's start-up, and the time it adds to a cache miss.

    python -m benchmarks.grammar_guard [--schemas 30] [--tokenizer DIR ...] [--json out.json]

For the test tokenizer (1,024 tokens), the cpu-llama one (16,384) and any ``--tokenizer`` folder:
the first job of a fresh guard (a child's start-up: interpreter, llguidance, tokenizer), an empty
job's round trip, then ``--schemas`` distinct tool-call-like schemas (benchmarks.grammar_engines;
field names vary, so every one is a cache miss) compiled by a GrammarCompiler with the guard and
by one without. The difference of the medians is what the guard adds per miss (mostly the
child's own compile of the same grammar); cache hits cost nothing extra.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from benchmarks.common import machine_info
from benchmarks.grammar_engines import _tokenizers, schema
from benchmarks.measure import write_report


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def guard_figures(tokenizer, vocab_size: int, count: int) -> dict:
    from asyncllm.sampling_params import SamplingParams
    from asyncllm.structured import GrammarCompiler

    guarded = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id], guard=True)
    plain = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id], guard=False)
    guard = guarded.guard()  # builds the host's tokenizer too, outside the timings
    plain.ll_tokenizer()
    try:
        start = time.perf_counter()
        guard.call(os.getpid)  # the first job starts a child
        startup = time.perf_counter() - start
        trips = []
        for _ in range(20):
            start = time.perf_counter()
            guard.call(int)
            trips.append(time.perf_counter() - start)
        with_guard, without = [], []
        for i in range(count):  # alternated, so drift in the machine's load hits both alike
            for compiler, times, n in ((guarded, with_guard, 2 * i), (plain, without, 2 * i + 1)):
                params = SamplingParams(json_schema=schema(n))  # each schema once: no cache, ours or llguidance's
                start = time.perf_counter()
                compiler.compile_params(params)
                times.append(time.perf_counter() - start)
    finally:
        guarded.close()
    miss_on, miss_off = statistics.median(with_guard), statistics.median(without)
    return {"child_startup_ms": _ms(startup), "round_trip_ms_median": _ms(statistics.median(trips)),
            "miss_ms_median_guard_on": _ms(miss_on), "miss_ms_median_guard_off": _ms(miss_off),
            "added_per_miss_ms": _ms(miss_on - miss_off)}


def _extra_tokenizers(folders: list[str]):
    from transformers import AutoTokenizer

    for folder in folders:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        yield f"{os.path.basename(os.path.normpath(folder))} ({len(tokenizer):,})", tokenizer, len(tokenizer)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grammar_guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=30)
    parser.add_argument("--tokenizer", action="append", default=[], metavar="DIR",
                        help="also measure this Hugging Face tokenizer folder")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result: dict = {"tokenizers": {}, "machine": machine_info()}
    for source in (_tokenizers(), _extra_tokenizers(args.tokenizer)):
        for label, tokenizer, vocab in source:
            figures = guard_figures(tokenizer, vocab, args.schemas)
            result["tokenizers"][label] = figures
            print(f"{label:28s} child start-up {figures['child_startup_ms']:7.1f} ms  round trip "
                  f"{figures['round_trip_ms_median']:5.2f} ms  miss {figures['miss_ms_median_guard_off']:6.2f} -> "
                  f"{figures['miss_ms_median_guard_on']:6.2f} ms (+{figures['added_per_miss_ms']:.2f})")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
