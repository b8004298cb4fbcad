"""Grammar compilation cannot crash or wedge the host (asyncllm/structured/compile_guard.py).

Every new grammar is compiled in a child process first: a native crash there (a real one, with
the bounds of limits.py lifted, or an injected SIGSEGV) and a compile that overruns the time limit
are 400s naming the field, the child is replaced and the next grammar compiles. A matcher that
gives up during generation (a per-step llguidance limit) ends its request with a 400, not with
a "stop" whose text ignores the grammar. Closing leaves no process or socket behind.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import threading
import time

import jsonschema
import llguidance
import pytest
from transformers import AutoTokenizer

from asyncllm import AsyncLLM, LLM, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.server import create_app
from asyncllm.structured import GrammarCompiler, GrammarTemplate, compile_guard, limits
from server_helpers import assert_error, request
from test_grammar_limits import ref_chain, rule_chain

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
CHAT = [{"role": "user", "content": "Hello"}]
# a regex that compiles, then runs out of lexer states a few tokens in (long before it can match)
EXHAUSTING_REGEX = "[a-z]{60}"


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], guard=True)
    yield compiler
    compiler.close()


@pytest.fixture
def lifted_limits(monkeypatch):
    """limits.py's bounds out of the way: the sources known to crash llguidance reach the compiler."""
    for name in ("MAX_REF_CHAIN", "MAX_RULE_CHAIN", "MAX_DEFINITIONS"):
        monkeypatch.setattr(limits, name, 10**6)


def _schema(i: int) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}


def _alive(pid: int) -> bool:
    """The process exists (a zombie counts: it must have been reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_until_dead(pid: int, timeout: float = 5.0) -> None:
    """Wait until ``pid`` has exited, all its threads included (WNOWAIT: its Popen still reaps it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still runs")


@pytest.mark.parametrize("kwargs, field", [
    ({"json_schema": ref_chain(3000)}, "json_schema"),  # overflowed the host's stack before limits.py
    ({"grammar": rule_chain(3000)}, "grammar"),
])
def test_a_real_crash_costs_one_request(compiler, lifted_limits, kwargs, field):
    guard = compiler.guard()
    before = guard.call(os.getpid)  # the child the next job goes to (the idle one used last)
    crashes = guard.crashes
    with pytest.raises(InvalidRequestError, match=f"^{field}: the grammar engine crashed compiling it") as exc:
        compiler.compile_params(SamplingParams(**kwargs))
    assert exc.value.field == field and guard.crashes == crashes + 1
    assert not _alive(before) and before not in guard.children()  # killed and reaped
    children = guard.children()
    with pytest.raises(InvalidRequestError, match="crashed"):  # the same source again: refused at once
        compiler.compile_params(SamplingParams(**kwargs))
    assert guard.crashes == crashes + 1 and guard.children() == children
    template = compiler.compile_params(SamplingParams(json_schema=_schema(len(kwargs[field]))))
    assert template is not None and guard.children() and before not in guard.children()


def test_injected_crash_and_hang_are_400s_and_the_child_is_replaced(compiler, monkeypatch):
    guard = compiler.guard()
    first = guard.call(os.getpid)
    with pytest.raises(InvalidRequestError, match="^json_schema: the grammar engine crashed compiling it; the "
                                                  "request was refused$"):
        guard.call(signal.raise_signal, signal.SIGSEGV, field="json_schema")
    assert not _alive(first)
    second = guard.call(os.getpid)
    assert second != first  # a fresh child
    monkeypatch.setattr(guard, "time_limit", 0.5)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="^regex: the grammar engine took longer than 0.5 s"):
        guard.call(time.sleep, 3600, field="regex")
    assert time.monotonic() - start < 5 and not _alive(second) and guard.timeouts >= 1
    template = compiler.compile_params(SamplingParams(regex="[0-9]{2}-x"))
    assert template.new_state().accept(compiler.hf_tokenizer.convert_tokens_to_ids("1"))


def test_compile_errors_are_the_hosts_and_a_child_killed_while_idle_is_not_blamed(compiler):
    guard = compiler.guard()
    with pytest.raises(InvalidRequestError, match=r"^regex: .*invalid regex") as exc:
        compiler.compile_params(SamplingParams(regex="[0-9"))
    assert exc.value.field == "regex"
    pid = guard.call(os.getpid)
    crashes = guard.crashes
    os.kill(pid, signal.SIGKILL)  # from outside, between jobs
    _wait_until_dead(pid)
    assert compiler.compile_params(SamplingParams(regex="[a-c]{3}")) is not None
    assert guard.crashes == crashes and pid not in guard.children() and not _alive(pid)


