"""The server surface clients reach for beyond chat and completions: CORS, /version, /ping, and
vLLM's request extras (each tested so that ignoring it fails)."""

import asyncio
import json

import pytest

from asyncllm import AsyncLLM, __version__
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.server import create_app
from asyncllm.frontend.prompts import ChatPrompt
from server_helpers import assert_error, request

PREFLIGHT = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    yield llm
    llm.close()


def test_cors_preflight_from_an_allowed_origin(llm):
    app = create_app(llm, api_key="k", allowed_origins=["https://app.example.com"])
    response = request(app, "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "POST" in response.headers["access-control-allow-methods"]
    other = request(app, "OPTIONS", "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = request(app, "POST", "/v1/chat/completions", json=body,
                     headers={"Origin": "https://app.example.com", "Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "https://app.example.com"


def test_no_cors_unless_asked_and_bad_origins_refused(llm):
    assert request(create_app(llm), "OPTIONS", "/v1/chat/completions", headers=PREFLIGHT).status_code == 405
    any_origin = create_app(llm, allowed_origins=["*"])
    response = request(any_origin, "OPTIONS", "/v1/models", headers={**PREFLIGHT, "Origin": "http://localhost:3000"})
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"
    for bad in (["app.example.com"], ["https://app.example.com/"], [3]):
        with pytest.raises(ConfigError, match="allowed_origins"):
            create_app(llm, allowed_origins=bad)


def test_version_and_ping(llm):
    app = create_app(llm, api_key="k")  # both answer without the key, like /health
    assert request(app, "GET", "/version").json() == {"version": __version__}
    assert request(app, "GET", "/ping").status_code == 200


def test_serve_allowed_origins_flag():
    from asyncllm.cli import build_parser
    from asyncllm.server.serve_spec import _origins

    args = build_parser().parse_args(["serve", "m", "--allowed-origins", "https://a.example,https://b.example",
                                      "--allowed-origins", "http://localhost:3000"])
    assert _origins(args.allowed_origins) == ["https://a.example", "https://b.example", "http://localhost:3000"]
    assert _origins(build_parser().parse_args(["serve", "m"]).allowed_origins) is None


# ---- vLLM's request extras ---------------------------------------------------------------------------

CHAT = [{"role": "user", "content": "Is the sky blue?"}]


def chat(app, **fields):
    response = request(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8, **fields})
    return response


@pytest.mark.parametrize("fields, check", [
    ({"guided_choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    ({"structured_outputs": {"choice": ["maybe", "never"]}}, lambda text: text in ("maybe", "never")),
    ({"guided_regex": "[0-9]{3}"}, lambda text: len(text) == 3 and text.isdigit()),
    ({"structured_outputs": {"regex": "ab+c"}}, lambda text: text.startswith("ab") and text.endswith("c")),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                      "additionalProperties": False}}, lambda text: isinstance(json.loads(text)["a"], int)),
    ({"structured_outputs": {"json_object": True}}, lambda text: text.startswith("{")),  # (may be cut short)
], ids=["guided_choice", "so-choice", "guided_regex", "so-regex", "guided_json", "so-json_object"])
def test_structured_output_extras_constrain_the_answer(llm, fields, check):
    app = create_app(llm)
    for endpoint in ("chat", "completions"):
        if endpoint == "chat":
            response = chat(app, max_tokens=40, temperature=0.8, seed=1, **fields)
            text = response.json()["choices"][0]["message"]["content"]
        else:
            response = request(app, "POST", "/v1/completions",
                               json={"prompt": "Answer:", "max_tokens": 40, "temperature": 0.8, "seed": 1, **fields})
            text = response.json()["choices"][0]["text"]
        assert response.status_code == 200, response.text
        assert check(text), (fields, text)


def test_structured_output_extras_conflicts_and_refused_fields(llm):
    app = create_app(llm)
    assert_error(chat(app, guided_choice=["a"], guided_regex="b"), 400, "guided_choice")
    assert_error(chat(app, response_format={"type": "json_object"}, structured_outputs={"choice": ["a"]}), 400,
                 "structured_outputs")
    assert_error(chat(app, structured_outputs={"structural_tag": "x"}), 400, "structured_outputs")
    assert_error(chat(app, guided_regex="("), 400, "guided_regex")  # the grammar engine's refusal, named
    for name, value in (("guided_whitespace_pattern", " "), ("logits_processors", ["x"]),
                        ("allowed_token_ids", [1, 2])):
        assert_error(chat(app, **{name: value}), 400, name)
    assert chat(app, some_future_openai_field=1).status_code == 200  # unknown fields: accepted, ignored


@pytest.fixture(scope="module")
def thinking_llm(model_dirs, tmp_path_factory):
    """The test model with a chat template that reads ``enable_thinking`` (as Qwen3's does), and that
    renders nothing at all when ``blank`` is set."""
    import shutil

    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(model_dirs["llama"], path)
    template = path / "chat_template.jinja"
    template.write_text("{% if blank is defined and blank %}{% else %}" + template.read_text() +
                        "{% if enable_thinking is defined and enable_thinking %}{{ '<think>' }}{% endif %}{% endif %}")
    llm = AsyncLLM(str(path), dtype="float32")
    yield llm
    llm.close()


def test_chat_template_kwargs_reach_the_template(thinking_llm):
    app = create_app(thinking_llm)
    plain = chat(app).json()["usage"]["prompt_tokens"]
    thinking = chat(app, chat_template_kwargs={"enable_thinking": True}).json()["usage"]["prompt_tokens"]
    assert thinking > plain
    tokenized = asyncio.run(thinking_llm.generate(ChatPrompt(CHAT, chat_template_kwargs={"enable_thinking": True}),
                                                  max_tokens=1))
    assert tokenized.prompt.endswith("<think>")
    assert_error(chat(app, chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs")


def test_the_chat_template_is_the_operators(thinking_llm):
    """No argument of the template call can be set by a client: above all not the template itself."""
    app = create_app(thinking_llm)
    for key, value in (("chat_template", "{{ 7*7 }}"), ("documents", [{"text": "x"}]),
                       ("tokenizer_kwargs", {}), ("return_assistant_tokens_mask", True)):
        response = chat(app, chat_template_kwargs={key: value})
        assert_error(response, 400, "chat_template_kwargs")
        assert key in response.json()["error"]["message"]
    with pytest.raises(InvalidRequestError, match="chat_template"):
        asyncio.run(thinking_llm.generate(ChatPrompt(CHAT, chat_template_kwargs={"chat_template": "{{ 7*7 }}"}),
                                          max_tokens=1))


def test_a_template_rendering_nothing_is_refused(thinking_llm):
    app = create_app(thinking_llm)
    assert_error(chat(app, chat_template_kwargs={"blank": True}), 400, "messages")
    assert chat(app).status_code == 200  # and the next request is served
    assert thinking_llm.stats()["num_running"] == 0


def test_continue_final_message_and_echo(llm):
    app = create_app(llm)
    partial = CHAT + [{"role": "assistant", "content": "The answer is"}]
    body = {"messages": partial, "max_tokens": 6, "temperature": 0}
    opened = request(app, "POST", "/v1/chat/completions", json=body).json()
    continued = request(app, "POST", "/v1/chat/completions",
                        json={**body, "continue_final_message": True, "echo": True}).json()
    # the open assistant turn is not closed (no end-of-turn, no new assistant header)
    assert continued["usage"]["prompt_tokens"] < opened["usage"]["prompt_tokens"]
    assert continued["choices"][0]["message"]["content"].startswith("The answer is")
    direct = asyncio.run(llm.generate(ChatPrompt(partial, add_generation_prompt=False, continue_final_message=True),
                                      max_tokens=1))
    assert direct.prompt.endswith("The answer is")
    assert_error(request(app, "POST", "/v1/chat/completions",
                         json={**body, "continue_final_message": True, "add_generation_prompt": True}),
                 400, "continue_final_message")
    streamed = request(app, "POST", "/v1/chat/completions",
                       json={**body, "continue_final_message": True, "echo": True, "stream": True})
    pieces = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in pieces if p["choices"])
    assert text == continued["choices"][0]["message"]["content"]


def test_prompt_logprobs_and_tokens_as_ids(llm):
    app = create_app(llm)
    answer = chat(app, prompt_logprobs=2, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True).json()
    prompt_lps = answer["prompt_logprobs"]
    assert len(prompt_lps) == answer["usage"]["prompt_tokens"] and prompt_lps[0] is None
    assert all(2 <= len(entry) <= 3 for entry in prompt_lps[1:])
    assert all(e["decoded_token"].startswith("token_id:") for entry in prompt_lps[1:] for e in entry.values())
    tokens = answer["choices"][0]["logprobs"]["content"]
    assert tokens and all(t["token"].startswith("token_id:") for t in tokens)
    assert "prompt_logprobs" not in chat(app).json()
    completion = request(app, "POST", "/v1/completions",
                         json={"prompt": "Hello there", "max_tokens": 3, "prompt_logprobs": 1, "logprobs": 1,
                               "return_tokens_as_token_ids": True}).json()
    choice = completion["choices"][0]
    assert len(choice["prompt_logprobs"]) == completion["usage"]["prompt_tokens"]
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])


