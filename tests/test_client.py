"""AsyncLLMClient: one application, run once on ``AsyncLLM`` in process and once on ``AsyncLLMClient``
against the same engine served over real HTTP, gives identical greedy outputs and raises the same
exception classes for the same bad inputs (docs/client.md)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncllm import AsyncLLM, ChatPrompt, SamplingParams
from asyncllm.client import AsyncLLMClient
from asyncllm.errors import (EngineDeadError, EngineOverloadedError, InvalidRequestError, LoRAError,
                             RequestTimeoutError, ServerError)
from asyncllm.server import create_app
from server_helpers import free_port, serve_in_thread

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"]}}}


@pytest.fixture(scope="module")
def served(model_dir_factory):
    """An engine, and its app served by uvicorn in a thread (the client's server)."""
    llm = AsyncLLM(str(model_dir_factory("llama", max_position_embeddings=1024)), dtype="float32",
                   max_model_len=1024)
    with serve_in_thread(create_app(llm, api_key="k")) as url:
        yield llm, url
    llm.close()


def _client(url: str, **kwargs) -> AsyncLLMClient:
    return AsyncLLMClient(url, api_key="k", **kwargs)


def _summary(out) -> dict:
    """What an application reads from a RequestOutput."""
    return {"prompt_token_ids": out.prompt_token_ids, "finished": out.finished,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason, "logprobs": c.logprobs,
                         "tool_calls": [(t.name, t.arguments) for t in c.tool_calls or []]} for c in out.outputs]}


