"""Vision-language models (docs/multimodal.md): tiny random-weight LLaVA checkpoints (CLIP and SigLIP
towers, LLaVA-NeXT's tiles) give transformers' greedy tokens with one and two images, through LLM, AsyncLLM and the server
(openai SDK image parts); repeated images hit the prefix and encoder caches, different ones never do;
bad images are 400s naming the part, and decoding a large image leaves the event loop free."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import zlib

import openai
import pytest
import torch
from server_helpers import assert_error, request, serve_in_thread
from vision_helpers import (assert_encoded_ahead, chat_parts, data_url as _data_url, greedy_reference, language_lora,
                            png_bytes as _png, random_image as _image, run_encoded_ahead)

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.server import create_app
from asyncllm.toy.vision import build_vision_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _huge_png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (its data never needs to be read)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


@pytest.fixture(scope="module", params=["llava", "llava_siglip", "llava_next"])
def vlm_dir(request, tmp_path_factory):
    return build_vision_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def reference(vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    return greedy_reference(model, AutoProcessor.from_pretrained(vlm_dir))


@pytest.fixture(scope="module")
def llm(vlm_dir):
    return LLM(str(vlm_dir), dtype="float32", block_size=4)


PROMPTS = [("describe <image> please", [0]), ("first <image> then <image> and", [0, 1])]


@pytest.mark.parametrize("text,seeds", PROMPTS, ids=["one-image", "two-images"])
def test_greedy_equals_transformers(llm, reference, text, seeds):
    images = [_image(s) for s in seeds]
    (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images)
    # vLLM's spelling of the same prompt, and the images as PNG bytes
    (again,) = llm.generate({"prompt": text, "multi_modal_data": {"image": [_png(i) for i in images]}}, GREEDY)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_image_parts_equal_transformers(llm, reference):
    images = [_image(3), _image(4, (64, 30))]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "compare "}, {"type": "image_url", "image_url": {"url": _data_url(images[0])}},
        {"type": "text", "text": " with "}, {"type": "image", "image": images[1]}]}]
    text = reference.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "compare "}, {"type": "image"},
                                      {"type": "text", "text": " with "}, {"type": "image"}]}],
        add_generation_prompt=True)
    (out,) = llm.generate(messages, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images, special=False)


def test_chunked_prefill_splits_an_image_and_keeps_the_tokens(vlm_dir, reference):
    """A prefill budget smaller than an image's 16 placeholders: the image arrives in pieces over steps."""
    small = LLM(str(vlm_dir), dtype="float32", block_size=4, max_num_batched_tokens=8, max_itl_ms=None)
    images = [_image(5), _image(6)]
    text = "one <image> two <image> end"
    (out,) = small.generate({"prompt": text, "images": images}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, images)
    assert small.engine.runner.image_embeddings.images_encoded == 2  # each once, though split over chunks


def test_repeated_image_hits_the_caches_and_a_different_one_misses(vlm_dir):
    llm = LLM(str(vlm_dir), dtype="float32", block_size=4)
    runner, text = llm.engine.runner, "look <image> at this picture closely"
    (first,) = llm.generate({"prompt": text, "images": [_image(7)]}, GREEDY)
    hits = llm.stats()["prefix_cache_hits"]
    (second,) = llm.generate({"prompt": text, "images": [_image(7)]}, GREEDY)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert second.metrics.num_cached_tokens >= 16 and llm.stats()["prefix_cache_hits"] > hits  # the image's blocks
    (other,) = llm.generate({"prompt": text, "images": [_image(8)]}, GREEDY)  # same size, other pixels
    placeholders = [i for i, t in enumerate(other.prompt_token_ids) if t == runner.shape.vision.image_token_id]
    assert other.metrics.num_cached_tokens <= placeholders[0]  # only the text before the image is shared
    assert runner.image_embeddings.images_encoded == 2
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("count", [1, 2], ids=["one-image", "two-images"])
def test_async_stream_and_n_equal_transformers(vlm_dir, reference, count):
    images = [_image(9), _image(21)][:count]
    text = "stream <image> now" if count == 1 else "stream <image> and <image> now"
    expected = reference(text, images)

    async def main():
        llm = AsyncLLM(str(vlm_dir), dtype="float32")
        try:
            pieces = [t async for t in llm.stream({"prompt": text, "images": images}, GREEDY)]
            outputs = [o async for o in llm.stream_outputs({"prompt": text, "images": images}, GREEDY)]
            tokens = (pieces, [t for o in outputs for t in o.outputs[0].token_ids])  # each output: the new tokens
            params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)
            final = await llm.generate({"prompt": text, "images": images}, params)
            return tokens, final
        finally:
            llm.close()

    (pieces, streamed), final = asyncio.run(main())
    assert streamed == expected
    assert "".join(pieces) == final.outputs[0].text
    assert [c.token_ids for c in final.outputs] == [expected, expected]