def test_bad_words_are_never_generated(llm):
    app = create_app(llm)
    prompt = [11, 57, 300, 812, 45]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = asyncio.run(llm.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)).outputs[0]
    tokenizer = llm.tokenizer
    # a generated token whose text encodes back to it: banning that text bans the token
    token = next(t for t in free.token_ids[1:] if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False)
                 == [t] and tokenizer.decode([t]).strip())
    word = tokenizer.decode([token])
    banned = asyncio.run(llm.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True,
                                      bad_words=[word])).outputs[0]
    assert token in free.token_ids and token not in banned.token_ids
    over_http = request(app, "POST", "/v1/completions", json={**body, "bad_words": [word]}).json()
    assert over_http["choices"][0]["text"] == banned.text
    assert_error(request(app, "POST", "/v1/completions", json={**body, "bad_words": [""]}), 400, "bad_words")


def test_truncate_prompt_tokens_keeps_the_end(llm):
    app = create_app(llm)
    long_prompt = list(range(20, 20 + llm.max_model_len + 50))  # longer than the context
    body = {"prompt": long_prompt, "max_tokens": 2, "truncate_prompt_tokens": 16, "temperature": 0}
    response = request(app, "POST", "/v1/completions", json=body)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 16
    short = request(app, "POST", "/v1/completions", json={**body, "prompt": long_prompt[-16:]}).json()
    assert response.json()["choices"][0]["text"] == short["choices"][0]["text"]
    assert_error(request(app, "POST", "/v1/completions", json={**body, "truncate_prompt_tokens": 0}), 400,
                 "truncate_prompt_tokens")


