"""Forced tool calls whose parameters use ``$defs``/``$ref`` (pydantic's nested models, ``definitions``, recursion):
the call grammar keeps every reference valid, for one function and for several whose definitions share names,
through AsyncLLM and the server (chat and responses, whole and streamed)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from asyncllm.tools.formats import _rebased

CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                         "size": {"$ref": "#/$defs/Size"}}, "required": ["name", "size"]}
TRIP = {"$defs": {"City": CITY, "Size": {"enum": ["small", "big"]}},  # what pydantic writes for nested models
        "type": "object", "properties": {"cities": {"type": "array", "items": {"$ref": "#/$defs/City"},
                                                    "minItems": 1, "maxItems": 2}},
        "required": ["cities"]}
OLD_STYLE = {"definitions": {"Size": {"enum": ["s", "m"]}}, "type": "object",  # draft-07's spelling
             "properties": {"size": {"$ref": "#/definitions/Size"}}, "required": ["size"]}
SAME_NAMES = {"$defs": {"City": {"type": "integer", "minimum": 0, "maximum": 9}}, "type": "object",
              "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "plan_trip", "parameters": TRIP}},
         {"type": "function", "function": {"name": "pick_size", "parameters": OLD_STYLE}},
         {"type": "function", "function": {"name": "count", "parameters": SAME_NAMES}}]
SCHEMAS = {"plan_trip": TRIP, "pick_size": OLD_STYLE, "count": SAME_NAMES}
MESSAGES = [{"role": "user", "content": "Plan a trip"}]


@pytest.fixture(scope="module")
def llm(model_dir_factory):
    llm = AsyncLLM(str(model_dir_factory("llama", max_position_embeddings=2048)), dtype="float32")
    yield llm
    llm.close()


def test_references_are_rebased_into_the_grammars_root():
    definitions: dict = {}
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}, "tag": {"$ref": "#/properties/name"},
                                                  "name": {"type": "string"}}}
    body = _rebased(recursive, "f1_", definitions)
    assert body["properties"]["child"] == {"$ref": "#/$defs/f1_root"}
    assert body["properties"]["tag"] == {"$ref": "#/$defs/f1_root/properties/name"}
    assert definitions["f1_root"] == body and list(body["properties"]) == ["child", "tag", "name"]
    trip = _rebased(TRIP, "f0_", definitions)
    assert "$defs" not in trip and trip["properties"]["cities"]["items"] == {"$ref": "#/$defs/f0_City"}
    assert definitions["f0_City"]["properties"]["size"] == {"$ref": "#/$defs/f0_Size"}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "plan_trip"}},
                                         {"type": "function", "function": {"name": "pick_size"}}])
def test_forced_calls_with_references_are_schema_valid(llm, tool_choice):
    async def main():
        return await llm.generate(MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200, temperature=0)

    output = asyncio.run(main())
    calls = output.outputs[0].tool_calls
    assert calls and output.outputs[0].finish_reason == "tool_calls"
    for call in calls:
        if isinstance(tool_choice, dict):
            assert call.name == tool_choice["function"]["name"]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("route, stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                           ("/v1/responses", False)])
def test_server_forced_calls_with_references(llm, route, stream):
    app = create_app(llm, model_name="tiny")
    if route == "/v1/responses":
        body = {"input": MESSAGES, "tools": [{"type": "function", **t["function"]} for t in TOOLS],
                "tool_choice": {"type": "function", "name": "plan_trip"}, "max_output_tokens": 200}
    else:
        body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
                "temperature": 0, "stream": stream}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host",
                                     timeout=60) as client:
            return await client.post(route, json=body)

    response = asyncio.run(main())
    assert response.status_code == 200, response.text[:400]
    if route == "/v1/responses":
        calls = [(item["name"], item["arguments"]) for item in response.json()["output"]
                 if item["type"] == "function_call"]
    elif stream:
        pieces: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            for call in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                names.setdefault(call["index"], call.get("function", {}).get("name"))
                pieces.setdefault(call["index"], []).append(call.get("function", {}).get("arguments") or "")
        calls = [(names[i], "".join(pieces[i])) for i in sorted(pieces)]
    else:
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in response.json()["choices"][0]["message"]["tool_calls"]]
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


FUNCTIONS = [{"name": "plan_trip", "description": "Plan a trip", "parameters": TRIP},
             {"name": "count", "parameters": SAME_NAMES}]


def _chat(llm, body: dict) -> httpx.Response:
    app = create_app(llm, model_name="tiny")

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://host",
                                     timeout=60) as client:
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(main())


@pytest.mark.parametrize("function_call", [{"name": "plan_trip"}, {"name": "count"}])
def test_legacy_functions_answer_with_one_function_call(llm, function_call):
    body = {"messages": MESSAGES, "functions": FUNCTIONS, "function_call": function_call, "max_tokens": 200,
            "temperature": 0}
    whole = _chat(llm, body)
    assert whole.status_code == 200, whole.text[:300]
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and "tool_calls" not in choice["message"]
    call = choice["message"]["function_call"]
    assert call["name"] == function_call["name"]
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    streamed = _chat(llm, {**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0] for line in streamed.text.splitlines() if line.startswith("data: {")]
    pieces = [d["delta"]["function_call"] for d in deltas if "function_call" in d.get("delta", {})]
    assert pieces[0]["name"] == function_call["name"]
    assert "".join(p.get("arguments", "") for p in pieces) == call["arguments"]
    assert deltas[-1]["finish_reason"] == "function_call"


@pytest.mark.parametrize("extra, param", [({"tools": [{"type": "function", "function": FUNCTIONS[0]}]}, "functions"),
                                          ({"function_call": {"name": "nope"}}, "function_call"),
                                          ({"function_call": {"nam": "count"}}, "function_call")])
def test_legacy_function_errors_name_the_legacy_fields(llm, extra, param):
    response = _chat(llm, {"messages": MESSAGES, "functions": FUNCTIONS, "max_tokens": 4, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text[:300]


def test_function_call_without_functions_is_a_400(llm):
    response = _chat(llm, {"messages": MESSAGES, "function_call": "auto", "max_tokens": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "function_call"


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "count"}}])
def test_response_format_with_a_forced_tool_call(llm, tool_choice):
    """The Agents SDK's output_type plus a forced tool: the call comes first (this answer), the structured
    answer in the turn after the tool's result, as OpenAI sequences them."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    first = _chat(llm, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
                        "response_format": response_format, "max_tokens": 200, "temperature": 0})
    assert first.status_code == 200, first.text[:300]
    message = first.json()["choices"][0]["message"]
    (call,) = message["tool_calls"][:1]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    turn = MESSAGES + [message, {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
    second = _chat(llm, {"messages": turn, "tools": TOOLS, "response_format": response_format, "max_tokens": 40,
                         "temperature": 0})
    assert second.status_code == 200, second.text[:300]
    jsonschema.validate(json.loads(second.json()["choices"][0]["message"]["content"]), ANSWER)
    malformed = _chat(llm, {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 4,
                            "response_format": {"type": "json_schema"}})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "response_format"
