"""Random bodies to every route: never a 500, always OpenAI-shaped errors, and afterwards the engine
serves a normal request and holds no KV block.

Each body mixes plausible values (so requests get deep into the engine) with arbitrary JSON (so
every type check is exercised): hypothesis draws, per route, any subset of the route's fields.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm import AsyncLLM
from asyncllm.server import create_app

ALLOWED_STATUSES = {200, 400, 403, 404, 405, 408, 413, 415, 429}
FUZZ_SETTINGS = settings(max_examples=int(__import__("os").environ.get("FUZZ_EXAMPLES", "300")), deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# ---- strategies ---------------------------------------------------------------------------------------

leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                 st.text(max_size=12), st.sampled_from(["\ud800", "", "user", "auto", "json_schema", "tiny"]))
any_json = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=8)


def field(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values, sometimes anything."""
    return st.one_of(plausible, plausible, any_json)


small_int = st.integers(-3, 12)
unit = st.floats(-0.5, 2.5, allow_nan=False)
text = st.text(max_size=30)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "bot"])},
    optional={"content": st.one_of(text, st.none(), st.lists(st.fixed_dictionaries(
        {"type": st.just("text"), "text": text}), max_size=2)),
        "tool_calls": field(st.lists(st.fixed_dictionaries({"type": st.just("function"), "function":
                                                            st.fixed_dictionaries({"name": text, "arguments": text})}),
                                     max_size=2)),
        "name": text})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get_weather", "f", ""])},
    optional={"parameters": field(st.just({"type": "object", "properties": {"city": {"type": "string"}}}))})})
response_format = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                            st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
                                {"name": st.just("x"), "schema": st.sampled_from(
                                    [{"type": "object"}, {"$ref": "#"}, {"type": "integer"}, {"enum": []}])})}))
SAMPLING = {
    "model": field(st.sampled_from(["tiny", "other"])), "n": field(st.integers(-1, 3)),
    "temperature": field(unit), "top_p": field(unit), "top_k": field(st.integers(-2, 2000)),
    "min_p": field(unit), "seed": field(st.integers(-2**65, 2**65)), "stop": field(st.one_of(text, st.lists(text))),
    "presence_penalty": field(st.floats(-3, 3)), "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)), "logit_bias": field(st.dictionaries(
        st.sampled_from(["5", "-1", "99999", "x"]), st.floats(-200, 200), max_size=2)),
    "min_tokens": field(small_int), "ignore_eos": field(st.booleans()), "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop_token_ids": field(st.lists(st.integers(-2, 2000), max_size=2)), "skip_special_tokens": field(st.booleans()),
    "response_format": field(response_format), "max_tokens": field(small_int),
}
CHAT_REQUIRED = {"messages": st.lists(message, min_size=1, max_size=3)}
CHAT = {**SAMPLING, "max_completion_tokens": field(small_int), "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(-1, 25)), "tools": field(st.lists(tool, max_size=2)),
        "tool_choice": field(st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.just("get_weather")})}))),
        "parallel_tool_calls": field(st.booleans())}
COMPLETION_REQUIRED = {"prompt": st.one_of(text, st.lists(st.integers(-1, 1100), max_size=5),
                                           st.lists(text, max_size=3))}
COMPLETION = {**SAMPLING, "logprobs": field(st.integers(-1, 6)), "echo": field(st.booleans()),
              "best_of": field(st.integers(0, 3)), "suffix": field(text)}
TOKENIZE = {"prompt": field(text), "messages": field(st.lists(message, max_size=2)),
            "add_special_tokens": field(st.booleans()), "model": field(st.just("tiny"))}
DETOKENIZE_REQUIRED = {"tokens": st.lists(st.integers(-5, 1100), max_size=6)}
DETOKENIZE = {"model": field(st.just("tiny"))}
LORA_REQUIRED = {"lora_name": st.sampled_from(["a", "", "tiny"]),
                 "lora_path": st.sampled_from(["adapter", "../../etc", "/etc/passwd", "", "nope", "/"])}


