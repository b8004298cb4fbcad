"""Qwen2-VL and Qwen2.5-VL (docs/multimodal.md): tiny random-weight checkpoints give transformers' greedy
tokens with one and two images of different sizes and with text only, through LLM, AsyncLLM and the
server (openai SDK image parts); a prefill chunk may end inside an image; a repeated image hits the
prefix cache; the tower equals transformers' (window attention included) and the M-RoPE positions
equal transformers' ``get_rope_index``."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from server_helpers import serve_in_thread
from vision_helpers import assert_encoded_ahead, chat_parts, greedy_reference, language_lora, run_encoded_ahead

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.frontend.processor_loading import load_processor
from asyncllm.model.mrope import step_rope_positions
from asyncllm.model.step_io import ImageInput
from asyncllm.server import create_app
from asyncllm.toy.vision import build_vision_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
SMALL, WIDE = (56, 56), (112, 84)  # 2 x 2 and 4 x 3 merged tokens (the wide one spans 2.5's windows)


def _image(seed: int, size=SMALL) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    return build_vision_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf_model(vlm_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(vlm_dir, hf_model):
    processor = load_processor(vlm_dir)

    return greedy_reference(hf_model, processor)


@pytest.fixture(scope="module")
def llm(vlm_dir):
    return LLM(str(vlm_dir), dtype="float32", block_size=4)


PROMPTS = [(f"describe {IMAGE} please", [(0, SMALL)]),
           (f"first {IMAGE} then {IMAGE} and", [(0, WIDE), (1, SMALL)])]


@pytest.mark.parametrize("text,images", PROMPTS, ids=["one-image", "two-images-of-two-sizes"])
def test_greedy_equals_transformers(llm, reference, text, images):
    images = [_image(seed, size) for seed, size in images]
    (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images)
    # vLLM's spelling of the same prompt
    (again,) = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, GREEDY)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_text_only_prompts_equal_transformers(llm, reference):
    (out,) = llm.generate("a text prompt without any picture", GREEDY)
    assert out.outputs[0].token_ids == reference("a text prompt without any picture", [])
    messages = [{"role": "user", "content": "hello there"}]
    text = reference.processor.apply_chat_template(messages, add_generation_prompt=True)
    (chat,) = llm.generate(messages, GREEDY)
    assert chat.outputs[0].token_ids == reference(text, [], special=False)


def test_decode_runs_on_the_fast_path_with_shifted_positions(llm, reference):
    """After an image the decode positions are index + delta (delta < 0 here): the CPU decode stack, where the
    platform builds it, takes them as plain positions and still gives transformers' tokens."""
    runner = llm.engine.runner
    if runner.platform.decode_stack:
        assert runner.decode_stack is not None
    images = [_image(2, WIDE)]
    text = f"wide {IMAGE} picture"
    (out,) = llm.generate({"prompt": text, "images": images}, SamplingParams(temperature=0, max_tokens=16,
                                                                             ignore_eos=True))
    assert out.outputs[0].token_ids == reference(text, images, max_new_tokens=16)


def test_chunked_prefill_splits_images_and_keeps_the_tokens(vlm_dir, reference):
    """A prefill budget of 5 tokens: each image (4 and 12 tokens) arrives in pieces over several steps, and
    chunks start and end inside them."""
    small = LLM(str(vlm_dir), dtype="float32", block_size=4, max_num_batched_tokens=5, max_itl_ms=None)
    images = [_image(5, WIDE), _image(6, SMALL)]
    text = f"one {IMAGE} two {IMAGE} end"
    (out,) = small.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images)
    assert small.engine.runner.image_embeddings.images_encoded == 2  # each once, though split over chunks


def test_repeated_image_hits_the_prefix_cache(vlm_dir, reference):
    llm = LLM(str(vlm_dir), dtype="float32", block_size=4)
    text = f"look {IMAGE} at this picture closely"
    image = _image(7, WIDE)
    (first,) = llm.generate({"prompt": text, "images": [image]}, GREEDY)
    hits = llm.stats()["prefix_cache_hits"]
    (second,) = llm.generate({"prompt": text, "images": [image]}, GREEDY)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids == reference(text, [image])
    assert second.metrics.num_cached_tokens >= 12 and llm.stats()["prefix_cache_hits"] > hits  # the image's blocks
    (other,) = llm.generate({"prompt": text, "images": [_image(8, WIDE)]}, GREEDY)  # same size, other pixels
    pad = llm.engine.runner.shape.vision.image_token_id
    assert other.metrics.num_cached_tokens <= other.prompt_token_ids.index(pad)  # only the text before it
    assert other.outputs[0].token_ids == reference(text, [_image(8, WIDE)])
    assert llm.engine.runner.image_embeddings.images_encoded == 2
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("count", [1, 2], ids=["one-image", "two-images-of-two-sizes"])
def test_async_stream_and_n_equal_transformers(vlm_dir, reference, count):
    images = [_image(9, WIDE), _image(10)][:count]
    text = f"stream {IMAGE} now" if count == 1 else f"stream {IMAGE} and {IMAGE} now"
    expected = reference(text, images)

    async def main():
        llm = AsyncLLM(str(vlm_dir), dtype="float32")
        try:
            pieces = [t async for t in llm.stream({"prompt": text, "images": images}, GREEDY)]
            outputs = [o async for o in llm.stream_outputs({"prompt": text, "images": images}, GREEDY)]
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
            final = await llm.generate({"prompt": text, "images": images}, params)
            return pieces, [t for o in outputs for t in o.outputs[0].token_ids], final
        finally:
            llm.close()

    pieces, streamed, final = asyncio.run(main())
    assert streamed == expected
    assert "".join(pieces) == final.outputs[0].text
    assert [c.token_ids for c in final.outputs] == [expected, expected]  # the children fork after the prompt


