"""Helpers of the vision-language tests: random images, their PNG bytes and data: URLs, and transformers'
greedy continuation of a prompt with images (the oracle)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    """A ``size`` (width, height) RGB image of seeded random pixels."""
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def chat_parts(texts: list[str], images: list[Image.Image]) -> tuple[list[dict], list[dict]]:
    """A user message's content with ``texts[i]`` before ``images[i]``, twice: with the images as openai
    ``image_url`` data: URLs (the request) and as transformers' ``{"type": "image"}`` (for its chat template)."""
    request, template = [], []
    for text, image in zip(texts, images):
        request += [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        template += [{"type": "text", "text": text}, {"type": "image"}]
    return request, template


def language_lora(model_dir, out_dir, targets=r".*language_model.*\.(q_proj|v_proj)", seed: int = 3):
    """A PEFT adapter (rank 4, random A and B large enough to change greedy tokens) on a vision-language
    checkpoint's language model, saved to ``out_dir``; returns the peft model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.mul_(3.0)
    model.save_pretrained(out_dir)
    return model


def greedy_reference(model, processor):
    """``greedy(text, images, max_new_tokens=8, special=True)``: transformers' greedy new token ids for the
    prompt as the checkpoint's own processor expands it (``special``: add the tokenizer's special tokens, as a
    plain prompt does; a rendered chat has them already). ``greedy.processor`` is the processor."""
    def greedy(text: str, images: list, max_new_tokens: int = 8, special: bool = True) -> list[int]:
        enc = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=special)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, enc["input_ids"].shape[1]:].tolist()

    greedy.processor = processor
    return greedy


def run_encoded_ahead(model_dir, reference, text: str, images: list, abort: bool = False, slow_tower: bool = False,
                      **engine_args) -> dict:
    """A text stream decodes while a prompt with ``images`` joins under ``encoder_token_budget=1`` (below any
    image's rows): checks both answers against transformers' and that the engine ends with nothing pending or
    held; returns what each step carried (``steps``: decode rows, images encoded ahead, image rows in the
    step) and the runner's encoder counters. ``abort``: the image request is aborted during its encoding.
    ``slow_tower``: the default encoder budget instead, and the tower taken to cost 10 s a row (its
    measurement pinned) under a calibrated step-time model, so that only the step-time target sends the
    image ahead."""
    import asyncio
    import threading

    from asyncllm import AsyncLLM, SamplingParams

    llm = AsyncLLM(str(model_dir), dtype="float32", **({} if slow_tower else {"encoder_token_budget": 1}),
                   **engine_args)
    if slow_tower:
        embeddings = llm.engine.runner.image_embeddings
        embeddings.seconds_per_row, embeddings._record_time = 10.0, lambda seconds, rows: None
        # a toy model's start-up fit may price tokens at nothing (then no step-time target applies): set one
        llm.engine.step_time.coefficients = np.array([1e-3, 1e-4, 1e-7, 1e-10, 0.0])
    executor, steps = llm.engine.runner, []
    execute = executor.execute
    aborted, image_added = threading.Event(), threading.Event()
    add_request = llm.engine.add_request

    def add(request, *args, **kwargs):
        add_request(request, *args, **kwargs)
        if request.images:
            image_added.set()

    def record(step):
        if steps:  # the text stream has its first token: it decodes on once the image prompt is in the inbox
            image_added.wait(30)
        out = execute(step)
        steps.append({"decodes": sum(1 for n in step.num_new_tokens if n == 1),
                      "ahead": [image.content_hash for image in step.encode_ahead],
                      "images": [rows.image.content_hash for rows in step.images], "ready": list(out.images_ready)})
        if abort and step.encode_ahead:
            aborted.wait(30)  # the abort is queued before the engine steps on (it applies it first)
        return out

    executor.execute = record
    llm.engine.add_request = add
    text_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    image_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main_abort():
        stream = llm.stream_outputs("a text stream that keeps decoding", text_params)
        text_tokens = list((await stream.__anext__()).outputs[0].token_ids)
        image = asyncio.ensure_future(_collect(llm.stream_outputs({"prompt": text, "images": images}, image_params,
                                                                  request_id="image")))
        while not any(s["ahead"] for s in steps):
            await asyncio.sleep(0.001)
        await llm.abort("image")  # mid-encoding: the engine thread waits in record() until this is queued
        aborted.set()
        assert await image == []
        async for out in stream:
            text_tokens.extend(out.outputs[0].token_ids)
        return text_tokens, None

    try:
        if abort:
            text_tokens, image_tokens = asyncio.run(main_abort())
        else:
            text_tokens, image_tokens = asyncio.run(_both(llm, text, images, text_params, image_params))
        embeddings = llm.engine.runner.image_embeddings
        result = {"steps": steps, "text_tokens": text_tokens, "image_tokens": image_tokens,
                  "images_encoded": embeddings.images_encoded, "stages_run": embeddings.stages_run,
                  "cache_hits": embeddings.cache_hits, "pending": embeddings.pending,
                  "kv_blocks_used": llm.stats()["kv_blocks_used"]}
    finally:
        llm.close()
    assert text_tokens == reference("a text stream that keeps decoding", [], max_new_tokens=24)
    if not abort:
        assert image_tokens == reference(text, images)
    return result


async def _collect(stream) -> list[int]:
    tokens = []
    async for out in stream:
        tokens.extend(out.outputs[0].token_ids)
    return tokens


async def _both(llm, text, images, text_params, image_params):
    """The text stream first; the image prompt once it has its first token."""
    import asyncio

    stream = llm.stream_outputs("a text stream that keeps decoding", text_params)
    text_tokens = list((await stream.__anext__()).outputs[0].token_ids)
    image = asyncio.ensure_future(_collect(llm.stream_outputs({"prompt": text, "images": images}, image_params)))
    async for out in stream:
        text_tokens.extend(out.outputs[0].token_ids)
    return text_tokens, await image


def assert_encoded_ahead(run: dict) -> int:
    """The common findings of ``run_encoded_ahead`` (no abort): the tower ran one stage a step, each step
    also decoding the running stream; the prompt's chunk came after and took the image's rows from the
    cache (in every chunk, if it spans several); nothing is left pending or held. Returns how many steps the encoding took."""
    steps = run["steps"]
    ahead = [s for s in steps if s["ahead"]]
    assert ahead and len(ahead) == run["stages_run"], (steps[:12], run["stages_run"])
    assert all(s["decodes"] >= 1 for s in ahead)
    assert ahead[-1]["ready"] == ahead[-1]["ahead"] and not any(s["ready"] for s in ahead[:-1])
    chunks = [i for i, s in enumerate(steps) if s["images"]]  # (an image may span several prefill chunks)
    assert chunks and chunks[0] > steps.index(ahead[-1]) and not any(steps[i]["ahead"] for i in chunks)
    assert run["images_encoded"] == 1 and run["cache_hits"] == len(chunks)  # no chunk's step encoded it
    assert run["pending"] == 0 and run["kv_blocks_used"] == 0
    return len(ahead)
