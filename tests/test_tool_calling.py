"""Tool calling with a random-weight model: tools reach the prompt, tool_choice "required" and a
named function always give well-formed calls with schema-valid arguments (AsyncLLM and the
server, whole and streamed), streamed fragments join to the whole answer's arguments."""

import asyncio
import json

import httpx
import jsonschema
import pytest

from asyncllm import AsyncLLM, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.server import create_app
from asyncllm.tools import HermesParser, Llama3JsonParser, MistralParser, merge_fragments

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "days", "unit"]}
SEARCH = {"type": "object", "properties": {
    "query": {"type": "string", "maxLength": 16},
    "exact": {"type": "boolean"}}, "required": ["query"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "web_search", "description": "Search the web",
                                           "parameters": SEARCH}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time"}}]
SCHEMAS = {"get_weather": WEATHER, "web_search": SEARCH,
           "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def model_dir(model_dir_factory):
    # the tool definitions alone are ~750 tokens of the tiny test tokenizer: a longer context than the default
    return str(model_dir_factory("llama", max_position_embeddings=2048))


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = AsyncLLM(model_dir, dtype="float32")
    yield llm
    llm.close()


def _check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call.id.startswith("call_") and (names is None or call.name in names)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


async def _streamed(llm, **kwargs):
    """(content, fragments, finish_reason) of one streamed request."""
    content, fragments, finish = "", [], None
    async for delta in llm.stream_outputs(MESSAGES, tools=TOOLS, **kwargs):
        c = delta.outputs[0]
        content += c.text
        fragments += c.tool_calls or []
        finish = c.finish_reason or finish
    return content, fragments, finish


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_are_valid_whole_and_streamed(llm, tool_choice):
    names = ["get_weather"] if tool_choice == NAMED else None

    async def main():
        for seed in range(5):
            kwargs = dict(tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=400)
            whole = (await llm.generate(MESSAGES, tools=TOOLS, **kwargs)).outputs[0]
            assert whole.finish_reason == "tool_calls" and whole.text == ""
            _check_calls(whole.tool_calls, names)
            if tool_choice == NAMED:
                assert len(whole.tool_calls) == 1
            content, fragments, finish = await _streamed(llm, **kwargs)
            joined = []
            merge_fragments(joined, fragments)
            assert (content, finish) == ("", "tool_calls")
            assert [(c.name, c.arguments) for c in joined] == [(c.name, c.arguments) for c in whole.tool_calls]
            assert fragments[0].name is not None and fragments[0].arguments == ""  # name first, then arguments

    asyncio.run(main())


def test_tool_choice_none_and_auto_leave_free_text(llm):
    async def main():
        plain = await llm.generate(MESSAGES, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12)
        auto = await llm.generate(MESSAGES, tools=TOOLS, temperature=0, max_tokens=12)
        assert plain.outputs[0].tool_calls is None and plain.outputs[0].finish_reason in ("stop", "length")
        assert auto.outputs[0].text == plain.outputs[0].text  # the random model calls nothing on its own
        assert auto.outputs[0].tool_calls is None

    asyncio.run(main())


def test_tools_reach_the_prompt_of_a_template_that_ignores_them(llm):
    async def main():
        out = await llm.generate(MESSAGES, tools=TOOLS, max_tokens=1)
        assert "get_weather" in out.prompt and "<tools>" in out.prompt and "You are helpful." in out.prompt
        history = MESSAGES + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 1, "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
        out = await llm.generate(history, tools=TOOLS, max_tokens=1)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in out.prompt
        assert "<tool_response>\nsunny, 21C\n</tool_response>" in out.prompt

    asyncio.run(main())


@pytest.mark.parametrize("kwargs, field", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "json_schema": WEATHER}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_name_the_field(llm, kwargs, field):
    async def main():
        with pytest.raises(InvalidRequestError) as info:
            await llm.generate(MESSAGES, max_tokens=2, **kwargs)
        assert info.value.field == field

    asyncio.run(main())


@pytest.mark.parametrize("parser", [HermesParser, Llama3JsonParser, MistralParser])
def test_each_format_forces_calls_its_parser_reads(model_dir, parser):
    async def main():
        async with AsyncLLM(model_dir, dtype="float32", tool_parser=parser.name) as llm:
            assert llm.tool_parser == parser.name
            for tool_choice in ("required", NAMED):
                out = (await llm.generate(MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=0.8, seed=3,
                                          max_tokens=400)).outputs[0]
                assert out.finish_reason == "tool_calls" and out.text == ""
                _check_calls(out.tool_calls)

    asyncio.run(main())


# ---- over HTTP -------------------------------------------------------------------------------------

def _post(app, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", json=body)

    return asyncio.run(main())


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_server_tool_calls_whole_and_streamed(llm, tool_choice):
    app = create_app(llm)
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 1.0, "seed": 11,
            "max_tokens": 400}
    whole = _post(app, body).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    response = _post(app, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed: dict[int, dict] = {}
    for chunk in chunks:
        for item in chunk["choices"][0]["delta"].get("tool_calls", []):
            if item["index"] not in streamed:  # the first piece of a call: index, id, type and name
                assert item["id"] and item["type"] == "function" and item["function"]["name"]
                streamed[item["index"]] = {"name": item["function"]["name"], "arguments": ""}
            else:
                assert set(item) == {"index", "function"} and set(item["function"]) == {"arguments"}
            streamed[item["index"]]["arguments"] += item["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [streamed[i] for i in sorted(streamed)] == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]


def test_server_response_format_and_tool_errors(llm):
    app = create_app(llm)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
              "required": ["ok", "n"]}
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 1.0, "seed": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    content = _post(app, body).json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), schema)
    for bad, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                        "tool_choice"),
                       ({"tool_choice": "required"}, "tool_choice"),
                       ({"response_format": {"type": "json_schema"}}, "response_format")]:
        response = _post(app, {"messages": MESSAGES, "max_tokens": 4, **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_sync_llm_takes_tools_too(model_dir):
    from asyncllm import LLM

    llm = LLM(model_dir, dtype="float32")
    outputs = llm.generate([MESSAGES, MESSAGES], SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=400),
                           tools=TOOLS, tool_choice="required")
    for output in outputs:
        for c in output.outputs:
            assert c.finish_reason == "tool_calls"
            _check_calls(c.tool_calls)


def test_special_token_markers_are_forced_and_parsed(tokenizer_dir):
    """A Mistral-style tokenizer where [TOOL_CALLS] is a special token: the forced grammar emits that
    token, and the parser sees it although the detokenizer skips special tokens."""
    import torch
    from transformers import AutoTokenizer

    from asyncllm.engine.core import SequenceOutput
    from asyncllm.frontend.input_processor import InputProcessor
    from asyncllm.frontend.output_processor import OutputProcessor
    from asyncllm.structured import apply_grammar_masks
    from asyncllm.tools import detect_tool_parser

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    marker = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    assert detect_tool_parser(tokenizer) == "mistral"
    inputs = InputProcessor(tokenizer, 1100, 4096, eos_token_ids=[1], tool_parser="mistral")
    _, request = inputs.process(MESSAGES, SamplingParams(max_tokens=50), tools=TOOLS, tool_choice=NAMED)
    logits = torch.zeros(1, 1100)
    apply_grammar_masks(logits, [0], [request.grammar.new_state()])
    assert (logits[0] == 0).nonzero().flatten().tolist() == [marker]
    outputs = OutputProcessor(tokenizer, lambda *args: None)
    state = outputs.add(request, None)
    body = '[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "celsius"}}]'
    ids = [marker] + tokenizer.encode(body, add_special_tokens=False)
    outputs.process([SequenceOutput(request.request_id, 0, ids, [0.0] * len(ids), finish_reason="stop",
                                    serial=request.serial)])
    c = state.output().outputs[0]
    assert (c.text, c.finish_reason) == ("", "tool_calls")
    assert [(t.name, json.loads(t.arguments)["city"]) for t in c.tool_calls] == [("get_weather", "Oslo")]


def test_agent_loop_example(llm, capsys):
    """examples/agent_loop.py over HTTP with the openai client: call, tool answer, continuation."""
    import importlib.util
    from pathlib import Path

    from server_helpers import serve_in_thread

    path = Path(__file__).resolve().parent.parent / "examples" / "agent_loop.py"
    spec = importlib.util.spec_from_file_location("agent_loop", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with serve_in_thread(create_app(llm)) as url:
        messages = example.run(f"{url}/v1", max_tokens=128)
    roles = [m["role"] for m in messages]
    assert roles[:4] == ["system", "user", "assistant", "tool"] and roles[-1] == "assistant"
    call = messages[2]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), example.TOOLS[0]["function"]["parameters"])
    assert json.loads(messages[3]["content"])["sky"] == "clear"
    assert "[tool] get_weather(" in capsys.readouterr().out