@pytest.mark.parametrize("count", [1, 2], ids=["one-image", "two-images-of-two-sizes"])
def test_server_image_parts_through_the_openai_sdk(vlm_dir, reference, count):
    images = [_image(11), _image(12, WIDE)][:count]
    chat, parts = chat_parts(["what is ", " and "], images)
    text = reference.processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    # the toy tokenizer is byte-level: a stream ending inside a character holds its last bytes back
    expected = reference.processor.tokenizer.decode(reference(text, images, special=False)).rstrip("\ufffd")
    prompt_tokens = len(reference.processor(text=[text], images=images)["input_ids"][0])
    llm = AsyncLLM(str(vlm_dir), dtype="float32")
    try:
        with serve_in_thread(create_app(llm, model_name="vlm")) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
                reply = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": chat}],
                                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                assert reply.choices[0].message.content == expected
                assert reply.usage.prompt_tokens == prompt_tokens
                stream = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": chat}],
                                                        max_tokens=8, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True})
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    finally:
        llm.close()


def test_tower_equals_transformers_per_image(llm, reference, hf_model):
    """The tower's merged rows for one image equal transformers' (2.5: the wide image spans 2 x 2 windows)."""
    images = [_image(13, WIDE), _image(14, (168, 56))]
    enc = reference.processor(text=[f"{IMAGE} {IMAGE}"], images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"]).pooler_output
    model_class = llm.engine.runner.model_class
    ours = llm.engine.runner.model.encode_images(
        [ImageInput("", 0, model_class.image_rows(llm.engine.runner.shape.vision, p), p)
         for p in model_class.image_pixels(enc, 2)])
    assert [r.shape[0] for r in ours] == [e.shape[0] for e in expected] == [12, 12]
    for mine, theirs in zip(ours, expected):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def test_mrope_positions_equal_transformers_rope_index(llm, reference, hf_model):
    images = [_image(15, WIDE), _image(16)]
    text = f"a {IMAGE} b c {IMAGE} d"
    enc = reference.processor(text=[text], images=images, return_tensors="pt")
    positions, deltas = hf_model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                                      image_grid_thw=enc["image_grid_thw"])
    request = llm.inputs.process({"prompt": text, "images": images}, GREEDY)[1]
    assert request.prompt_token_ids == enc["input_ids"][0].tolist()
    assert np.array_equal(request.mrope.prompt, positions[:, 0].numpy())
    assert request.mrope.delta == int(deltas[0, 0]) < 0
    # a step cut across the prompt's end: its last prompt tokens, then two past it (index + delta)
    length = len(request.prompt_token_ids)
    rows = step_rope_positions([request.mrope, None], [length - 2, 5], [4, 1])
    assert rows.ndim == 1 and rows.tolist() == [*positions[0, 0, -2:].tolist(), length + request.mrope.delta,
                                                 length + 1 + request.mrope.delta, 5]
    spatial = step_rope_positions([request.mrope], [0], [length])
    assert spatial.shape == (3, length) and not np.array_equal(spatial[0], spatial[1])
    assert llm.inputs.process("text only", GREEDY)[1].mrope is None


def test_bad_mrope_section_is_refused_by_name():
    from asyncllm.model.rotary import MRotaryEmbedding, default_inv_freq

    with pytest.raises(ModelLoadError, match=r"rope_parameters\.mrope_section"):
        MRotaryEmbedding(default_inv_freq(10000.0, 16), 1.0, 64, [2, 2, 2])


def test_tp2_with_images_equals_transformers(vlm_dir, reference):
    """Every rank runs the whole tower; the step's M-RoPE positions travel in the step record."""
    images = [_image(17, WIDE), _image(18)]
    text = f"split {IMAGE} over {IMAGE} ranks"
    with LLM(str(vlm_dir), dtype="float32", tensor_parallel_size=2, max_model_len=256,
             kv_cache_memory=4 << 20, block_size=4) as llm:
        (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
        assert out.outputs[0].token_ids == reference(text, images)
        assert llm.stats()["kv_blocks_used"] == 0


def test_lora_on_the_language_model_equals_peft_merged(vlm_dir, tmp_path):
    from asyncllm import LoRARequest

    peft_model = language_lora(vlm_dir, tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    images, text = [_image(19, WIDE)], f"adapt {IMAGE} this"
    enc = load_processor(vlm_dir)(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        expected = merged.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    llm = LLM(str(vlm_dir), dtype="float32")
    prompt = {"prompt": text, "images": images}
    (plain,) = llm.generate(prompt, GREEDY)
    (adapted,) = llm.generate(prompt, GREEDY, lora=LoRARequest("lang", str(tmp_path / "adapter")))
    assert adapted.outputs[0].token_ids == expected != plain.outputs[0].token_ids


def test_an_image_over_the_encoder_budget_is_encoded_ahead_while_a_stream_decodes(vlm_dir, reference):
    """encoder_token_budget=1 with a stream decoding: the tower runs a block a step beside the stream's decodes
    (M-RoPE positions unchanged), then the prompt's chunk takes the image's rows from the cache."""
    run = run_encoded_ahead(vlm_dir, reference, f"look {IMAGE} here", [_image(31, WIDE)])
    depth = json.loads((vlm_dir / "config.json").read_text())["vision_config"]["depth"]
    assert assert_encoded_ahead(run) == depth >= 2  # the toy towers' blocks, one a step