async def application(llm) -> dict:
    """A small app written against AsyncLLM's API: every call here must behave the same on both."""
    greedy = {"temperature": 0, "max_tokens": 12}
    results: dict = {}
    results["generate"] = _summary(await llm.generate("The city of Paris", **greedy))
    results["token_prompt"] = _summary(await llm.generate([5, 6, 7, 8], **greedy))
    pieces = [piece async for piece in llm.stream("Once upon a time", **greedy)]
    results["stream"] = "".join(pieces)  # (how text groups into pieces depends on timing)
    results["stream_joined_is_generate"] = all(pieces) and results["stream"] == (
        await llm.generate("Once upon a time", **greedy)).outputs[0].text
    chat = [{"role": "user", "content": "Hello there"}]
    results["chat"] = _summary(await llm.generate(chat, SamplingParams(temperature=0, max_tokens=10)))
    results["chat_prompt"] = _summary(await llm.generate(ChatPrompt(chat, chat_template_kwargs={}), **greedy))
    results["logprobs"] = _summary(await llm.generate("Logprobs of", temperature=0, max_tokens=4, logprobs=2))
    results["stop"] = _summary(await llm.generate("Stop at", temperature=0, max_tokens=20, stop_token_ids=[9, 10, 11]))
    results["seeded_n2"] = _summary(await llm.generate("Seeded", n=2, temperature=0.9, seed=7, max_tokens=6))
    deltas = [d async for d in llm.stream_outputs("Deltas", n=2, temperature=0.8, seed=3, max_tokens=5)]
    joined: dict[int, list[int]] = {0: [], 1: []}  # (how tokens group into deltas depends on timing)
    for delta in deltas:
        for c in delta.outputs:
            joined[c.index].extend(c.token_ids)
    results["deltas_tokens"] = joined
    results["deltas_last_finished"] = deltas[-1].finished
    results["tools"] = _summary(await llm.generate([{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
                                                   tool_choice="required", temperature=0, max_tokens=40))
    results["json"] = json.loads((await llm.generate("JSON:", temperature=0, max_tokens=60, json_schema={
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False})).outputs[0].text)
    results["embed"] = [round(x, 5) for x in (await llm.embed("embed me"))[:8]]
    return results


async def bad_inputs(llm) -> list[tuple[str, type, str | None]]:
    """(case, exception class, its ``field``) for inputs an application may get wrong."""
    cases = {
        "temperature": lambda: llm.generate("x", temperature=-1),
        "unknown kwarg": lambda: llm.generate("x", temprature=0),
        "too long": lambda: llm.generate("word " * 3000, max_tokens=4),
        "max_tokens past the context": lambda: llm.generate("x", max_tokens=5000),
        "token out of range": lambda: llm.generate([10**9], max_tokens=2),
        "tools without chat": lambda: llm.generate("x", tools=[WEATHER]),
        "bad schema": lambda: llm.generate("x", json_schema={"type": "no-such-type"}),
        "unknown adapter": lambda: llm.generate("x", lora="no-such-adapter", max_tokens=2),
        "timeout": lambda: llm.generate("x", max_tokens=900, ignore_eos=True, timeout=0.05),
        "n for stream": lambda: _drain(llm.stream("x", n=2)),
    }
    found = []
    for name, call in cases.items():
        try:
            await call()
        except Exception as exc:  # noqa: BLE001 - the class is what is compared
            found.append((name, type(exc), getattr(exc, "field", None)))
        else:
            found.append((name, None, None))
    return found


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def _over_http(url: str, app):
    """``app(client)`` with an AsyncLLMClient on the served engine, in a loop of its own."""
    async def main():
        async with _client(url) as client:
            return await app(client)

    return asyncio.run(main())


def test_one_application_same_outputs_in_process_and_served(served):
    llm, url = served
    in_process = asyncio.run(application(llm))
    assert in_process["generate"]["outputs"][0]["token_ids"]  # (something was generated to compare)
    assert in_process["stream_joined_is_generate"]
    assert in_process["tools"]["outputs"][0]["tool_calls"][0][0] == "get_weather"
    assert _over_http(url, application) == in_process


def test_same_exception_classes_for_the_same_bad_inputs(served):
    llm, url = served
    in_process = asyncio.run(bad_inputs(llm))
    served_found = _over_http(url, bad_inputs)
    assert served_found == in_process  # the same class, naming the same field
    expected = {"temperature": InvalidRequestError, "unknown kwarg": InvalidRequestError,
                "too long": InvalidRequestError, "max_tokens past the context": InvalidRequestError,
                "token out of range": InvalidRequestError, "tools without chat": InvalidRequestError,
                "bad schema": InvalidRequestError, "unknown adapter": LoRAError, "timeout": RequestTimeoutError,
                "n for stream": InvalidRequestError}
    assert {name: cls for name, cls, _ in served_found} == expected
    fields = {name: field for name, _, field in served_found}
    assert fields["temperature"] == "temperature" and fields["unknown kwarg"] == "temprature"
    assert fields["max_tokens past the context"] == "max_tokens"
    _wait_idle(llm)  # the timed-out request was aborted on the server too


def _wait_idle(llm, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while llm.stats().get("num_running", 0) or llm.stats().get("kv_blocks_used", 0):
        assert time.monotonic() < deadline, llm.stats()
        time.sleep(0.05)


def test_abort_and_early_exit_free_the_servers_blocks(served):
    llm, url = served

    async def main():
        async with _client(url) as client:
            deltas = []
            async for delta in client.stream_outputs("Abort me", request_id="mine", max_tokens=800, ignore_eos=True,
                                                     temperature=0):
                deltas.append(delta)
                if len(deltas) == 3:
                    await client.abort("mine")
            assert deltas[-1].outputs[0].finish_reason == "abort" and deltas[-1].finished
            async for _ in client.stream("Leave early", max_tokens=800, ignore_eos=True):
                break
            stats = await client.stats()
            assert set(llm.stats()) == set(stats)  # the same counters, served
            await client.check_health()

    asyncio.run(main())
    _wait_idle(llm)


def test_lora_routes_and_auth(served):
    llm, url = served

    async def main():
        async with AsyncLLMClient(url, api_key="wrong", max_retries=0) as client:
            with pytest.raises(ServerError) as info:
                await client.generate("x", max_tokens=2)
            assert info.value.status == 401
        async with _client(url) as client:
            assert await client.list_loras() == llm.list_loras()
            with pytest.raises(ServerError) as info:  # the app was not allowed to load adapters
                await client.add_lora("a", "/nowhere")
            assert info.value.status == 403

    asyncio.run(main())


def test_unreachable_server_is_engine_dead():
    async def main():
        async with AsyncLLMClient(f"http://127.0.0.1:{free_port()}", max_retries=1) as client:
            with pytest.raises(EngineDeadError):
                await client.generate("x")
            with pytest.raises(EngineDeadError):
                await client.check_health()

    asyncio.run(main())


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_retries_429_and_503_as_retry_after_says_then_gives_up():
    """A stub server: busy twice, then an answer; and one that stays busy (EngineOverloadedError)."""
    answers = []

    def handler(request: httpx.Request) -> httpx.Response:
        answers.append(request.url.path)
        if len(answers) == 1:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {
                "message": "busy", "type": "rate_limit_exceeded", "param": None, "code": "too_many_requests"}})
        if len(answers) == 2:
            return httpx.Response(503, json={"error": {"message": "restarting", "type": "server_error",
                                                       "param": None, "code": "engine_unavailable"}})
        body = json.loads(request.content)
        assert body["stream"] and body["return_token_ids"] and body["max_tokens"] == 3
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(
            {"choices": [{"index": 0, "text": "Hi", "token_ids": [1, 2], "prompt_token_ids": [7]}]},
            {"choices": [{"index": 0, "text": "!", "token_ids": [3], "finish_reason": "length"}]}))

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://stub")
        client = AsyncLLMClient("http://stub", http_client=http, max_retries=2, max_retry_wait=0.01)
        out = await client.generate("x", max_tokens=3)
        assert (out.outputs[0].text, out.outputs[0].token_ids, out.prompt_token_ids) == ("Hi!", [1, 2, 3], [7])
        assert out.outputs[0].finish_reason == "length" and out.finished
        answers.clear()
        answers.append("busy from now on")
        busy = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda r: httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "busy"}})),
            base_url="http://stub")
        client = AsyncLLMClient("http://stub", http_client=busy, max_retries=1, max_retry_wait=0.01)
        with pytest.raises(EngineOverloadedError) as info:
            await client.generate("x")
        assert info.value.retry_after == 2.0

    asyncio.run(main())


