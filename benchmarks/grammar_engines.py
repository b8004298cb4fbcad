"""llguidance vs xgrammar on this machine: per-request compile time and per-token mask time.

    python -m benchmarks.grammar_engines [--schemas 20] [--json out.json]

Every tool call brings its own JSON schema, so what matters most is the time from a new schema to
the first mask. Each engine compiles ``--schemas`` distinct tool-call-like schemas (field names
vary, so no cache helps) for the test tokenizer (1,024 tokens) and the cpu-llama one (16,384),
then walks a valid answer token by token, computing the mask before each token. xgrammar is
optional (``pip install xgrammar``); it is skipped when absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.common import build_cpu_llama, machine_info
from benchmarks.measure import write_report


def schema(i: int) -> dict:
    """A typical tool's parameters: five typed fields, names unique to ``i``."""
    return {"type": "object", "properties": {
        f"city_{i}": {"type": "string"}, f"days_{i}": {"type": "integer", "minimum": 1},
        f"unit_{i}": {"enum": ["celsius", "fahrenheit"]}, f"detailed_{i}": {"type": "boolean"},
        f"score_{i}": {"type": "number"}},
        "required": [f"city_{i}", f"days_{i}", f"unit_{i}", f"detailed_{i}", f"score_{i}"],
        "additionalProperties": False}


def answer(i: int) -> str:
    return json.dumps({f"city_{i}": "Paris", f"days_{i}": 3, f"unit_{i}": "celsius", f"detailed_{i}": True,
                       f"score_{i}": 2.5}, separators=(",", ":"))


def _run(compile_one: Callable[[dict], object], walk: Callable[[object, list[int]], int], tokenizer,
         count: int) -> dict:
    compile_ms, mask_us = [], []
    for i in range(count):
        start = time.perf_counter()
        matcher = compile_one(schema(i))
        compile_ms.append((time.perf_counter() - start) * 1000)
        ids = tokenizer.encode(answer(i), add_special_tokens=False)
        start = time.perf_counter()
        masks = walk(matcher, ids)
        mask_us.append((time.perf_counter() - start) * 1e6 / masks)
    return {"compile_ms_first": round(compile_ms[0], 3), "compile_ms_median": round(statistics.median(compile_ms[1:]), 3),
            "mask_us_per_token_median": round(statistics.median(mask_us), 1)}


def llguidance_figures(tokenizer, vocab_size: int, count: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    from asyncllm.structured.schema import JSON_OPTIONS

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup_ms = (time.perf_counter() - start) * 1000
    bitmask = lt.allocate_token_bitmask(1, vocab_size)

    def compile_one(s: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(s, defaults={**JSON_OPTIONS, "item_separator": ",",
                                                                             "key_separator": ":"})
        return llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)

    def walk(matcher, ids: list[int]) -> int:
        for token in ids:
            lt.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), matcher.get_error()
        lt.fill_next_token_bitmask(matcher, bitmask, 0)
        return len(ids) + 1

    return {"tokenizer_setup_ms": round(setup_ms, 1), **_run(compile_one, walk, tokenizer, count)}


def xgrammar_figures(tokenizer, vocab_size: int, count: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup_ms = (time.perf_counter() - start) * 1000
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def compile_one(s: dict):
        compiled = compiler.compile_json_schema(json.dumps(s), any_whitespace=False, separators=(",", ":"))
        return xgr.GrammarMatcher(compiled)

    def walk(matcher, ids: list[int]) -> int:
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask, 0)
            assert matcher.accept_token(token)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return len(ids) + 1

    return {"tokenizer_setup_ms": round(setup_ms, 1), **_run(compile_one, walk, tokenizer, count)}


def _tokenizers():
    from transformers import AutoTokenizer

    from asyncllm.toy.tokenizer import build_tokenizer

    test_dir = Path(tempfile.mkdtemp(prefix="asyncllm-tok-"))
    build_tokenizer(test_dir)
    yield "test tokenizer (1,024)", AutoTokenizer.from_pretrained(test_dir), 1024
    yield "cpu-llama (16,384)", AutoTokenizer.from_pretrained(build_cpu_llama()), 16384


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grammar_engines",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=20)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    result: dict = {"engines": {}, "machine": machine_info()}
    for label, tokenizer, vocab in _tokenizers():
        for engine, figures in (("llguidance", llguidance_figures(tokenizer, vocab, args.schemas)),
                                ("xgrammar", xgrammar_figures(tokenizer, vocab, args.schemas))):
            if figures is None:
                print(f"{engine}: not installed, skipped", file=sys.stderr)
                continue
            result["engines"].setdefault(engine, {})[label] = figures
            print(f"{engine:10s} {label:24s} setup {figures['tokenizer_setup_ms']:7.1f} ms  compile "
                  f"{figures['compile_ms_median']:6.2f} ms (first {figures['compile_ms_first']:.2f})  "
                  f"mask {figures['mask_us_per_token_median']:6.1f} us/token")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
