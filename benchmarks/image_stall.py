"""How long a running stream waits while a large image is encoded: one text stream decodes, an image prompt
joins, and the stream's inter-token gaps are recorded, with the image's tower pass in one step (the default
encoder budget, above the image's rows) and encoded ahead (``--budgets``: encoder_token_budget values below
them). The checkpoint is a random-weight LLaVA whose tower has a real tower's sizes (CLIP ViT-B/16 at 224
pixels by default: 12 layers of width 768, 197 rows an image) over a small language model.

    python -m benchmarks.image_stall [--layers 12 --width 768 --image-size 224 --patch 16] [--budgets 0,16]

``0`` in ``--budgets`` stands for the default budget. Figures: docs/multimodal.md ("Scheduling").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.toy.vision import build_vision_checkpoint


def build(out: Path, layers: int, width: int, image_size: int, patch: int) -> Path:
    tower = dict(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                 num_attention_heads=max(width // 64, 1), image_size=image_size, patch_size=patch)
    return build_vision_checkpoint("llava", out, tower_overrides=tower)


async def one_run(model: Path, budget: int | None, tokens: int, join_after: int) -> dict:
    llm = AsyncLLM(str(model), dtype="float32", encoder_token_budget=budget)
    try:
        image = Image.fromarray((np.random.RandomState(0).rand(300, 400, 3) * 255).astype("uint8"))
        warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        await llm.generate({"prompt": "warm <image> up", "images": [image.rotate(90)]}, warm)
        stamps, joined = [], None
        image_task = None
        async for _ in llm.stream("a stream that keeps decoding",
                                  SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)):
            stamps.append(time.perf_counter())
            if len(stamps) == join_after:
                joined = time.perf_counter()
                image_task = asyncio.ensure_future(llm.generate(
                    {"prompt": "describe <image> now", "images": [image]},
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
        await image_task
        gaps = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
        before = gaps[:join_after - 1]
        after = gaps[join_after - 1:]
        return {"encoder_token_budget": budget, "gap_p50_ms": round(statistics.median(before), 2),
                "max_gap_after_join_ms": round(max(after), 2),
                "image_request_s": round(time.perf_counter() - joined, 3),
                "images_encoded": llm.engine.runner.image_embeddings.images_encoded,
                "stages_run": llm.engine.runner.image_embeddings.stages_run}
    finally:
        llm.close()


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.image_stall", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--patch", type=int, default=16)
    p.add_argument("--budgets", default="0,16", help="encoder_token_budget values (0: the default)")
    p.add_argument("--tokens", type=int, default=160, help="tokens of the running stream")
    p.add_argument("--join-after", type=int, default=40, help="the image prompt joins after this many tokens")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    if args.join_after < 2 or args.tokens <= args.join_after:
        p.error("--join-after must be at least 2 and below --tokens")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp) / "llava", args.layers, args.width, args.image_size, args.patch)
        for _ in range(args.repeats):
            for budget in [int(b) for b in args.budgets.split(",")]:
                result = asyncio.run(one_run(model, budget or None, args.tokens, args.join_after))
                print(json.dumps(result), flush=True)
                results.append(result)
    return results


if __name__ == "__main__":
    main()