def body_of(required: dict, optional: dict, breaks: bool = True) -> st.SearchStrategy:
    """The route's required fields (plausible; with ``breaks``, one in ten bodies breaks one of them) plus
    up to three optional fields, each mostly plausible: deep enough to be served, wide enough to probe."""
    @st.composite
    def build(draw) -> dict:
        body = {name: draw(strategy) for name, strategy in required.items()}
        names = draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)) if optional else []
        for name in names:
            body[name] = draw(optional[name])
        if breaks and required and draw(st.integers(0, 9)) == 0:
            name = draw(st.sampled_from(sorted(required)))
            if draw(st.booleans()):
                del body[name]
            else:
                body[name] = draw(any_json)
        return body

    return build()


request_strategy = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), body_of(CHAT_REQUIRED, CHAT)),
    st.tuples(st.just("/v1/completions"), body_of(COMPLETION_REQUIRED, COMPLETION)),
    st.tuples(st.just("/tokenize"), body_of({}, TOKENIZE)),
    st.tuples(st.just("/detokenize"), body_of(DETOKENIZE_REQUIRED, DETOKENIZE)),
    st.tuples(st.sampled_from(["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]), body_of(LORA_REQUIRED, {})),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize"]), any_json),
)
raw_strategy = st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
                                          "/v1/load_lora_adapter", "/v1/models", "/health", "/metrics", "/nope"]),
                         st.sampled_from(["POST", "GET", "PUT", "DELETE"]),
                         st.binary(max_size=40),
                         st.sampled_from(["application/json", "text/plain", "", "application/x-www-form-urlencoded"]))

# Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens): its own fields and block types.
# Two kinds of body: "clean" ones (every field plausible, so requests get generated, streamed and
# answered with text and tool_use blocks) and "fuzzy" ones (any field may be anything).