def test_serve_exposes_the_engine_arguments(tmp_path):
    from asyncllm.cli import build_parser
    from asyncllm.server.serve_spec import engine_extras, _read_template

    parse = lambda *flags: build_parser().parse_args(["serve", "m", *flags])  # noqa: E731
    assert engine_extras(parse()) == {}  # nothing given: the engine's defaults
    extras = engine_extras(parse("--block-size", "32", "--no-enable-prefix-caching", "--max-loras", "2",
                                  "--max-lora-rank", "16", "--max-cpu-loras", "4", "--attention-backend", "torch",
                                  "--no-enable-cuda-graphs", "--seed", "7", "--tensor-parallel-size", "1",
                                  "--model-impl", "transformers", "--kv-cache-dtype", "bfloat16"))
    assert extras == {"block_size": 32, "kv_cache_dtype": "bfloat16", "enable_prefix_caching": False, "max_loras": 2, "max_lora_rank": 16,
                      "max_cpu_loras": 4, "attention_backend": "torch", "enable_cuda_graphs": False, "seed": 7,
                      "tensor_parallel_size": 1, "model_impl": "transformers"}
    from asyncllm.config import EngineConfig
    EngineConfig.from_kwargs("m", extras)  # every one is an engine argument
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert _read_template(str(template)) == "{{ messages[0]['content'] }}"
    assert _read_template("{{ 'x' }}") == "{{ 'x' }}"
    with pytest.raises(SystemExit, match="chat-template"):
        _read_template(str(tmp_path / "missing.jinja"))


