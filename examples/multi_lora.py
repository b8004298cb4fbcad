"""Serving several LoRA adapters at once from one base model.

Run:  python examples/multi_lora.py --model PATH --lora sql=/path/to/adapter --lora chat=/path/to/other

Each request names its adapter (or none, for the base model); requests for different adapters share
one batch. Adapters given as ``LoRARequest(name, path)`` are loaded on first use without a restart;
``add_lora`` registers one ahead of time. Without ``--lora`` the example makes two random adapters
for the demo model (this needs the ``peft`` package).
"""

from __future__ import annotations

import asyncio
import tempfile

from asyncllm import AsyncLLM, LoRARequest
from asyncllm.toy import example_parser, parse_example_args

PROMPTS = ["The quick brown fox", "Once upon a time", "My friend reads the book"]


async def run(model: str, adapters: dict[str, str], max_tokens: int = 16) -> dict:
    """Stream every prompt through every adapter and the base model concurrently."""
    async with AsyncLLM(model) as llm:
        first, *others = adapters.items()
        await llm.add_lora(*first)  # registered ahead of time
        jobs = {}
        for prompt in PROMPTS:
            jobs[("base", prompt)] = llm.generate(prompt, max_tokens=max_tokens, temperature=0)
            jobs[(first[0], prompt)] = llm.generate(prompt, lora=first[0], max_tokens=max_tokens, temperature=0)
            for name, path in others:  # hot-loaded on first use
                jobs[(name, prompt)] = llm.generate(prompt, lora=LoRARequest(name, path), max_tokens=max_tokens,
                                                    temperature=0)
        results = dict(zip(jobs, await asyncio.gather(*jobs.values())))
        print("adapters:", llm.list_loras(), "stats:", llm.stats())
    for (name, prompt), out in results.items():
        print(f"{name:>8} | {prompt!r} -> {out.outputs[0].text!r}")
    return results


def make_demo_adapters(model: str, directory: str) -> dict[str, str]:
    """Two random PEFT adapters for ``model`` (so the example runs with no files of your own)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for i, (name, targets) in enumerate((("attn", ["q_proj", "v_proj"]), ("mlp", ["gate_proj", "down_proj"]))):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model)
        peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                     init_lora_weights=False))
        adapters[name] = f"{directory}/{name}"
        peft_model.save_pretrained(adapters[name])
    return adapters


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH")
    args = parse_example_args(parser)
    adapters = dict(item.split("=", 1) for item in args.lora)
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(args.model, adapters or make_demo_adapters(args.model, tmp)))


if __name__ == "__main__":
    main()
