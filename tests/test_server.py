"""The OpenAI-style sub-app in-process (httpx's ASGI transport): formats, errors, routes, metrics."""

import json
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Mount

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from server_helpers import assert_error, request

CHAT = [{"role": "user", "content": "Tell me about the cat"}]


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def app(llm):
    return create_app(llm)


def sse_data(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    assert response.headers["content-type"].startswith("text/event-stream")
    return [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]


def metric(app, name: str, **labels) -> float:
    labels = {"model_name": app.state.asyncllm.model_name, **labels}
    return app.state.asyncllm.metrics.registry.get_sample_value(name, labels) or 0.0


# ---- chat completions ------------------------------------------------------------------------------

def test_chat_stream_chunks_follow_openai(app):
    body = {"messages": CHAT, "max_tokens": 8, "n": 2, "temperature": 0.9, "seed": 11}
    full = request(app, "POST", "/v1/chat/completions", json=body).json()
    assert full["object"] == "chat.completion" and [c["index"] for c in full["choices"]] == [0, 1]
    response = request(app, "POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}})
    data = sse_data(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all("usage" in c for c in chunks) and all(c["usage"] is None for c in chunks[:-1])
    for index in (0, 1):  # one role chunk first, content deltas, then one finish chunk with an empty delta
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
        text = "".join(m["delta"].get("content", "") for m in mine)
        assert text == full["choices"][index]["message"]["content"]
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == 16
    assert full["usage"]["total_tokens"] == full["usage"]["prompt_tokens"] + 16


def test_chat_without_include_usage_has_no_usage_field(app):
    response = request(app, "POST", "/v1/chat/completions",
                       json={"messages": CHAT, "max_tokens": 3, "stream": True})
    chunks = [json.loads(d) for d in sse_data(response)[:-1]]
    assert chunks and all("usage" not in c for c in chunks)


def test_chat_logprobs_in_openai_format(app, llm):
    body = {"messages": CHAT, "max_completion_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    full = request(app, "POST", "/v1/chat/completions", json=body).json()
    content = full["choices"][0]["logprobs"]["content"]
    assert len(content) == full["usage"]["completion_tokens"] == 5
    for entry in content:
        assert len(entry["top_logprobs"]) == 3 and entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] <= 0 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
        assert entry["token"] == entry["top_logprobs"][0]["token"]  # greedy: the chosen token is the best
    streamed = sse_data(request(app, "POST", "/v1/chat/completions", json={**body, "stream": True}))
    pieces = [json.loads(d)["choices"][0]["logprobs"] for d in streamed[:-1]]
    assert [e for p in pieces if p for e in p["content"]] == content


# ---- completions ---------------------------------------------------------------------------------

def test_completions_batch_echo_and_logprobs(app, llm):
    body = {"prompt": ["The old man", "A small bird"], "max_tokens": 4, "n": 2, "temperature": 0,
            "echo": True, "logprobs": 2}
    full = request(app, "POST", "/v1/completions", json=body).json()
    assert full["object"] == "text_completion" and [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    for choice in full["choices"]:
        prompt = body["prompt"][choice["index"] // 2]
        assert choice["text"].startswith(prompt) and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        prompt_len = len(llm.tokenizer.encode(prompt))
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == prompt_len + 4
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
        assert lp["text_offset"] == sorted(lp["text_offset"])
    assert full["usage"]["prompt_tokens"] == sum(len(llm.tokenizer.encode(p)) for p in body["prompt"])
    assert full["usage"]["completion_tokens"] == 16
    data = sse_data(request(app, "POST", "/v1/completions", json={**body, "stream": True}))
    texts = {}
    for d in data[:-1]:
        choice = json.loads(d)["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}


def test_completions_token_id_prompts(app, llm):
    full = request(app, "POST", "/v1/completions",
                   json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 3, "temperature": 0}).json()
    assert len(full["choices"]) == 2 and full["usage"]["prompt_tokens"] == 5


# ---- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": list(range(5, 700))}, 400, "prompt"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {}, 400, "prompt"),
])
def test_bad_requests_get_openai_errors(app, path, body, status, param):
    error = assert_error(request(app, "POST", path, json=body), status, param)
    if status == 404:
        assert error["code"] == "model_not_found"


def test_malformed_bodies_and_unknown_routes(app):
    assert_error(request(app, "POST", "/v1/chat/completions", content=b"{not json",
                         headers={"content-type": "application/json"}), 400)
    assert_error(request(app, "POST", "/v1/chat/completions", json=[1, 2]), 400)
    assert_error(request(app, "GET", "/v1/nothing-here"), 404)
    assert_error(request(app, "GET", "/v1/chat/completions"), 405)


def test_api_key(llm):
    app = create_app(llm, api_key="sekret")
    chat = {"messages": CHAT, "max_tokens": 2}
    assert_error(request(app, "POST", "/v1/chat/completions", json=chat), 401)
    assert_error(request(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert request(app, "POST", "/v1/chat/completions", json=chat,
                   headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert request(app, "GET", "/health").status_code == 200  # probes and scrapers need no key
    assert request(app, "GET", "/metrics").status_code == 200


def test_dead_engine_is_503(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    app = create_app(llm)
    assert request(app, "GET", "/health").status_code == 200
    llm.close()
    assert_error(request(app, "GET", "/health"), 503)
    error = assert_error(request(app, "POST", "/v1/chat/completions", json={"messages": CHAT}), 503)
    assert error["type"] == "server_error"


# ---- other routes ----------------------------------------------------------------------------------

def test_models_and_prefix_mount(app, llm, model_dirs):
    name = Path(model_dirs["llama"]).name  # default model name: the checkpoint directory's basename
    host = Starlette(routes=[Mount("/deep/llm", app=app)])
    models = request(host, "GET", "/deep/llm/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [name]
    assert models["data"][0]["max_model_len"] == llm.max_model_len
    assert request(host, "GET", f"/deep/llm/v1/models/{name}").json()["id"] == name
    assert_error(request(host, "GET", "/deep/llm/v1/models/other"), 404)
    chat = request(host, "POST", "/deep/llm/v1/chat/completions",
                   json={"model": name, "messages": CHAT, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == name
    assert_error(request(host, "GET", "/deep/llm/nope"), 404)


def test_lora_routes_answer_clearly(llm, tmp_path):
    closed = create_app(llm)  # loading over HTTP is off unless the app opts in
    assert_error(request(closed, "POST", "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/x"}), 403)
    assert_error(request(closed, "POST", "/v1/unload_lora_adapter", json={"lora_name": "sql"}), 403)
    app = create_app(llm, allow_lora_loading=[tmp_path])
    # no such adapter: a clear 400 that says nothing about the filesystem
    error = assert_error(request(app, "POST", "/v1/load_lora_adapter",
                                 json={"lora_name": "sql", "lora_path": str(tmp_path / "nowhere")}), 400)
    assert str(tmp_path) not in error["message"] and "sql" in error["message"]
    assert_error(request(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "sql"}), 404)
    assert_error(request(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "sql"}), 400, "lora_path")


def test_tokenize_and_detokenize(app, llm):
    tokens = request(app, "POST", "/tokenize", json={"prompt": "Hello there"}).json()
    assert tokens["tokens"] == llm.tokenizer.encode("Hello there") and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == llm.max_model_len
    chat = request(app, "POST", "/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"][0] == 3  # <|im_start|>: rendered with the chat template
    text = request(app, "POST", "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>user\nTell me about the cat")
    assert_error(request(app, "POST", "/detokenize", json={"tokens": [10**7]}), 400, "tokens")
    assert_error(request(app, "POST", "/tokenize", json={"prompt": "a", "messages": CHAT}), 400)
    assert_error(request(app, "POST", "/tokenize", json={"prompt": 5}), 400, "prompt")


# ---- metrics ---------------------------------------------------------------------------------------

def _scrape(app) -> dict[str, float]:
    response = request(app, "GET", "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            key = sample.name + "".join(f"|{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[key] = sample.value
    return samples


def test_metrics_parse_and_move_with_traffic(app):
    before = _scrape(app)
    for name in ("asyncllm:num_requests_running", "asyncllm:num_requests_waiting", "asyncllm:kv_cache_usage_perc",
                 "asyncllm:num_preemptions_total", "asyncllm:lora_adapters_loaded"):
        assert name in before
    # 32 tokens: enough that some arrive after the first even when a loaded machine delays the consumer
    response = request(app, "POST", "/v1/completions", json={"prompt": "The cat", "max_tokens": 32,
                                                             "ignore_eos": True, "n": 2})
    usage = response.json()["usage"]
    after = _scrape(app)

    def moved(key):
        return after.get(key, 0) - before.get(key, 0)

    assert moved("asyncllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert moved("asyncllm:generation_tokens_total") == 64
    assert moved("asyncllm:request_success_total|finished_reason=length") == 2
    assert moved("asyncllm:prefix_cache_queries_total") >= usage["prompt_tokens"]
    assert moved("asyncllm:time_to_first_token_seconds_count") == 1
    assert moved("asyncllm:e2e_request_latency_seconds_count") == 1
    # one gap per token after the first, except tokens that arrived together with the first one
    assert 1 <= moved("asyncllm:inter_token_latency_seconds_count") <= 31
    assert after["asyncllm:num_requests_running"] == 0 and after["asyncllm:kv_cache_usage_perc"] == 0
    assert after["asyncllm:itl_target_seconds"] == app.state.asyncllm.llm.stats()["itl_target_ms"] / 1000 > 0


def test_two_apps_keep_separate_registries(llm):
    first, second = create_app(llm, model_name="one"), create_app(llm, model_name="two")
    request(first, "POST", "/v1/completions", json={"model": "one", "prompt": "Hi", "max_tokens": 3,
                                                    "ignore_eos": True})
    assert metric(first, "asyncllm:generation_tokens_total") == 3
    assert metric(second, "asyncllm:generation_tokens_total") == 0
    assert "model_name=\"two\"" in request(second, "GET", "/metrics").text


def test_lora_adapter_lifecycle_over_http(model_dirs, tmp_path):
    pytest.importorskip("peft")
    from server_helpers import build_test_adapter

    base = model_dirs["llama"]
    build_test_adapter(base, tmp_path / "sql")
    llm = AsyncLLM(str(base), dtype="float32")
    try:
        app = create_app(llm, model_name="base", allow_lora_loading=[tmp_path])
        loaded = request(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "sql"})
        assert loaded.status_code == 200, loaded.text
        cards = request(app, "GET", "/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("base", None), ("sql", "base")]
        assert metric(app, "asyncllm:lora_adapters_loaded") == 1
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        via_base = request(app, "POST", "/v1/completions", json=body).json()
        via_sql = request(app, "POST", "/v1/completions", json={**body, "model": "sql"}).json()
        assert via_sql["model"] == "sql"
        assert via_sql["choices"][0]["logprobs"]["tokens"] != via_base["choices"][0]["logprobs"]["tokens"]
        assert request(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
        assert [c["id"] for c in request(app, "GET", "/v1/models").json()["data"]] == ["base"]
        assert_error(request(app, "POST", "/v1/completions", json={**body, "model": "sql"}), 404, "model")
    finally:
        llm.close()
