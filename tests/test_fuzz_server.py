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


def body_of(required: dict, optional: dict) -> st.SearchStrategy:
    """The route's required fields (plausible; one in ten bodies breaks one of them) plus up to
    three optional fields, each mostly plausible: deep enough to be served, wide enough to probe."""
    @st.composite
    def build(draw) -> dict:
        body = {name: draw(strategy) for name, strategy in required.items()}
        names = draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)) if optional else []
        for name in names:
            body[name] = draw(optional[name])
        if required and draw(st.integers(0, 9)) == 0:
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


def test_after_the_fuzz_the_engine_serves_and_holds_nothing(fuzz_app):
    app, llm = fuzz_app
    response = send(app, "POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}).encode(), "application/json")
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1

    async def idle():
        for _ in range(500):
            stats = llm.stats()
            if stats["kv_blocks_used"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError(llm.stats())

    asyncio.run(idle())
    # the fuzz got past validation on the main routes, not only into their 400s
    assert all(STATUS_SEEN.get((path, 200), 0) > 0 for path in ("/v1/chat/completions", "/v1/completions",
                                                                 "/tokenize", "/detokenize")), STATUS_SEEN
    assert llm.list_loras() == []  # nothing outside the allowed directory was ever loaded