def test_a_stream_error_event_raises_its_class():
    """An error after the 200 (the engine died mid-stream) reaches the caller as EngineDeadError."""
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(
            {"choices": [{"index": 0, "text": "Hi", "token_ids": [1]}]},
            {"error": {"message": "the engine is not available", "type": "server_error", "param": None,
                       "code": "engine_unavailable"}}))

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://stub")
        client = AsyncLLMClient("http://stub", http_client=http)
        pieces = []
        with pytest.raises(EngineDeadError):
            async for piece in client.stream("x"):
                pieces.append(piece)
        assert pieces == ["Hi"]

    asyncio.run(main())


def test_a_plain_openai_server_chat_stream_with_tool_calls():
    """The OpenAI-shaped subset: chunks without this server's token ids, a tool call in fragments, and
    ``model`` sent as configured; the text and the whole call come back as AsyncLLM gives them."""
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        seen["auth"] = request.headers.get("authorization")
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=_sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": "Let me check."}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                                "function": {"name": "get_weather", "arguments": ""}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
            {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Rome"}'}}]}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))

    async def main():
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://stub",
                                 headers={"Authorization": "Bearer sk-test"})
        client = AsyncLLMClient("http://stub", model="gpt-test", http_client=http)
        return await client.chat([{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER],
                                 temperature=0, max_tokens=30)

    out = asyncio.run(main())
    c = out.outputs[0]
    assert (c.text, c.finish_reason, out.finished) == ("Let me check.", "tool_calls", True)
    assert [(t.id, t.name, json.loads(t.arguments)) for t in c.tool_calls] == [("call_1", "get_weather", {"city": "Rome"})]
    assert seen["model"] == "gpt-test" and seen["tools"] == [WEATHER] and seen["temperature"] == 0
    assert seen["messages"] == [{"role": "user", "content": "Weather in Rome?"}] and seen["auth"] == "Bearer sk-test"


def test_return_token_ids_streamed_equals_whole(served):
    """The server extension the client reads: a stream's token ids, joined, are the whole answer's."""
    llm, url = served
    headers = {"Authorization": "Bearer k"}
    for path, body in (("/v1/completions", {"prompt": "Token ids", "max_tokens": 9, "temperature": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Token ids"}],
                                                 "max_tokens": 9, "temperature": 0})):
        whole = httpx.post(url + path, json={**body, "return_token_ids": True}, headers=headers, timeout=30).json()
        choice = whole["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") or whole.get("prompt_token_ids")
        assert len(choice["token_ids"]) == 9 and prompt_ids
        streamed, streamed_prompt = [], None
        with httpx.stream("POST", url + path, json={**body, "return_token_ids": True, "stream": True},
                          headers=headers, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    streamed_prompt = streamed_prompt or chunk.get("prompt_token_ids")
                    for c in chunk["choices"]:
                        streamed.extend(c.get("token_ids") or [])
                        streamed_prompt = streamed_prompt or c.get("prompt_token_ids")
        assert (streamed, streamed_prompt) == (choice["token_ids"], prompt_ids), path
        plain = httpx.post(url + path, json=body, headers=headers, timeout=30).json()["choices"][0]
        assert "token_ids" not in plain and "prompt_token_ids" not in plain  # only when asked
