"""The official ``anthropic`` client against ``POST /v1/messages`` (and count_tokens), served by uvicorn."""

import json
import sys

import anthropic
import httpx
import jsonschema
import pytest
from server_helpers import serve_in_thread

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from asyncllm.server.anthropic_messages import MessagesRequest

KEY = "sekret"
MESSAGES = [{"role": "user", "content": "Tell me a story about the old man"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def llm(model_dir_factory):
    llm = AsyncLLM(str(model_dir_factory("llama", max_position_embeddings=2048)), dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def url(llm):
    with serve_in_thread(create_app(llm, model_name="tiny", api_key=KEY)) as url:
        yield url


@pytest.fixture
def client(url):
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=30) as client:
        yield client


def _greedy(client, **kwargs):
    # anthropic 2.x dropped temperature from create()'s signature; the API (and this server) still take it
    return client.messages.create(**{"model": "tiny", "max_tokens": 12, "extra_body": {"temperature": 0},
                                     "messages": MESSAGES, **kwargs})


def test_plain_message_and_usage(client, url):
    message = _greedy(client)
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.stop_reason in ("max_tokens", "end_turn") and message.stop_sequence is None
    assert [block.type for block in message.content] == ["text"]
    assert message.usage.input_tokens == client.messages.count_tokens(model="tiny", messages=MESSAGES).input_tokens
    # the engine's own counts, as the chat-completions route reports them for the same conversation
    chat = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                      json={"model": "tiny", "max_tokens": 12, "temperature": 0, "messages": MESSAGES}).json()
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"] >= 1
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert (message.stop_reason == "max_tokens") == (chat["choices"][0]["finish_reason"] == "length")


def test_stream_matches_whole_answer(client):
    whole = _greedy(client)
    with client.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                                messages=MESSAGES) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.index("content_block_start") < events.index("content_block_delta") < \
        events.index("content_block_stop") < events.index("message_delta")
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_raw_stream_has_no_done_marker(url):
    body = {"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "stream": True}
    text = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30).text
    assert "[DONE]" not in text and "event: message_stop" in text and "event: ping" in text


def test_forced_tool_then_tool_result(client):
    message = client.messages.create(model="tiny", max_tokens=400, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER["input_schema"])
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": [block.model_dump() for block in message.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}]}]
    answer = client.messages.create(model="tiny", max_tokens=8, extra_body={"temperature": 0}, tools=[WEATHER],
                                    messages=turns)
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use") and answer.usage.output_tokens >= 1


def test_conversation_becomes_chat_messages():
    body = MessagesRequest.model_validate({"max_tokens": 1, "system": [{"type": "text", "text": "Be brief."}],
                                           "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "rain",
                                      "is_error": True}, {"type": "text", "text": "And?"}]}]})
    assert body.chat_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: rain"}, {"role": "user", "content": "And?"}]


def test_forced_tool_streamed(client):
    with client.messages.stream(model="tiny", max_tokens=400, extra_body={"temperature": 0}, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}]) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas
    (call,) = [block for block in final.content if block.type == "tool_use"]
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"


def test_stop_sequence(client):
    text = _greedy(client, max_tokens=16).content[0].text
    words = [word for word in text.split() if len(word) > 1]
    assert words, text
    stop = words[len(words) // 2]
    message = _greedy(client, max_tokens=16, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in "".join(block.text for block in message.content)


def test_count_tokens_equals_tokenize(client, url):
    system = "You are terse."
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": [{"type": "text", "text": "weather?"}]}]
    counted = client.messages.count_tokens(model="tiny", system=system, messages=messages, tools=[WEATHER])
    chat = [{"role": "system", "content": system}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    tokenized = httpx.post(f"{url}/tokenize", json={"messages": chat, "tools": tools},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert counted.input_tokens == tokenized["count"] > 0


def test_auth_x_api_key(url):
    body = {"model": "tiny", "max_tokens": 1, "messages": MESSAGES}
    assert httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}):
        answer = httpx.post(f"{url}/v1/messages", json=body, headers=headers, timeout=30)
        assert answer.status_code == 401
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "authentication_error"
    with anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model="tiny", max_tokens=1, messages=MESSAGES)


@pytest.mark.parametrize("body, field", [
    ({"model": "tiny", "messages": MESSAGES}, "max_tokens"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"model": "tiny", "max_tokens": 4, "messages": MESSAGES, "stop_sequences": "x"}, "stop_sequences"),
    ({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]},
     "messages[0].content"),
    ({"model": "tiny", "max_tokens": 4, "messages": MESSAGES,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
])
def test_bad_request_in_anthropic_shape(url, body, field):
    answer = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert answer.status_code == 400
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(field)


def test_sdk_errors(client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=0, messages=MESSAGES)
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=4, messages=MESSAGES)
    assert json.loads(caught.value.response.text)["error"]["type"] == "not_found_error"


