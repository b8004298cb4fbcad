"""Stream a description of an image file from a vision-language model (LLaVA), token by token.

Run:  python examples/describe_image.py IMAGE [--model PATH] [--question TEXT]

IMAGE is any file Pillow reads (PNG, JPEG, WebP...). Without ``--model`` a tiny random-weight LLaVA is
built once in the cache (its "description" is random text: point ``--model`` at a real checkpoint such as
a local copy of llava-hf/llava-1.5-7b-hf for a real one). The image goes in a chat message as a data: URL,
exactly as an OpenAI client would send it to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import mimetypes
from pathlib import Path

from asyncllm import AsyncLLM, SamplingParams


def image_message(image_path: str, question: str) -> list[dict]:
    """One user message: the question and the image as a data: URL."""
    mime = mimetypes.guess_type(image_path)[0] or "image/png"
    data = base64.b64encode(Path(image_path).read_bytes()).decode()
    return [{"role": "user", "content": [
        {"type": "text", "text": question},
        {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}},
    ]}]


async def describe(model: str, image_path: str, question: str = "Describe this picture.",
                   max_tokens: int = 48) -> str:
    """Print the answer as it streams; return it."""
    async with AsyncLLM(model) as llm:
        pieces = []
        async for piece in llm.stream(image_message(image_path, question),
                                      SamplingParams(max_tokens=max_tokens, temperature=0)):
            print(piece, end="", flush=True)
            pieces.append(piece)
        print()
        return "".join(pieces)


def default_model() -> str:
    """A tiny random-weight LLaVA in the cache (built on first use)."""
    from asyncllm.toy import default_demo_dir
    from asyncllm.toy.vision import build_vision_checkpoint

    target = default_demo_dir().parent / "llava-toy"
    if not (target / "config.json").is_file():
        build_vision_checkpoint("llava", target)
    return str(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("image")
    parser.add_argument("--model", help="a LLaVA checkpoint directory (default: a tiny random-weight one)")
    parser.add_argument("--question", default="Describe this picture.")
    args = parser.parse_args()
    asyncio.run(describe(args.model or default_model(), args.image, args.question))


if __name__ == "__main__":
    main()