def test_serve_chat_template_and_engine_flags_reach_the_server(model_dirs, tmp_path):
    import httpx

    from server_helpers import start_serve

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    proc, base = start_serve(str(model_dirs["llama"]), "--dtype", "float32", "--chat-template", str(template),
                             "--block-size", "8", "--no-enable-prefix-caching", "--allowed-origins", "http://x.test")
    try:
        tokens = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hello"}]}).json()
        plain = httpx.post(f"{base}/tokenize", json={"prompt": "hello\n", "add_special_tokens": False}).json()
        assert tokens["tokens"] == plain["tokens"]  # the template given, not the tokenizer's
        preflight = httpx.options(f"{base}/v1/models", headers={"Origin": "http://x.test",
                                                               "Access-Control-Request-Method": "GET"})
        assert preflight.status_code == 200
        import openai  # the Responses API through the command, whole and streamed

        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            name = client.models.list().data[0].id
            whole = client.responses.create(model=name, input="Hi", max_output_tokens=6, temperature=0)
            events = list(client.responses.create(model=name, input="Hi", max_output_tokens=6, temperature=0,
                                                  stream=True))
        assert whole.output_text and events[-1].response.output_text == whole.output_text
    finally:
        proc.terminate()
        proc.communicate(timeout=15)


# ---- reasoning parsers ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, text, expected", [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "Paris.")),
    ("qwen3", "Paris, no thinking.", ("", "Paris, no thinking.")),
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("deepseek_r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),
    ("deepseek_r1", "a < b, so</think>\n\nyes", ("a < b, so", "yes")),
])
def test_reasoning_splits_any_way_the_text_arrives(kind, text, expected):
    from asyncllm.server.reasoning import ReasoningSplitter, split_reasoning

    assert split_reasoning(kind, text) == expected
    for size in (1, 2, 3, 5):
        splitter = ReasoningSplitter(kind)
        reasoning = content = ""
        for start in range(0, len(text), size):
            r, c = splitter.feed(text[start:start + size])
            reasoning, content = reasoning + r, content + c
        r, c = splitter.finish()
        assert (reasoning + r, content + c) == expected, size


def test_reasoning_content_in_chat_whole_and_streamed(llm):
    """A reasoning output (forced with a choice constraint) comes back with its thinking apart."""
    app = create_app(llm, reasoning_parser="qwen3")
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0,
            "guided_choice": ["<think>The sky scatters blue light.</think>Yes."]}
    message = request(app, "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The sky scatters blue light." and message["content"] == "Yes."
    streamed = request(app, "POST", "/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The sky scatters blue light."
    assert "".join(d.get("content") or "" for d in deltas) == "Yes."
    plain = request(create_app(llm), "POST", "/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert "reasoning_content" not in plain and plain["content"].startswith("<think>")
    with pytest.raises(ConfigError, match="reasoning_parser"):
        create_app(llm, reasoning_parser="o1")


def test_bad_words_are_bounded(llm):
    app = create_app(llm)
    body = {"prompt": "hi", "max_tokens": 2}
    assert_error(request(app, "POST", "/v1/completions", json={**body, "bad_words": ["w"] * 1025}), 400, "bad_words")
    assert_error(request(app, "POST", "/v1/completions", json={**body, "bad_words": ["w" * 257]}), 400, "bad_words")