def test_failure_mid_stream_is_an_error_event():
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from asyncllm.server.anthropic_messages import _sse
    from asyncllm.server.errors import APIError

    async def events():
        yield "message_start", {"type": "message_start"}
        raise APIError(503, "the engine is not available")

    async def endpoint(request):
        return _sse(events())

    with TestClient(Starlette(routes=[Route("/", endpoint)])) as http:
        text = http.get("/").text
    assert "event: message_start" in text and "[DONE]" not in text
    error = json.loads(text.split("event: error", 1)[1].split("data: ", 1)[1].splitlines()[0])
    assert error == {"type": "error", "error": {"type": "overloaded_error", "message": "the engine is not available"}}


# what the model writes as a call's arguments is its own text: strict JSON it need not be
UNCARRIABLE_ARGUMENTS = ['{"x": 1e999}', '{"x": NaN}', '{"x": -Infinity}', '{"x": "\\ud800"}', '{"\\udfff": 1}',
                         '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"]


def _tool_output(name: str, arguments: str, finish_reason: str | None = "tool_calls"):
    from asyncllm.outputs import CompletionOutput, RequestOutput
    from asyncllm.tools import ToolCall

    return RequestOutput("msg_1", None, [1, 2], [CompletionOutput(
        0, "", [3], finish_reason=finish_reason, tool_calls=[ToolCall(0, "call_1", name, arguments)])])


@pytest.mark.parametrize("arguments", UNCARRIABLE_ARGUMENTS)
def test_tool_input_strict_json_cannot_carry_is_empty(arguments):
    # (found by the fuzz: a forced call's "1e999" made the whole answer a 500)
    from asyncllm.server.anthropic_messages import _message
    from asyncllm.server.serving import json_bytes

    body = MessagesRequest.model_validate({"max_tokens": 4, "messages": MESSAGES})
    answer = json_bytes(_message(body, "msg_1", "tiny", _tool_output("get_weather", arguments)))  # as json_answer does
    (block,) = json.loads(answer, parse_constant=lambda constant: pytest.fail(constant))["content"]
    assert block == {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}
    good = _message(body, "msg_1", "tiny", _tool_output("get_weather", '{"city": "Oslo", "n": [[1e300]]}'))
    assert good["content"][0]["input"] == {"city": "Oslo", "n": [[1e300]]}


def test_tool_input_nested_near_the_recursion_limit():
    # parsed, or not (where the limit lies depends on the Python), but never an answer that cannot be written
    from asyncllm.server.anthropic_messages import _message
    from asyncllm.server.serving import json_bytes

    body = MessagesRequest.model_validate({"max_tokens": 4, "messages": MESSAGES})
    for depth in range(sys.getrecursionlimit() - 30, sys.getrecursionlimit() + 5, 5):
        arguments = '{"x": ' + "[" * depth + "]" * depth + "}"
        answer = json_bytes(_message(body, "msg_1", "tiny", _tool_output("f", arguments)))
        # (counted, not parsed: this test's own stack is deeper than a response thread's)
        assert answer.count(b"[") == answer.count(b"]") in (1, 1 + depth), depth  # content: [{..., "input": ...}]
        if answer.count(b"[") == 1:
            assert json.loads(answer)["content"][0]["input"] == {}


def test_tool_name_with_a_lone_surrogate_is_sent():
    # a name is read from the model's JSON string: "\ud800" there must neither fail the answer nor cut the stream
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from asyncllm.server.anthropic_messages import _events, _message, _sse
    from asyncllm.server.serving import json_bytes

    body = MessagesRequest.model_validate({"max_tokens": 4, "messages": MESSAGES, "stream": True})
    whole = json.loads(json_bytes(_message(body, "msg_1", "tiny", _tool_output("\ud800f", '{"a": 1}'))))
    assert whole["content"][0]["name"] == "\ufffdf" and whole["content"][0]["input"] == {"a": 1}

    async def deltas():
        yield _tool_output("\ud800f", "", finish_reason=None)
        yield _tool_output(None, '{"a": 1}')

    async def endpoint(request):
        return _sse(_events(body, "msg_1", "tiny", [deltas()]))

    with TestClient(Starlette(routes=[Route("/", endpoint)])) as http:
        text = http.get("/").text
    events = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert events[-1] == "message_stop" and "error" not in events, text
    assert '"name":"\ufffdf"' in text and '"partial_json":"{\\"a\\": 1}"' in text


def test_a_wrong_method_on_the_messages_route_answers_in_anthropics_shape(model_dirs):
    """Starlette's own 405 (and the catch-all 500) on these routes use Anthropic's error shape too."""
    from asyncllm import AsyncLLM
    from asyncllm.server import create_app
    from server_helpers import request

    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    try:
        app = create_app(llm)
        answer = request(app, "GET", "/v1/messages")
        assert answer.status_code == 405
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "invalid_request_error"
        assert "error" in request(app, "GET", "/v1/chat/completions").json()  # OpenAI's shape stays elsewhere
        assert request(app, "GET", "/v1/chat/completions").json()["error"]["type"] == "invalid_request_error"
    finally:
        llm.close()