def test_concurrent_misses_share_a_few_children(compiler):
    errors: list[BaseException] = []

    def compile_some(offset: int) -> None:
        try:
            for i in range(5):
                compiler.compile_params(SamplingParams(json_schema=_schema(100 + offset * 10 + i)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=compile_some, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert 1 <= len(compiler.guard().children()) <= compile_guard.MAX_CHILDREN


def test_off_switch_and_a_host_that_cannot_start_children(tokenizer_dir, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_GUARD", "0")
    off = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert off.guard() is None and off.compile_params(SamplingParams(json_schema=SCHEMA)) is not None
    monkeypatch.delenv("ASYNCLLM_GRAMMAR_GUARD")
    monkeypatch.setattr(compile_guard, "_CHILD_SCRIPT", "/nonexistent/compile_child.py")
    broken = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert broken.compile_params(SamplingParams(json_schema=SCHEMA)) is not None  # compiled here instead
    assert "could not start" in broken.guard().disabled and broken.guard().children() == []
    broken.close()


def test_close_and_garbage_collection_leave_no_process_or_socket(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    fds = len(os.listdir("/proc/self/fd"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], guard=True)
    compiler.compile_params(SamplingParams(json_schema=SCHEMA))
    pids = compiler.guard().children()
    assert pids and all(map(_alive, pids))
    compiler.close()
    assert not any(map(_alive, pids)) and multiprocessing.active_children() == []
    compiler.compile_params(SamplingParams(json_schema=_schema(7)))  # after close() a miss starts anew
    pids = compiler.guard().children()
    del compiler
    gc.collect()  # dropped without close(): its finalizer stops the children
    assert pids and not any(map(_alive, pids))
    assert len(os.listdir("/proc/self/fd")) <= fds


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    yield llm
    llm.close()
    llm.inputs.grammars.close()


def test_server_answers_a_crashing_schema_with_a_400_and_keeps_serving(llm, lifted_limits):
    app = create_app(llm)
    body = {"messages": CHAT, "max_tokens": 40, "temperature": 0}
    crash = request(app, "POST", "/v1/chat/completions", json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}})
    error = assert_error(crash, 400, "response_format")
    assert "crashed compiling it" in error["message"], error
    ok = request(app, "POST", "/v1/chat/completions", json={**body, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
    assert ok.status_code == 200, ok.text
    jsonschema.validate(json.loads(ok.json()["choices"][0]["message"]["content"]), SCHEMA)
    assert llm.inputs.grammars.guard().crashes == 1 and llm.stats()["num_running"] == 0


def _exhausting_template(compiler: GrammarCompiler) -> None:
    """Put a matcher with a small lexer-state limit in the cache for EXHAUSTING_REGEX: the same
    llguidance limit that ends a real runaway grammar (defaults: 250,000 states), reached sooner."""
    grammar = llguidance.LLMatcher.grammar_from_regex(EXHAUSTING_REGEX)
    matcher = llguidance.LLMatcher(compiler.ll_tokenizer(), grammar, log_level=0, limits=llguidance.LLParserLimits(
        max_lexer_states=40, precompute_large_lexemes=False))
    assert not matcher.is_error()
    compiler._cache[("regex", EXHAUSTING_REGEX)] = GrammarTemplate(matcher, grammar)


def test_a_matcher_that_gives_up_mid_generation_fails_the_request(llm):
    _exhausting_template(llm.inputs.grammars)
    app = create_app(llm)
    body = {"messages": CHAT, "max_tokens": 100, "temperature": 1.0, "seed": 3, "guided_regex": EXHAUSTING_REGEX}
    error = assert_error(request(app, "POST", "/v1/chat/completions", json=body), 400)
    assert error["param"] in ("regex", "guided_regex"), error  # (the field, or the request parameter it came from)
    assert "gave up on it during generation (lexer error: too many states" in error["message"], error
    _exhausting_template(llm.inputs.grammars)  # (clones share the lexer: the used one gives up at once)
    stream = request(app, "POST", "/v1/chat/completions", json={**body, "stream": True})
    assert stream.status_code == 200 and "gave up on it during generation" in stream.text
    assert '"finish_reason":"stop"' not in stream.text.replace(" ", "")
    assert request(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 8,
                                                               "guided_regex": "[0-9]{3}"}).status_code == 200
    assert llm.stats()["num_running"] == 0


def test_llm_raises_for_a_matcher_that_gives_up(model_dirs):
    with LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256) as llm:
        _exhausting_template(llm.inputs.grammars)
        for n in (1, 3):  # with n > 1, the request's other sequences end with it
            _exhausting_template(llm.inputs.grammars)
            with pytest.raises(InvalidRequestError, match="^regex: the grammar engine gave up") as exc:
                llm.generate(["Hello"], SamplingParams(n=n, temperature=1.0, seed=n, max_tokens=100,
                                                       regex=EXHAUSTING_REGEX))
            assert exc.value.field == "regex"
        (ok,) = llm.generate(["Hello"], SamplingParams(max_tokens=8, regex="[0-9]{3}"))
        assert len(ok.outputs[0].text) == 3 and ok.outputs[0].text.isdigit()
        llm.inputs.grammars.close()


def test_a_worn_grammar_is_compiled_afresh_for_the_next_request(model_dirs):
    """Clones share llguidance's lexer: the request that wore it out fails, the next one gets a new compile."""
    with LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256) as llm:
        compiler = llm.inputs.grammars
        _exhausting_template(compiler)
        worn = compiler._cache[("regex", EXHAUSTING_REGEX)]
        with pytest.raises(InvalidRequestError, match="gave up"):
            llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=1, max_tokens=100, regex=EXHAUSTING_REGEX))
        assert worn.worn
        (out,) = llm.generate(["Hello"], SamplingParams(temperature=1.0, seed=1, max_tokens=100, regex=EXHAUSTING_REGEX))
        fresh = compiler._cache[("regex", EXHAUSTING_REGEX)]
        assert fresh is not worn and not fresh.worn
        assert out.outputs[0].text.isalpha() and out.outputs[0].text.islower()