def mostly(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Plausible four times in five, else anything: these bodies have more fields that must all pass."""
    return st.one_of(plausible, plausible, plausible, plausible, any_json)


clean_text = st.one_of(text, text, st.sampled_from(["Hello", " ", "\n\n", "Human:", "<tool_call>",
                                                    '{"name": "get_weather", "arguments": {}}']))
a_text = st.one_of(clean_text, clean_text, clean_text, st.sampled_from(["", "\ud800"]))  # (a lone surrogate: 400)


def text_block(texts: st.SearchStrategy = a_text) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": st.just("text"), "text": texts})


def tool_use_block(names: st.SearchStrategy, inputs: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["toolu_01", "t1", ""]),
                                  "name": names, "input": inputs})


def tool_result_block(contents: st.SearchStrategy, flags: st.SearchStrategy) -> st.SearchStrategy:
    return st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["toolu_01", ""])},
                                 optional={"content": contents, "is_error": flags})


def tool_turns(texts: st.SearchStrategy, call: st.SearchStrategy, result: st.SearchStrategy) -> st.SearchStrategy:
    """user, assistant (text?, tool_use), user (tool_result, text?): a tool round trip as Anthropic sends it."""
    return st.tuples(texts, st.lists(text_block(texts), max_size=1), call, st.lists(text_block(texts), max_size=1),
                     result).map(lambda t: [
                         {"role": "user", "content": t[0]}, {"role": "assistant", "content": [*t[1], t[2]]},
                         {"role": "user", "content": [{**t[4], "tool_use_id": t[2]["id"]}, *t[3]]}])


def plain_turns(texts: st.SearchStrategy) -> st.SearchStrategy:
    """user, assistant, user...; now and then as text blocks."""
    content = st.one_of(texts, texts, st.lists(text_block(texts), min_size=1, max_size=2))
    return st.lists(content, min_size=1, max_size=3).map(
        lambda contents: [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)])


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
clean_call = tool_use_block(st.sampled_from(["get_weather", "f"]),
                            st.fixed_dictionaries({}, optional={"city": clean_text, "n": st.integers(-5, 5)}))
clean_result = tool_result_block(st.one_of(clean_text, st.lists(text_block(clean_text), max_size=2)), st.booleans())
clean_messages = st.one_of(plain_turns(clean_text), plain_turns(clean_text), tool_turns(clean_text, clean_call,
                                                                                        clean_result))
clean_tool = st.fixed_dictionaries({"name": st.just("get_weather"),
                                    "input_schema": st.sampled_from([CITY, CITY, {"type": "object"}, {}])},
                                   optional={"description": clean_text})
forced_tool_choice = st.one_of(st.fixed_dictionaries({"type": st.just("any")}), st.fixed_dictionaries(
    {"type": st.just("tool"), "name": st.just("get_weather")}, optional={"disable_parallel_tool_use": st.booleans()}))
clean_tool_choice = st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["auto", "none"])}), forced_tool_choice)
CLEAN_REQUIRED = {"messages": clean_messages, "max_tokens": st.integers(1, 24)}
CLEAN = {"model": st.just("tiny"), "system": st.one_of(clean_text, st.lists(text_block(clean_text), max_size=2)),
         "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=2),
         "temperature": st.floats(0, 1.5), "top_p": st.floats(0.05, 1), "top_k": st.integers(1, 100),
         "metadata": st.fixed_dictionaries({}, optional={"user_id": text}), "stream": st.booleans()}
CLEAN_TOOLS = st.fixed_dictionaries({"tools": st.lists(clean_tool, min_size=1, max_size=1)},
                                    optional={"tool_choice": clean_tool_choice})
FORCED_TOOL = st.fixed_dictionaries({"tools": st.lists(clean_tool, min_size=1, max_size=1),
                                     "tool_choice": forced_tool_choice})

# the fuzzy kind: every block type (image and unknown ones included), roles, wrong types
tool_names = st.sampled_from(["get_weather", "get_weather", "f", ""])
fuzzy_call = tool_use_block(tool_names, mostly(st.dictionaries(st.sampled_from(["city", "x", ""]), leaf,
                                                               max_size=2)))
fuzzy_result = tool_result_block(mostly(st.one_of(a_text, st.none(), st.lists(text_block(), max_size=2))),
                                 mostly(st.booleans()))
image_block = st.fixed_dictionaries({"type": st.just("image"), "source": st.fixed_dictionaries(
    {"type": st.just("base64"), "media_type": st.just("image/png"), "data": st.just("iVBORw0KGgo=")})})
unknown_block = st.fixed_dictionaries({"type": st.sampled_from(["document", "thinking", "server_tool_use", "TEXT",
                                                                ""]), "text": a_text})
block = st.one_of(text_block(), text_block(), fuzzy_call, fuzzy_result, image_block, unknown_block, any_json)
a_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "assistant", "assistant", "system", "tool"]),
     "content": st.one_of(a_text, st.lists(block, max_size=3), any_json)}, optional={"name": text})
a_messages = st.one_of(plain_turns(a_text), tool_turns(a_text, fuzzy_call, fuzzy_result),
                       st.lists(a_message, min_size=1, max_size=3))
a_tool = st.fixed_dictionaries({"name": tool_names, "input_schema": st.sampled_from(
    [CITY, {"type": "object"}, {}, {"$ref": "#"}, {"type": "integer"}, {"enum": []}, {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}}])},
    optional={"description": a_text, "type": st.sampled_from(["custom", "web_search_20250305", None])})
a_tool_choice = st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "required"])},
                                      optional={"name": st.sampled_from(["get_weather", "f", "nope", ""]),
                                                "disable_parallel_tool_use": mostly(st.booleans())})
PROMPT_FIELDS = {
    "model": mostly(st.sampled_from(["tiny", "tiny", "other"])),
    "system": mostly(st.one_of(a_text, st.lists(text_block(), max_size=2), st.lists(block, max_size=2))),
    "tools": mostly(st.lists(a_tool, max_size=2)), "tool_choice": mostly(a_tool_choice),
}
MESSAGES_REQUIRED = {"messages": a_messages, "max_tokens": st.integers(-1, 24)}
MESSAGES = {**PROMPT_FIELDS, "stop_sequences": mostly(st.lists(a_text, max_size=3)),
            "temperature": mostly(unit), "top_p": mostly(unit), "top_k": mostly(st.integers(-2, 2000)),
            "metadata": mostly(st.fixed_dictionaries({}, optional={"user_id": mostly(text)})),
            "stream": mostly(st.booleans())}
COUNT_REQUIRED = {"messages": a_messages}
COUNT = {**PROMPT_FIELDS, "max_tokens": mostly(small_int), "stream": mostly(st.booleans())}  # (ignored there)
CLEAN_COUNT = {"system": CLEAN["system"], "model": st.just("tiny")}
ANTHROPIC_KINDS = ["clean", "clean stream", "clean stream", "clean tools", "forced tool", "forced tool", "fuzzy",
                   "fuzzy", "fuzzy", "count", "count", "clean count", "unknown model", "junk"]


@st.composite
def anthropic_request(draw) -> tuple[str, object]:
    """A Messages body (clean or fuzzy; streamed or not; with a tool or not) or a count_tokens body; now and
    then plain junk."""
    kind = draw(st.sampled_from(ANTHROPIC_KINDS))
    if kind == "junk":
        return draw(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"])), draw(any_json)
    if kind == "count":
        return "/v1/messages/count_tokens", draw(body_of(COUNT_REQUIRED, COUNT))
    if kind == "clean count":
        body = draw(body_of({"messages": clean_messages}, CLEAN_COUNT, breaks=False))
        if draw(st.booleans()):
            body.update(draw(CLEAN_TOOLS))
        return "/v1/messages/count_tokens", body
    if kind == "unknown model":  # (a 404 on either route)
        body = {**draw(body_of(CLEAN_REQUIRED, CLEAN, breaks=False)), "model": draw(st.sampled_from(["claude-x", ""]))}
        return draw(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"])), body
    if kind == "fuzzy":
        return "/v1/messages", draw(body_of(MESSAGES_REQUIRED, MESSAGES))
    body = draw(body_of(CLEAN_REQUIRED, CLEAN, breaks=False))
    if kind in ("clean tools", "forced tool"):
        body.update(draw(CLEAN_TOOLS if kind == "clean tools" else FORCED_TOOL))
        body["max_tokens"] = draw(st.integers(1, 48))  # (room to finish a call)
    if kind == "clean stream" or (kind in ("clean tools", "forced tool") and draw(st.booleans())):
        body["stream"] = True
    return "/v1/messages", body


anthropic_raw = st.tuples(st.sampled_from(["/v1/messages", "/v1/messages/count_tokens"]),
                          st.one_of(st.binary(max_size=40), st.just(b'{"messages": "' + b"x" * 70_000 + b'"}')),
                          st.sampled_from(["application/json", "text/plain", "", "application/vnd.api+json"]))

# ---- the app under fuzz ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_app(model_dirs, tmp_path_factory):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", max_model_len=48, max_num_seqs=8)
    roots = tmp_path_factory.mktemp("adapters")
    app = create_app(llm, model_name="tiny", allow_lora_loading=[roots], max_body_bytes=64 * 1024)
    yield app, llm
    llm.close()


def send(app, method: str, path: str, content: bytes, content_type: str) -> httpx.Response:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz",
                                     timeout=30) as client:
            headers = {"content-type": content_type} if content_type else {}
            return await client.request(method, path, content=content, headers=headers)

    return asyncio.run(main())


STATUS_SEEN: dict = {}


def check(response: httpx.Response) -> None:
    key = (response.request.url.path, response.status_code)
    STATUS_SEEN[key] = STATUS_SEEN.get(key, 0) + 1
    assert response.status_code in ALLOWED_STATUSES, (response.status_code, response.text[:300])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", response.text[-300:]
        for line in lines[:-1]:
            json.loads(line[len("data: "):])
    elif response.status_code != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif response.request.url.path not in ("/health", "/metrics"):
        response.json()


@FUZZ_SETTINGS
@given(request_strategy)
def test_fuzz_json_bodies(fuzz_app, drawn):
    app, _ = fuzz_app
    path, body = drawn
    check(send(app, "POST", path, json.dumps(body).encode("utf-8", "surrogatepass"), "application/json"))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw_strategy)
def test_fuzz_raw_requests(fuzz_app, drawn):
    app, _ = fuzz_app
    path, method, content, content_type = drawn
    check(send(app, method, path, content, content_type))


def wait_until_idle(llm) -> dict:
    """The engine's stats once it runs and waits on nothing and holds no KV block (5 s at most)."""
    async def idle():
        for _ in range(500):
            stats = llm.stats()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError(llm.stats())

    return asyncio.run(idle())


def test_after_the_fuzz_the_engine_serves_and_holds_nothing(fuzz_app):
    app, llm = fuzz_app
    response = send(app, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}).encode(), "application/json")
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    wait_until_idle(llm)
    # the fuzz got past validation on the main routes, not only into their 400s
    assert all(STATUS_SEEN.get((path, 200), 0) > 0 for path in ("/v1/chat/completions", "/v1/completions",
                                                                 "/tokenize", "/detokenize")), STATUS_SEEN
    assert llm.list_loras() == []  # nothing outside the allowed directory was ever loaded


