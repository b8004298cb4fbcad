"""A Responses answer cut by ``max_output_tokens``: the response and the item being written when it stopped
(a message, or a function call whose arguments end mid-way) are "incomplete", whole and streamed."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asyncllm import AsyncLLM
from asyncllm.server import create_app

TOOL = {"type": "function", "name": "get_weather", "parameters": {  # short arguments: a whole call fits
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["days", "unit"]}}


@pytest.fixture(scope="module")
def app(model_dir_factory):
    llm = AsyncLLM(str(model_dir_factory("llama", max_position_embeddings=2048)), dtype="float32")
    yield create_app(llm, model_name="tiny")
    llm.close()


def _post(app, body: dict) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host",
                                     timeout=60) as client:
            return await client.post("/v1/responses", json=body)

    return asyncio.run(main())


def _final(response: httpx.Response, stream: bool) -> dict:
    if not stream:
        return response.json()
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    final = events[-1]["response"]
    assert [i["status"] for i in done_items] == [i["status"] for i in final["output"]]  # events agree
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_function_call_is_incomplete(app, stream):
    body = {"input": "Weather?", "tools": [TOOL], "tool_choice": "required", "temperature": 0, "stream": stream}
    whole = _post(app, {**body, "stream": False, "max_output_tokens": 200}).json()
    assert whole["status"] == "completed", whole
    # stop earlier and earlier until the call's name is out but its arguments are unfinished
    for limit in range(whole["usage"]["output_tokens"] - 1, 0, -1):
        final = _final(_post(app, {**body, "max_output_tokens": limit}), stream)
        assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
        assert final["output"][-1]["status"] == "incomplete"  # whatever was being written when it stopped
        call = final["output"][-1]
        if call["type"] == "function_call":
            try:
                json.loads(call["arguments"])
            except ValueError:
                break  # cut mid-arguments: "incomplete", as its status says
    else:
        pytest.fail("no cut left a call with unfinished arguments")


@pytest.mark.parametrize("stream", [False, True])
def test_a_cut_message_is_incomplete_and_a_whole_one_completed(app, stream):
    cut = _final(_post(app, {"input": "Tell me a story", "max_output_tokens": 3, "stream": stream,
                             "temperature": 0}), stream)
    assert cut["status"] == "incomplete" and cut["output"][-1]["status"] == "incomplete"
    whole = _final(_post(app, {"input": "Weather?", "tools": [TOOL], "tool_choice": "required",
                               "max_output_tokens": 200, "temperature": 0, "stream": stream}), stream)
    assert whole["status"] == "completed" and all(i["status"] == "completed" for i in whole["output"])


def _get(app, path: str) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host",
                                     timeout=60) as client:
            return await client.get(path)

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_stored_response_is_retrieved_as_it_was_answered(app, stream):
    answered = _final(_post(app, {"input": "Hello", "max_output_tokens": 5, "temperature": 0, "stream": stream}),
                      stream)
    retrieved = _get(app, f"/v1/responses/{answered['id']}")
    assert retrieved.status_code == 200 and retrieved.json() == answered
    unstored = _post(app, {"input": "Hello", "max_output_tokens": 2, "store": False}).json()
    missing = _get(app, f"/v1/responses/{unstored['id']}")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"
    # what GET finds, previous_response_id continues
    follow = _post(app, {"input": "And then?", "previous_response_id": answered["id"], "max_output_tokens": 2})
    assert follow.status_code == 200


def test_the_store_keeps_the_most_recently_used(app):
    store = app.state.asyncllm.responses
    size, store.size = store.size, 2
    try:
        ids = [_post(app, {"input": f"Hi {i}", "max_output_tokens": 1}).json()["id"] for i in range(2)]
        assert _get(app, f"/v1/responses/{ids[0]}").status_code == 200  # now the most recently used
        _post(app, {"input": "Hi 2", "max_output_tokens": 1})
        assert _get(app, f"/v1/responses/{ids[0]}").status_code == 200
        assert _get(app, f"/v1/responses/{ids[1]}").status_code == 404
    finally:
        store.size = size