@pytest.mark.parametrize("parser, text", [
    (HermesParser, 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (MistralParser, 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    (Llama3JsonParser, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
])
def test_a_cut_never_leaks_call_markup_into_content(parser, text):
    """Cut at every character: the content is at most the text before the call, never a piece of
    its markup; a call whose name is complete is kept (with the arguments it had)."""
    before = text[:text.index(parser.start)].rstrip() if parser.start in text else ""
    for end in range(len(text) + 1):
        p = parser()
        content, _ = p.feed(text[:end])
        rest, _ = p.finish(cut=True)
        content += rest
        shown = content.rstrip()  # (text cut right after a space shows the space: it was content)
        assert shown == before[:len(shown)] and "<" not in content and "{" not in content, (end, content)
        assert not p.calls or p.calls[0].name == "get_weather"


def test_forced_call_cut_by_max_tokens_has_no_content(llm):
    """tool_choice="required" cut at every length: no markup in the content (whole and streamed),
    finish_reason "length" until the call completes."""
    async def main():
        for max_tokens in range(1, 28, 3):
            kwargs = dict(tool_choice="required", temperature=0, max_tokens=max_tokens)
            whole = (await llm.generate(MESSAGES, tools=TOOLS, **kwargs)).outputs[0]
            assert whole.text == "", (max_tokens, whole.text)
            assert whole.finish_reason in ("length", "tool_calls")
            content, _, finish = await _streamed(llm, **kwargs)
            assert content == "" and finish == whole.finish_reason

    asyncio.run(main())