@pytest.mark.parametrize("count", [1, 2], ids=["one-image", "two-images"])
def test_server_image_parts_through_the_openai_sdk(vlm_dir, reference, count):
    images = [_image(10), _image(11)][:count]
    chat, parts = chat_parts(["what is ", " and "], images)
    text = reference.processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
    expected = reference.processor.tokenizer.decode(reference(text, images, special=False))
    llm = AsyncLLM(str(vlm_dir), dtype="float32")
    try:
        with serve_in_thread(create_app(llm, model_name="vlm")) as url:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
                reply = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": chat}],
                                                       max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                assert reply.choices[0].message.content == expected
                stream = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": chat}],
                                                        max_tokens=8, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True})
                assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    finally:
        llm.close()


def _chat_with(part: dict) -> dict:
    return {"model": "vlm", "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "see "}, part]}]}


def test_bad_images_are_400s_naming_the_part(vlm_dir):
    llm = AsyncLLM(str(vlm_dir), dtype="float32", limit_mm_per_prompt={"image": 2})
    app = create_app(llm, model_name="vlm")
    try:
        truncated = _png(_image(12))[:120]
        cases = {
            "truncated": ("data:image/png;base64," + base64.b64encode(truncated).decode(), "cannot be decoded"),
            "huge": ("data:image/png;base64," + base64.b64encode(_huge_png_header(20000, 20000)).decode(),
                     "max_image_pixels"),
            "url": ("http://example.com/cat.png", "fetching image URLs is off"),
            "file": ("/etc/passwd", "local image files are not allowed"),
            "not base64": ("data:image/png;base64,@@@", "not valid base64"),
        }
        for name, (url, words) in cases.items():
            error = assert_error(request(app, "POST", "/v1/chat/completions",
                                         json=_chat_with({"type": "image_url", "image_url": {"url": url}})), 400)
            assert "messages[0].content[1]" in error["message"] and words in error["message"], (name, error)
        many = {"type": "image_url", "image_url": {"url": _data_url(_image(13))}}
        body = _chat_with(many)
        body["messages"][0]["content"] += [many, many]
        error = assert_error(request(app, "POST", "/v1/chat/completions", json=body), 400)
        assert "at most 2 images" in error["message"] and "messages[0].content[3]" in error["message"]
        error = assert_error(request(app, "POST", "/v1/chat/completions",
                                     json=_chat_with({"type": "image_url", "image_url": {"uri": "x"}})), 400)
        assert "messages[0].content[1].image_url.url" in error["message"]
        assert llm.engine.stats()["kv_blocks_used"] == 0
    finally:
        llm.close()


def test_python_api_image_errors(llm):
    with pytest.raises(InvalidRequestError, match=r"prompt.images\[0\]: the image has more pixels than max_image_pixels"):
        llm.generate({"prompt": "a <image>", "images": [_huge_png_header(20000, 20000)]}, GREEDY)
    with pytest.raises(InvalidRequestError, match=r"prompt.images\[0\]: the image is 8000 x 6000 pixels"):
        llm.generate({"prompt": "a <image>", "images": [_huge_png_header(8000, 6000)]}, GREEDY)
    with pytest.raises(InvalidRequestError, match=r"prompt: the text has 1 image placeholder\(s\) '<image>' for 2 image\(s\)"):
        llm.generate({"prompt": "only one <image>", "images": [_image(1), _image(2)]}, GREEDY)
    with pytest.raises(InvalidRequestError, match="unknown key"):
        llm.generate({"prompt": "a <image>", "image": [_image(1)]}, GREEDY)


def test_text_models_refuse_images_by_part(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].content\[1\]: this model takes no images"):
        llm.generate(messages, GREEDY)
    with pytest.raises(InvalidRequestError, match=r"prompt.images\[0\]: this model takes no images"):
        llm.generate({"prompt": "hi", "images": [_image(1)]}, GREEDY)
    (plain,) = llm.generate("hi there", GREEDY)  # no images: the mapping is just its text
    (mapped,) = llm.generate({"prompt": "hi there", "images": []}, GREEDY)
    assert mapped.outputs[0].token_ids == plain.outputs[0].token_ids


def test_local_files_under_the_allowed_directories(vlm_dir, tmp_path, reference):
    first, second, other = tmp_path / "cats", tmp_path / "dogs", tmp_path / "private"
    for folder in (first, second, other):
        folder.mkdir()
    (first / "cat.png").write_bytes(_png(_image(14)))
    (second / "dog.png").write_bytes(_png(_image(15)))
    (other / "secret.png").write_bytes(_png(_image(16)))
    (first / "link.png").symlink_to(other / "secret.png")  # a link out of the directory counts as outside
    text = "a <image> b <image> c"
    llm = LLM(str(vlm_dir), dtype="float32", allowed_local_media_path=str(first))
    with pytest.raises(InvalidRequestError, match="outside allowed_local_media_path"):
        llm.generate({"prompt": "a <image> b", "images": [str(second / "dog.png")]}, GREEDY)
    llm = LLM(str(vlm_dir), dtype="float32", allowed_local_media_path=[str(first), str(second)])
    (out,) = llm.generate({"prompt": text, "images": [str(first / "cat.png"), f"file://{second}/dog.png"]}, GREEDY)
    assert out.outputs[0].token_ids == reference(text, [_image(14), _image(15)])
    for escape in (first / ".." / "private" / "secret.png", first / "link.png"):
        with pytest.raises(InvalidRequestError, match=r"images\[0\].*outside allowed_local_media_path"):
            llm.generate({"prompt": "a <image> b", "images": [str(escape)]}, GREEDY)


def test_decoding_a_large_image_leaves_the_loop_free(vlm_dir):
    """A 3000 x 3000 PNG decodes and resizes in the input worker: the loop's ticks never wait 100 ms."""
    big = _png(_image(15, (3000, 3000)))

    async def main():
        llm = AsyncLLM(str(vlm_dir), dtype="float32", max_image_bytes=64 * 2**20)
        try:
            worst, done = 0.0, False

            async def ticker():
                nonlocal worst
                last = time.perf_counter()
                while not done:
                    await asyncio.sleep(0.005)
                    now = time.perf_counter()
                    worst, last = max(worst, now - last), now

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            out = await llm.generate({"prompt": "a <image> b", "images": [big]}, GREEDY)
            done = True
            await tick
            return worst, out
        finally:
            llm.close()

    worst, out = asyncio.run(main())
    assert len(out.outputs[0].token_ids) == 8
    assert worst < 0.1, f"the loop waited {worst * 1000:.0f} ms"


def test_responses_input_image_anthropic_image_blocks_and_token_counts(vlm_dir):
    """The same picture through /v1/chat/completions, /v1/responses (input_image) and /v1/messages (an
    Anthropic image block) gives the same greedy text; /tokenize and count_tokens count its placeholders."""
    image = _image(16)
    b64 = base64.b64encode(_png(image)).decode()
    url = "data:image/png;base64," + b64
    llm = AsyncLLM(str(vlm_dir), dtype="float32")
    app = create_app(llm, model_name="vlm")
    try:
        chat = request(app, "POST", "/v1/chat/completions", json={
            "model": "vlm", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is "}, {"type": "image_url", "image_url": {"url": url}}]}]}).json()
        expected = chat["choices"][0]["message"]["content"]
        assert expected
        responses = request(app, "POST", "/v1/responses", json={
            "model": "vlm", "max_output_tokens": 6, "temperature": 0, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "what is "}, {"type": "input_image", "image_url": url}]}]}).json()
        assert responses["output"][-1]["content"][0]["text"] == expected
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "what is "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]
        anthropic = request(app, "POST", "/v1/messages", json={
            "model": "vlm", "max_tokens": 6, "temperature": 0, "messages": messages}).json()
        assert anthropic["content"][0]["text"] == expected
        counted = request(app, "POST", "/v1/messages/count_tokens", json={"model": "vlm", "messages": messages})
        tokenized = request(app, "POST", "/tokenize", json={"model": "vlm", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is "}, {"type": "image_url", "image_url": {"url": url}}]}]}).json()
        assert counted.json()["input_tokens"] == tokenized["count"] == chat["usage"]["prompt_tokens"]
        image_id = llm.engine.runner.shape.vision.image_token_id
        from transformers import AutoProcessor

        expanded = AutoProcessor.from_pretrained(vlm_dir)(text=["what is <image>"], images=[image], return_tensors="pt")
        assert tokenized["tokens"].count(image_id) == int((expanded["input_ids"] == image_id).sum()) >= 16
    finally:
        llm.close()


def test_lora_on_the_language_model_equals_peft_merged(vlm_dir, reference, tmp_path):
    from asyncllm import LoRARequest

    peft_model = language_lora(vlm_dir, tmp_path / "adapter")
    merged = peft_model.merge_and_unload().eval()
    images, text = [_image(17)], "adapt <image> this"
    enc = reference.processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        expected = merged.generate(**enc, max_new_tokens=8, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    llm = LLM(str(vlm_dir), dtype="float32")
    prompt = {"prompt": text, "images": images}
    (base,) = llm.generate(prompt, GREEDY)
    (adapted,) = llm.generate(prompt, GREEDY, lora=LoRARequest("lang", str(tmp_path / "adapter")))
    assert adapted.outputs[0].token_ids == expected != base.outputs[0].token_ids
    language_lora(vlm_dir, tmp_path / "tower", targets=["q_proj", "v_proj"])  # the tower's too
    with pytest.raises(Exception, match="adapts the vision side"):
        llm.generate(prompt, GREEDY, lora=LoRARequest("tower", str(tmp_path / "tower")))


def test_tp2_with_images_equals_transformers(vlm_dir, reference):
    images = [_image(18), _image(19)]
    text = "split <image> over <image> ranks"
    with LLM(str(vlm_dir), dtype="float32", tensor_parallel_size=2, max_model_len=256,
             kv_cache_memory=4 << 20, block_size=4) as llm:
        (out,) = llm.generate({"prompt": text, "images": images}, GREEDY)
        assert out.outputs[0].token_ids == reference(text, images)
        assert llm.stats()["kv_blocks_used"] == 0


def test_structured_output_with_an_image(llm):
    params = SamplingParams(temperature=0, max_tokens=12, choice=["cat", "dog", "bird"])
    (out,) = llm.generate({"prompt": "which animal <image> is it?", "images": [_image(20)]}, params)
    assert out.outputs[0].text in ("cat", "dog", "bird")


def test_describe_image_example_streams_the_greedy_answer(vlm_dir, tmp_path, llm, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "describe_image.py"
    spec = importlib.util.spec_from_file_location("describe_image", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    image = tmp_path / "picture.png"
    image.write_bytes(_png(_image(21)))
    text = asyncio.run(example.describe(str(vlm_dir), str(image), "What is this?", max_tokens=10))
    (expected,) = llm.generate(example.image_message(str(image), "What is this?"),
                               SamplingParams(temperature=0, max_tokens=10))
    assert text == expected.outputs[0].text and text in capsys.readouterr().out


def test_serve_flags_reach_the_image_limits():
    from asyncllm.cli import build_parser
    from asyncllm.server.serve_spec import engine_extras

    args = build_parser().parse_args(["serve", "model", "--limit-mm-per-prompt", '{"image": 2}',
                                      "--allowed-media-domains", "img.example.com,cdn.example.org",
                                      "--max-image-pixels", "1000000", "--media-fetch-timeout", "2.5",
                                      "--allowed-local-media-path", "/srv/a", "--allowed-local-media-path", "/srv/b",
                                      "--mm-processor-kwargs", '{"do_pan_and_scan": true}'])
    assert engine_extras(args) == {"limit_mm_per_prompt": {"image": 2}, "max_image_pixels": 1000000,
                                   "allowed_media_domains": ["img.example.com", "cdn.example.org"],
                                   "media_fetch_timeout": 2.5, "allowed_local_media_path": ["/srv/a", "/srv/b"],
                                   "mm_processor_kwargs": {"do_pan_and_scan": True}}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "model", "--limit-mm-per-prompt", "[1]"])


@pytest.mark.parametrize("kwargs,name", [
    (dict(limit_mm_per_prompt={"video": 1}), "limit_mm_per_prompt"),
    (dict(limit_mm_per_prompt={"image": -1}), "limit_mm_per_prompt"),
    (dict(max_image_pixels=0), "max_image_pixels"),
    (dict(media_fetch_timeout=float("inf")), "media_fetch_timeout"),
    (dict(allowed_media_domains="example.com"), "allowed_media_domains"),
    (dict(allowed_local_media_path="/no/such/dir"), "allowed_local_media_path"),
    (dict(allowed_local_media_path=["/tmp", "/no/such/dir"]), "allowed_local_media_path"),
    (dict(allowed_local_media_path=[]), "allowed_local_media_path"),
    (dict(mm_processor_kwargs=["do_pan_and_scan"]), "mm_processor_kwargs"),
])
def test_bad_media_arguments_name_themselves(kwargs, name):
    from asyncllm.config import EngineConfig
    from asyncllm.errors import ConfigError

    with pytest.raises(ConfigError, match=name):
        EngineConfig.from_kwargs("model", kwargs)


def test_image_urls_are_fetched_only_from_allowed_hosts_within_limits(vlm_dir, reference):
    """A local HTTP server stands in for an image host: allowed, it serves; too big, too slow, a 404 or
    a host not listed are 400s naming the part."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    png = _png(_image(22))

    async def image(request):
        name = request.path_params["name"]
        if name == "slow.png":
            await asyncio.sleep(3)
        if name == "missing.png":
            return Response(status_code=404)
        body = png * 8 if name == "big.png" else png
        return Response(body, media_type="image/png")

    host = Starlette(routes=[Route("/{name}", image)])
    with serve_in_thread(host) as url:
        llm = LLM(str(vlm_dir), dtype="float32", allowed_media_domains=["127.0.0.1"], max_image_bytes=len(png) * 2,
                  media_fetch_timeout=1.0)
        messages = lambda name: [{"role": "user", "content": [  # noqa: E731
            {"type": "text", "text": "see "}, {"type": "image_url", "image_url": {"url": f"{url}/{name}"}}]}]
        (out,) = llm.generate(messages("cat.png"), GREEDY)
        (direct,) = llm.generate(messages("cat.png")[:0] or [{"role": "user", "content": [
            {"type": "text", "text": "see "}, {"type": "image", "image": _image(22)}]}], GREEDY)
        assert out.outputs[0].token_ids == direct.outputs[0].token_ids
        for name, words in [("big.png", "max_image_bytes"), ("slow.png", "cannot fetch the image"),
                            ("missing.png", "HTTP 404")]:
            with pytest.raises(InvalidRequestError, match=rf"messages\[0\].content\[1\]: .*{words}"):
                llm.generate(messages(name), GREEDY)
        other = LLM(str(vlm_dir), dtype="float32", allowed_media_domains=["images.example.com"])
        with pytest.raises(InvalidRequestError, match="host '127.0.0.1' are not allowed"):
            other.generate(messages("cat.png"), GREEDY)


def test_forced_tool_call_with_an_image(tmp_path):
    llm = LLM(str(build_vision_checkpoint("llava", tmp_path, max_position_embeddings=2048)), dtype="float32")
    tools = [{"type": "function", "function": {"name": "label", "description": "label the picture",
                                               "parameters": {"type": "object", "properties": {
                                                   "animal": {"type": "string", "enum": ["cat", "dog"]}},
                                                   "required": ["animal"]}}}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "label this "},
                                             {"type": "image", "image": _image(23)}]}]
    (out,) = llm.generate(messages, SamplingParams(temperature=0, max_tokens=400), tools=tools, tool_choice="required")
    calls = out.outputs[0].tool_calls
    assert calls and calls[0].name == "label" and calls[0].arguments in ('{"animal": "cat"}', '{"animal": "dog"}')


def test_an_image_over_the_encoder_budget_is_encoded_ahead_while_a_stream_decodes(vlm_dir, reference):
    """encoder_token_budget=1 with a stream decoding: the tower's pass runs beside the stream's decodes, before
    the prompt's chunk, a layer a step up to the feature layer (one or two of the toy towers')."""
    run = run_encoded_ahead(vlm_dir, reference, "look <image> here", [_image(30)])
    assert assert_encoded_ahead(run) >= 1
