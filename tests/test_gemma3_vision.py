"""Gemma 3 with images (model/gemma3_vl.py): a tiny random-weight checkpoint gives transformers' greedy tokens
with one and two images, through LLM, AsyncLLM and the server, also when the step budget is smaller than an
image (the image's block is never split: its rows attend to each other both ways); the bidirectional spans
are what makes it equal; a repeated image hits the prefix cache, and a cached prefix never ends inside one."""

from __future__ import annotations

import asyncio
import dataclasses

import openai
import pytest
import torch
from server_helpers import serve_in_thread
from vision_helpers import assert_encoded_ahead, chat_parts, greedy_reference, language_lora, run_encoded_ahead, random_image as _image

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.server import create_app
from asyncllm.toy.gemma3_vision import BOI, TOKENS_PER_IMAGE, build_gemma3_vision_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [(f"hello {BOI} world", [0]), (f"a {BOI} b {BOI} c", [0, 1])]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    return build_gemma3_vision_checkpoint(tmp_path_factory.mktemp("gemma3_vision"))


@pytest.fixture(scope="module")
def reference(gemma_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    return greedy_reference(model, AutoProcessor.from_pretrained(gemma_dir))


@pytest.mark.parametrize("budget", [None, 8, 3], ids=["whole-prompt", "chunked", "budget-below-an-image"])
@pytest.mark.parametrize("text,seeds", PROMPTS, ids=["one-image", "two-images"])
def test_greedy_equals_transformers(gemma_dir, reference, text, seeds, budget):
    kwargs = {} if budget is None else dict(max_num_batched_tokens=budget, max_itl_ms=None)
    llm = LLM(str(gemma_dir), dtype="float32", block_size=4, **kwargs)
    images = [_image(s) for s in seeds]
    (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images)
    assert llm.stats()["kv_blocks_used"] == 0


def test_the_bidirectional_spans_are_what_makes_it_equal(gemma_dir, reference):
    llm = LLM(str(gemma_dir), dtype="float32")
    runner = llm.engine.runner
    runner.shape.vision = dataclasses.replace(runner.shape.vision, bidirectional=False)  # causal inside images
    differ = 0
    for seed in range(4):
        text, images = PROMPTS[1][0], [_image(seed), _image(seed + 10)]
        (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
        differ += out.outputs[0].token_ids != reference(text, images)
    assert differ > 0


@pytest.mark.parametrize("count", [1, 2], ids=["one-image", "two-images"])
def test_chat_async_and_server_equal_transformers(gemma_dir, reference, count):
    images = [_image(3), _image(4, (64, 30))][:count]
    content, parts = chat_parts(["compare ", " with "], images)
    text = reference.processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    expected = reference(text, images, special=False)
    llm = AsyncLLM(str(gemma_dir), dtype="float32")
    try:
        async def stream():
            outs = [o async for o in llm.stream_outputs([{"role": "user", "content": content}], GREEDY)]
            return [t for o in outs for t in o.outputs[0].token_ids]

        assert asyncio.run(stream()) == expected
        with serve_in_thread(create_app(llm, model_name="gemma")) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
                reply = client.chat.completions.create(model="gemma", messages=[{"role": "user", "content": content}],
                                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == reference.processor.tokenizer.decode(expected)
    finally:
        llm.close()


def test_prefix_cache_hits_a_repeated_image_and_never_stops_inside_one(gemma_dir):
    llm = LLM(str(gemma_dir), dtype="float32", block_size=4)
    text = f"look at {BOI} this picture closely now"
    (first,) = llm.generate({"prompt": text, "images": [_image(7)]}, GREEDY)
    (second,) = llm.generate({"prompt": text, "images": [_image(7)]}, GREEDY)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    soft = llm.engine.runner.shape.vision.image_token_id
    rows = [i for i, t in enumerate(second.prompt_token_ids) if t == soft]
    assert len(rows) == TOKENS_PER_IMAGE and second.metrics.num_cached_tokens > rows[-1]
    (other,) = llm.generate({"prompt": text, "images": [_image(8)]}, GREEDY)  # same size, other pixels
    cached = other.metrics.num_cached_tokens
    assert cached <= rows[0]  # the text before the image only
    assert not rows[0] < cached < rows[-1] + 1
    assert llm.engine.runner.image_embeddings.images_encoded == 2


def test_encoder_budget_spreads_images_over_steps(gemma_dir, reference):
    """encoder_token_budget=4 (one image's rows): a prompt with three images starts one image a step."""
    llm = LLM(str(gemma_dir), dtype="float32", encoder_token_budget=TOKENS_PER_IMAGE)
    runner, started = llm.engine.runner, []
    execute = runner.execute

    def record(step):
        started.append(sum(r.count for r in step.images if r.begin == 0))
        return execute(step)

    runner.execute = record
    text, images = f"x {BOI} y {BOI} z {BOI} w", [_image(20), _image(21), _image(22)]
    (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images)
    assert max(started) == TOKENS_PER_IMAGE and sum(started) == 3 * TOKENS_PER_IMAGE
    assert sum(1 for n in started if n) == 3  # three steps, one image each


def test_lora_on_the_language_model_equals_peft_merged(gemma_dir, reference, tmp_path):
    """A PEFT adapter on the language model's attention, with an image, equals peft's merged model."""
    from asyncllm import LoRARequest

    peft_model = language_lora(gemma_dir, tmp_path / "adapter", seed=5)
    merged = greedy_reference(peft_model.merge_and_unload().eval(), reference.processor)
    text, images = f"adapt {BOI} this", [_image(23)]
    llm = LLM(str(gemma_dir), dtype="float32")
    (plain,) = llm.generate({"prompt": text, "images": images}, GREEDY)
    (adapted,) = llm.generate({"prompt": text, "images": images}, GREEDY,
                              lora=LoRARequest("lang", str(tmp_path / "adapter")))
    assert adapted.outputs[0].token_ids == merged(text, images) != plain.outputs[0].token_ids


def test_tp2_with_images_equals_transformers(gemma_dir, reference):
    text, images = f"split {BOI} over {BOI} ranks", [_image(24), _image(25)]
    with LLM(str(gemma_dir), dtype="float32", tensor_parallel_size=2, max_model_len=256,
             kv_cache_memory=4 << 20, block_size=4) as llm:
        (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
        assert out.outputs[0].token_ids == reference(text, images)
        assert llm.stats()["kv_blocks_used"] == 0


def test_an_image_over_the_encoder_budget_is_encoded_ahead_while_a_stream_decodes(gemma_dir, reference):
    """encoder_token_budget=1 (an image is 4 rows) with a stream decoding: the tower runs a layer a step beside
    the stream's decodes, and the prompt's chunk then takes the image's rows from the cache."""
    text, images = f"look {BOI} here", [_image(26)]
    run = run_encoded_ahead(gemma_dir, reference, text, images)
    assert assert_encoded_ahead(run) == 2  # the toy tower's two layers, one a step


def test_aborting_during_an_encoding_ahead_drops_it(gemma_dir, reference):
    run = run_encoded_ahead(gemma_dir, reference, f"gone {BOI} soon", [_image(27)], abort=True)
    assert any(s["ahead"] for s in run["steps"]) and not any(s["images"] for s in run["steps"])
    assert run["pending"] == 0 and run["kv_blocks_used"] == 0


def test_the_step_time_target_sends_a_slow_tower_ahead_without_an_encoder_budget(gemma_dir, reference):
    """The default encoder budget (the step's token budget, far above an image's 4 rows), but a tower measured
    at 10 s a row: the image's pass does not fit the step's time target, so it is encoded ahead too."""
    run = run_encoded_ahead(gemma_dir, reference, f"slow {BOI} tower", [_image(28)], slow_tower=True)
    assert assert_encoded_ahead(run) == 2


PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 3,
                "pan_and_scan_min_ratio_to_activate": 1.2}


def test_pan_and_scan_through_mm_processor_kwargs_equals_transformers(gemma_dir):
    """Pan-and-scan (off unless mm_processor_kwargs turns it on): a wide image becomes the image and its crops,
    each a block of its own, and the greedy tokens equal transformers' with the same processor arguments."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(gemma_dir)
    model = AutoModelForImageTextToText.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    text, images = f"wide {BOI} and square {BOI} done", [_image(29, (120, 40)), _image(30)]
    enc = processor(text=[text], images=images, return_tensors="pt", **PAN_AND_SCAN)
    assert enc["pixel_values"].shape[0] > len(images)  # crops were added
    with torch.no_grad():
        expected = model.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    llm = LLM(str(gemma_dir), dtype="float32", mm_processor_kwargs=PAN_AND_SCAN)
    (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == expected
    assert llm.engine.runner.image_embeddings.images_encoded == enc["pixel_values"].shape[0]
    (plain,) = LLM(str(gemma_dir), dtype="float32").generate({"prompt": text, "images": images}, GREEDY)
    assert len(plain.prompt_token_ids) < len(out.prompt_token_ids)  # off by default
    with pytest.raises(Exception, match="mm_processor_kwargs"):
        LLM(str(gemma_dir), dtype="float32", mm_processor_kwargs={"images": 1})


def test_an_encoding_ahead_survives_steps_that_skip_it_and_is_dropped_after_the_grace(gemma_dir):
    """A pass under way keeps its progress through steps that do not list its image (a preemption, a full
    step), finishes with the whole pass's rows, and is held until a chunk takes it; one unlisted for longer
    than AHEAD_GRACE_STEPS is dropped."""
    from asyncllm.model.image_embeddings import AHEAD_GRACE_STEPS

    llm = LLM(str(gemma_dir), dtype="float32")
    runner, seen = llm.engine.runner, []
    execute = runner.execute
    runner.execute = lambda step: (seen.extend(r.image for r in step.images), execute(step))[1]
    llm.generate({"prompt": f"a {BOI} b", "images": [_image(31)]}, GREEDY)
    image, embeddings = seen[0], runner.image_embeddings
    whole = runner.model.encode_images([image])[0]
    embeddings._cache.clear()
    assert embeddings.advance([image], 0) == [] and embeddings.pending == 1  # one layer of two
    for _ in range(AHEAD_GRACE_STEPS):
        assert embeddings.advance([], 0) == []
    assert embeddings.pending == 1
    assert embeddings.advance([image], 0) == [image.content_hash]
    embeddings._cache.clear()  # taken from the held rows even when the cache lost them
    rows = embeddings._features([image])[image.content_hash]
    torch.testing.assert_close(rows, whole)
    assert embeddings.pending == 0
    embeddings._cache.clear()
    embeddings.advance([image], 0)
    for _ in range(AHEAD_GRACE_STEPS + 1):
        embeddings.advance([], 0)
    assert embeddings.pending == 0
