"""The server under hostile input and faults: every reproduction of issue #12 is a clear 4xx, the
next request is served, LoRA loading is opt-in and says nothing about the host, faults heal."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from asyncllm.errors import ConfigError
from fault_injection import inject_faults
from server_helpers import assert_error
from server_helpers import request as call

CHAT = [{"role": "user", "content": "Tell me about the cat"}]


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", max_model_len=128)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def app(llm):
    return create_app(llm, model_name="tiny")


def served(app) -> None:
    """The next normal request is answered."""
    response = call(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 15_000}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 10**6}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**12}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [5]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}}, "response_format"),
])
def test_reproductions_are_400s_and_the_next_request_is_served(app, route, body, param):
    assert_error(call(app, "POST", route, json=body), 400, param)
    served(app)


def test_max_tokens_error_names_both_numbers_and_omitted_means_the_rest(app, llm):
    error = assert_error(call(app, "POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 10**12}), 400)
    assert str(10**12) in error["message"] and str(llm.max_model_len) in error["message"]
    chat = call(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True}).json()
    usage = chat["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == llm.max_model_len  # no max_tokens: all of it


def test_lone_surrogates_and_tiny_temperatures(app):
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    assert_error(call(app, "POST", "/v1/chat/completions", content=raw,
                      headers={"content-type": "application/json"}), 400)
    greedy = call(app, "POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0})
    tiny = call(app, "POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 1e-40})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# ---- bodies -------------------------------------------------------------------------------------------

def test_body_limit_and_json_only(llm):
    app = create_app(llm, max_body_bytes=1000)
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    error = assert_error(call(app, "POST", "/v1/chat/completions", json=big), 413)
    assert "1000 bytes" in error["message"]

    async def chunked():  # no Content-Length: the limit holds while the body streams in
        async def parts():
            for _ in range(5):
                yield b" " * 400

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/tokenize", content=parts(), headers={"content-type": "application/json"})

    assert_error(asyncio.run(chunked()), 413)
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
        headers = {"content-type": content_type} if content_type else {}
        assert_error(call(app, "POST", "/v1/completions", content=b'{"prompt": "x"}', headers=headers), 415)
    ok = call(app, "POST", "/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}',
              headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200
    with pytest.raises(ConfigError):
        create_app(llm, max_body_bytes=0)


def test_default_body_limit_refuses_a_5_mb_message(app):
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (5 << 20)}]})
    assert_error(call(app, "POST", "/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}), 413)
    served(app)


# ---- LoRA loading and host paths -------------------------------------------------------------------

def test_lora_loading_is_opt_in_and_confined(llm, model_dirs, tmp_path):
    pytest.importorskip("peft")
    from server_helpers import build_test_adapter

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    build_test_adapter(model_dirs["llama"], allowed / "sql")
    outside = build_test_adapter(model_dirs["llama"], tmp_path / "outside")
    (allowed / "escape").symlink_to(outside)

    closed = create_app(llm)
    assert_error(call(closed, "POST", "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(outside)}),
                 403)
    with pytest.raises(ConfigError, match="list the directories"):
        create_app(llm, allow_lora_loading=True)

    app = create_app(llm, allow_lora_loading=[allowed])
    for path in (str(outside), "../outside", "escape", "/etc", "/nonexistent/x", str(allowed / "missing")):
        error = assert_error(call(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": path}),
                             400, "lora_path")
        for secret in (str(tmp_path), "/etc", str(os.getpid()), os.path.expanduser("~"), os.getcwd()):
            assert secret not in error["message"], error
    assert llm.list_loras() == []
    try:
        assert call(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "sql"}).status_code \
            == 200
        cards = call(app, "GET", "/v1/models").json()["data"]
        assert [c["id"] for c in cards] == [create_app(llm).state.asyncllm.model_name, "sql"]
        assert not any(str(tmp_path) in json.dumps(card) or str(model_dirs["llama"]) in json.dumps(card)
                       for card in cards)  # no host paths
    finally:
        call(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "sql"})


# ---- faults and backpressure -------------------------------------------------------------------------

def test_engine_fault_over_http_heals(model_dirs):
    # whole prefills (max_itl_ms=None): on a loaded machine the latency policy may cut the prompt into more
    # chunks than the fault waits for, and the fault must come after the stream has started
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", max_model_len=512, max_itl_ms=None)
    app = create_app(llm, model_name="tiny")
    inject_faults(llm, after_calls=5, times=1)
    try:
        stream = call(app, "POST", "/v1/chat/completions",
                      json={"messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True})
        events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_unavailable" and "injected engine fault" in error["message"]
        assert call(app, "GET", "/health").status_code == 200  # rebuilt in the same process
        metrics = call(app, "GET", "/metrics").text
        assert 'asyncllm:num_requests_running{model_name="tiny"} 0.0' in metrics
        assert 'asyncllm:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics
        served(app)
    finally:
        llm.close()


def test_full_waiting_queue_is_429_with_retry_after(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", max_num_seqs=1, max_waiting_requests=1,
                   max_model_len=512)
    app = create_app(llm)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=30) as client:
            long = {"prompt": [5, 6], "max_tokens": 500, "ignore_eos": True}
            first = asyncio.create_task(client.post("/v1/completions", json=long))
            while llm.stats()["num_running"] == 0:
                await asyncio.sleep(0.005)
            second = asyncio.create_task(client.post("/v1/completions", json=long))

            async def queued():  # the second waits behind the first (one seat): the queue is full
                while llm.stats()["num_waiting"] < 1:
                    await asyncio.sleep(0.001)

            await asyncio.wait_for(queued(), 10)
            third = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert third.status_code == 429, third.text
            assert int(third.headers["retry-after"]) >= 1
            assert third.json()["error"]["code"] == "too_many_requests"
            assert (await first).status_code == 200 and (await second).status_code == 200

    try:
        asyncio.run(main())
    finally:
        llm.close()
