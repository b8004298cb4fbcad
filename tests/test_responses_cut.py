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
