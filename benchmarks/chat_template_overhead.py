"""What the bounded sandbox costs per chat rendering, against transformers' apply_chat_template.

    python -m benchmarks.chat_template_overhead [--repeats 2000] [--json out.json]

Renders a typical 10-message chat (a system prompt and nine alternating turns, one of them a tool
call and its result where the template knows tools) with the test tokenizer and several chat
templates, through ``tokenizer.apply_chat_template(tokenize=False)`` and through
asyncllm/frontend/chat_template.py, and prints the best-of-5 microseconds per render of each (the
texts are checked equal first). The templates are those of tests/chat_templates.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test templates live there

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


def chat(with_tools: bool) -> list[dict]:
    """Ten messages: system, then user and assistant turns; with tools, one call and its result."""
    messages = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."}]
    for i in range(9):
        role = "user" if i % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"Turn {i}: a sentence or two of ordinary text, as people write."})
    if with_tools:
        messages[4] = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
        messages[5] = {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 4}'}
    return messages


def best_us(function: Callable[[], object], repeats: int) -> float:
    function()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            function()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    import chat_templates
    from transformers import AutoTokenizer

    from asyncllm.frontend.chat_template import render_chat_template
    from asyncllm.toy.tokenizer import build_tokenizer

    folder = tempfile.mkdtemp()
    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cases = [("toy chatml", tokenizer.chat_template, False), ("qwen2.5 + tools", chat_templates.QWEN25, True),
             ("qwen3 + tools", chat_templates.QWEN3, True), ("llama3 + tools", chat_templates.LLAMA3, True)]
    rows = []
    print(f"{'template':<18}{'apply_chat_template':>21}{'sandbox':>10}{'overhead':>10}  (µs per render)")
    for name, template, with_tools in cases:
        tokenizer.chat_template = template
        messages, tools = chat(with_tools), [WEATHER] if with_tools else None
        theirs = lambda: tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,  # noqa: E731
                                                       tokenize=False)
        ours = lambda: render_chat_template(tokenizer, messages, tools, add_generation_prompt=True)  # noqa: E731
        assert theirs() == ours(), name
        row = {"template": name, "apply_chat_template_us": best_us(theirs, args.repeats),
               "sandbox_us": best_us(ours, args.repeats)}
        row["overhead_us"] = row["sandbox_us"] - row["apply_chat_template_us"]
        rows.append(row)
        print(f"{name:<18}{row['apply_chat_template_us']:>21.0f}{row['sandbox_us']:>10.0f}{row['overhead_us']:>+10.0f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
