"""The official ``openai`` client against the sub-app mounted in a host app, served by uvicorn.

One uvicorn server (a background thread, a free port on 127.0.0.1) serves a host Starlette app
with the sub-app under ``/llm`` and a second one, with an API key, under ``/secure``.
"""

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from server_helpers import build_test_adapter, serve_in_thread, start_serve

from asyncllm import AsyncLLM
from asyncllm.server import create_app

CHAT = [{"role": "user", "content": "Tell me a story about the old man"}]
MAX_LEN = 4096  # long enough that a request left to run would take seconds


@pytest.fixture(scope="module")
def llm(model_dir_factory):
    path = model_dir_factory("llama", max_position_embeddings=MAX_LEN)
    llm = AsyncLLM(str(path), dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server(llm):
    llm_app = create_app(llm, model_name="tiny")
    host = Starlette(routes=[Mount("/llm", app=llm_app),
                             Mount("/secure", app=create_app(llm, model_name="tiny", api_key="sekret"))])
    with serve_in_thread(host) as url:
        yield url, llm_app


@pytest.fixture
def client(server):
    url, _ = server
    with openai.OpenAI(base_url=f"{url}/llm/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


async def _wait_idle(llm: AsyncLLM, timeout: float) -> float:
    """Seconds until nothing runs, waits or holds KV blocks (fails past ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = llm.stats()
        if stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0:
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise AssertionError(f"still busy after {timeout}s: {llm.stats()}")


async def _wait_running(llm: AsyncLLM) -> None:
    for _ in range(500):
        if llm.stats()["num_running"]:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the request never started")


def test_chat_streamed_equals_whole_under_greedy(client):
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0)
    assert whole.object == "chat.completion" and whole.model == "tiny"
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = _stream_text(stream)
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}
    assert usage.model_dump() == whole.usage.model_dump() and usage.completion_tokens <= 20


def test_completions_streamed_equals_whole_under_greedy(client):
    kwargs = dict(model="tiny", prompt="The old man", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs)
    texts, reasons, usage = _stream_text(client.completions.create(**kwargs, stream=True,
                                                                   stream_options={"include_usage": True}))
    assert texts == {0: whole.choices[0].text} and reasons == {0: whole.choices[0].finish_reason}
    assert usage.total_tokens == whole.usage.total_tokens


def test_n2_stop_and_seed(client):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=16, temperature=1.0, seed=5, n=2)
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1]
    texts, reasons, _ = _stream_text(client.chat.completions.create(**kwargs, stream=True))
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert set(reasons) == {0, 1}

    free = client.completions.create(model="tiny", prompt="A small bird", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 3]
    cut = client.completions.create(model="tiny", prompt="A small bird", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == free[:free.find(stop)] and cut.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_text(client.completions.create(
        model="tiny", prompt="A small bird", max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert texts == {0: cut.choices[0].text} and reasons == {0: "stop"}


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "asyncllm"


def test_errors_reach_the_client_as_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=-0.5)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[7] * MAX_LEN, max_tokens=1)
    assert info.value.body["param"] == "prompt" and "max_model_len" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=CHAT)
    assert info.value.body["code"] == "model_not_found"
    url, _ = server
    with openai.OpenAI(base_url=f"{url}/secure/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with openai.OpenAI(base_url=f"{url}/secure/v1", api_key="sekret", max_retries=0) as good:
        assert good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).choices
    response = httpx.post(f"{url}/secure/v1/chat/completions", json={"messages": CHAT})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(f"{url}/llm/v1/chat/completions", json={"messages": CHAT, "n": "two"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def _aborted(app) -> float:
    ctx = app.state.asyncllm
    return ctx.metrics.registry.get_sample_value(
        "asyncllm:request_success_total", {"model_name": ctx.model_name, "finished_reason": "abort"}) or 0.0


def test_disconnect_mid_stream_aborts_at_once(server, llm):
    url, app = server
    body = {"messages": CHAT, "ignore_eos": True, "stream": True}  # no max_tokens: the rest of the context

    async def main():
        aborted = _aborted(app)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async with http.stream("POST", "/llm/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 5:
                        break  # leaving the block closes the connection mid-stream
        assert await _wait_idle(llm, timeout=1.0) < 1.0
        assert _aborted(app) == aborted + 1

    asyncio.run(main())


def test_disconnect_while_waiting_aborts_at_once(server, llm):
    url, app = server
    body = {"messages": CHAT, "ignore_eos": True, "n": 2}

    async def main():
        aborted = _aborted(app)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            task = asyncio.create_task(http.post("/llm/v1/chat/completions", json=body))
            await _wait_running(llm)
            task.cancel()  # the client gives up on a non-streaming answer: its connection closes
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await _wait_idle(llm, timeout=1.0) < 1.0
        assert _aborted(app) == aborted + 2  # both choices

    asyncio.run(main())


def test_serve_command_with_lora_and_graceful_sigterm(model_dirs, tmp_path):
    pytest.importorskip("peft")
    adapter = build_test_adapter(model_dirs["llama"], tmp_path / "sql")
    env = {**os.environ, "ASYNCLLM_API_KEY": "k"}
    proc, base = start_serve(str(model_dirs["llama"]), "--dtype", "float32", "--model-name", "served",
                             "--lora", f"sql={adapter}", env=env)
    try:
        auth = {"Authorization": "Bearer k"}
        models = httpx.get(f"{base}/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == ["served", "sql"]
        completion = httpx.post(f"{base}/v1/completions", headers=auth,
                                json={"model": "sql", "prompt": "Hi", "max_tokens": 3}).json()
        assert completion["model"] == "sql" and completion["usage"]["completion_tokens"] <= 3
        proc.send_signal(signal.SIGTERM)  # SIGINT takes the same path (uvicorn's handler)
        output, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    assert "Application shutdown complete" in output and "asyncllm serve: stopped" in output


def test_sigterm_ends_open_streams_with_an_error_event_and_done(model_dir_factory):
    path = model_dir_factory("llama", max_position_embeddings=MAX_LEN)  # a stream that would run for seconds
    proc, base = start_serve(str(path), "--dtype", "float32", "--model-name", "tiny")
    try:
        events = []
        body = {"model": "tiny", "messages": CHAT, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                if len(events) == 5:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
        output, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "[DONE]", events[-3:]
    error = __import__("json").loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and error["type"] == "server_error"
    assert proc.returncode == 0 and "asyncllm serve: stopped" in output, output