# ---- the Anthropic routes: Anthropic's shapes ------------------------------------------------------

# Anthropic's error type of each status (anthropic_messages.error_body); any other 4xx is a bad request
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error"}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
ANTHROPIC_SEEN: dict = {}  # what the fuzz reached: (path, status, streamed) and the block types answered


@pytest.fixture(scope="module")
def anthropic_app(model_dirs):
    # room for a tool definition in the prompt (~350 tokens), so tool_choice any/tool get to generate
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", max_model_len=512, max_num_seqs=8)
    yield create_app(llm, model_name="tiny", max_body_bytes=64 * 1024), llm
    llm.close()


def check_anthropic_error(error: dict, status: int) -> None:
    """Exactly ``{"type": "error", "error": {"type", "message"}}``, the type matching the status."""
    assert set(error) == {"type", "error"} and error["type"] == "error", error
    assert set(error["error"]) == {"type", "message"}, error
    expected = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    assert error["error"]["type"] == expected, (status, error)
    assert isinstance(error["error"]["message"], str) and error["error"]["message"], error


def sse_events(raw: str) -> list[tuple[str, dict]]:
    """``event: NAME`` / ``data: JSON`` frames, in order (comments and blank lines skipped)."""
    events = []
    for frame in raw.replace("\r\n", "\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.split("\n") if line and not line.startswith(":"))
        if fields:
            assert set(fields) == {"event", "data"}, frame
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def check_message_stream(raw: str, body: dict) -> None:
    """Anthropic's event grammar: message_start, ping, blocks (start, deltas, stop, indices 0, 1, ...),
    message_delta, message_stop; or an ``error`` event, which ends the stream wherever it comes."""
    assert "[DONE]" not in raw, raw[-300:]
    events = sse_events(raw)
    assert events and events[0][0] in ("message_start", "error"), raw[:300]
    open_block, next_index, state = None, 0, "start"
    for i, (name, data) in enumerate(events):
        last = i == len(events) - 1
        if name == "error":
            assert last, events[i:]
            assert_known_error_type(data)
            ANTHROPIC_SEEN["stream error event"] = ANTHROPIC_SEEN.get("stream error event", 0) + 1
            return
        assert data.get("type") == name, (name, data)
        if name == "message_start":
            assert state == "start", events
            message = data["message"]
            assert message["type"] == "message" and message["role"] == "assistant" and message["content"] == []
            assert message["id"].startswith("msg_") and message["stop_reason"] is None, message
            assert message["model"] == body.get("model", "tiny") and message["usage"]["input_tokens"] > 0, message
            state = "body"
        elif name == "ping":
            assert state == "body", events
        elif name == "content_block_start":
            assert state == "body" and open_block is None and data["index"] == next_index, events
            open_block = data["content_block"]["type"]
            assert open_block in ("text", "tool_use"), data
            if open_block == "tool_use":
                assert data["content_block"]["name"] and data["content_block"]["input"] == {}, data
            ANTHROPIC_SEEN[f"streamed {open_block} block"] = ANTHROPIC_SEEN.get(f"streamed {open_block} block", 0) + 1
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == next_index, events
            kind = {"text": "text_delta", "tool_use": "input_json_delta"}[open_block]
            assert data["delta"]["type"] == kind, (open_block, data)
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == next_index, events
            open_block, next_index = None, next_index + 1
        elif name == "message_delta":
            assert state == "body" and open_block is None, events
            check_stop(data["delta"], body)
            assert 0 <= data["usage"]["output_tokens"] <= body["max_tokens"], data
            state = "delta"
        elif name == "message_stop":
            assert state == "delta" and last, events
            return
        else:
            raise AssertionError(f"unknown event {name!r}: {data}")
    raise AssertionError(f"the stream ended without message_stop: {events[-3:]}")


def check_stop(message: dict, body: dict) -> None:
    assert message["stop_reason"] in STOP_REASONS, message
    assert (message["stop_sequence"] is not None) == (message["stop_reason"] == "stop_sequence"), message
    if message["stop_sequence"] is not None:
        assert message["stop_sequence"] in body["stop_sequences"], message


def assert_known_error_type(data: dict) -> None:
    # an error event after the 200: a bad request found mid-generation, or the server/engine failing
    assert set(data) == {"type", "error"} and data["type"] == "error" and set(data["error"]) == {"type", "message"}
    assert data["error"]["type"] in {"invalid_request_error", "api_error", "overloaded_error", "rate_limit_error",
                                     "request_too_large", "not_found_error", "permission_error"}, data
    assert data["error"]["message"], data


def check_anthropic(response: httpx.Response, body: object = None) -> None:
    path, status = response.request.url.path, response.status_code
    streamed = response.headers.get("content-type", "").startswith("text/event-stream")
    key = (path, status, streamed)
    ANTHROPIC_SEEN[key] = ANTHROPIC_SEEN.get(key, 0) + 1
    assert status == 200 or 400 <= status < 500, (status, response.text[:300])
    assert status in ALLOWED_STATUSES, (status, response.text[:300])
    if status != 200:
        assert not streamed, response.text[:300]
        check_anthropic_error(response.json(), status)
    elif path == "/v1/messages/count_tokens":
        answer = response.json()
        assert set(answer) == {"input_tokens"} and isinstance(answer["input_tokens"], int) and \
            answer["input_tokens"] > 0, answer
    elif streamed:
        assert isinstance(body, dict) and body.get("stream") is True
        check_message_stream(response.text, body)
    else:
        message = response.json()
        assert set(message) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
        assert message["type"] == "message" and message["role"] == "assistant", message
        assert message["id"].startswith("msg_") and message["model"] == body.get("model", "tiny"), message
        check_stop(message, body)
        for content in message["content"]:
            ANTHROPIC_SEEN[f"{content['type']} block"] = ANTHROPIC_SEEN.get(f"{content['type']} block", 0) + 1
            if content["type"] == "text":
                assert set(content) == {"type", "text"} and content["text"].strip(), content
            else:
                assert content["type"] == "tool_use" and set(content) == {"type", "id", "name", "input"}, content
                assert content["id"] and content["name"] and isinstance(content["input"], dict), content
        usage = message["usage"]
        assert usage["input_tokens"] > 0 and 0 <= usage["output_tokens"] <= body["max_tokens"], usage


@settings(max_examples=2 * int(__import__("os").environ.get("FUZZ_EXAMPLES", "300")), deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(anthropic_request())
def test_fuzz_anthropic_bodies(anthropic_app, drawn):
    app, _ = anthropic_app
    path, body = drawn
    check_anthropic(send(app, "POST", path, json.dumps(body).encode("utf-8", "surrogatepass"), "application/json"),
                    body)


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(anthropic_raw)
def test_fuzz_anthropic_raw_requests(anthropic_app, drawn):
    app, _ = anthropic_app
    path, content, content_type = drawn
    check_anthropic(send(app, "POST", path, content, content_type))


def test_after_the_anthropic_fuzz_the_engine_serves_and_holds_nothing(anthropic_app):
    app, llm = anthropic_app
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}
    response = send(app, "POST", "/v1/messages", json.dumps(body).encode(), "application/json")
    assert response.status_code == 200 and response.json()["usage"]["output_tokens"] >= 1
    wait_until_idle(llm)
    # the fuzz got past validation on both routes, streamed and not, answered with tool_use blocks too, and
    # into each kind of error
    statuses = {(path, status) for path, status, _ in (key for key in ANTHROPIC_SEEN if isinstance(key, tuple))}
    assert all(ANTHROPIC_SEEN.get(key, 0) > 0 for key in [
        ("/v1/messages", 200, False), ("/v1/messages", 200, True), ("/v1/messages/count_tokens", 200, False),
        "text block", "tool_use block", "streamed text block", "streamed tool_use block"]), ANTHROPIC_SEEN
    assert {status for _, status in statuses} >= {400, 404, 413, 415}, ANTHROPIC_SEEN
    assert ("/v1/messages/count_tokens", 400) in statuses, ANTHROPIC_SEEN
