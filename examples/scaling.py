"""Past one process: a tensor-parallel engine streaming answers, and a Ray Serve application of replicas.

    python examples/scaling.py MODEL            # TP=2 streams next to the one-process engine's answers
    serve run examples.scaling:app               # (with ASYNCLLM_MODEL=MODEL) two replicas behind the router

Tensor parallelism splits one model over processes (here 2 on this machine; see docs/scaling.md for
several machines); the answers are the same tokens as one process gives. Data parallelism runs whole
engines side by side; ``asyncllm serve MODEL --data-parallel-size 2`` does what ``app`` below does.
"""

from __future__ import annotations

import asyncio
import os
import sys

from asyncllm import LLM, AsyncLLM, SamplingParams

PROMPTS = ["The capital of France is", "Three things to pack for a hike:"]


async def run(model: str, tensor_parallel_size: int = 2, max_tokens: int = 16) -> dict:
    """Stream the prompts from a TP engine concurrently; return its texts and the one-process engine's."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    with LLM(model, dtype="float32") as single:
        expected = [out.outputs[0].text for out in single.generate(PROMPTS, greedy)]
    async with AsyncLLM(model, dtype="float32", tensor_parallel_size=tensor_parallel_size) as llm:
        async def answer(prompt: str) -> str:
            pieces = []
            async for piece in llm.stream(prompt, greedy):
                pieces.append(piece)
            return "".join(pieces)

        texts = await asyncio.gather(*(answer(p) for p in PROMPTS))
    return {"tensor_parallel": list(texts), "one_process": expected}


def build_ray_app(model: str, replicas: int = 2):
    """The Ray Serve application ``asyncllm serve --data-parallel-size`` runs: ``ray.serve.run(app)``."""
    from asyncllm.integrations.ray import build_app

    return build_app(model, replicas, engine_kwargs={"dtype": "float32", "max_num_seqs": 64},
                     app_kwargs={"model_name": "my-model"})


if os.environ.get("ASYNCLLM_MODEL"):  # `serve run examples.scaling:app`
    app = build_ray_app(os.environ["ASYNCLLM_MODEL"])

if __name__ == "__main__":
    result = asyncio.run(run(sys.argv[1]))
    for prompt, tp, one in zip(PROMPTS, result["tensor_parallel"], result["one_process"]):
        print(f"{prompt!r}\n  TP=2: {tp!r}\n  TP=1: {one!r}\n  same: {tp == one}")
