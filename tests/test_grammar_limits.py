"""Grammar sources that would overflow the grammar engine's native stack are 400s, and the host lives.

A ``$ref`` chain through 1,000 definitions or 3,000 Lark rules each naming the next crashed the
process (SIGSEGV) inside the native compiler; nesting 5,000 levels deep raised RecursionError (a
500). Each is measured before compilation (asyncllm/structured/limits.py) and refused with the field
named; the next ordinary request is served and no sequence is left running.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from asyncllm import AsyncLLM
from asyncllm.errors import InvalidRequestError
from asyncllm.server import create_app
from asyncllm.structured.limits import MAX_REF_CHAIN, MAX_RULE_CHAIN, check_lark, check_schema, longest_chain
from server_helpers import request

CHAT = [{"role": "user", "content": "Hello"}]


def ref_chain(links: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def rule_chain(rules: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} | "x{i}"' for i in range(rules)) + f'\nr{rules}: "end"\n'


def nested(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    yield llm
    llm.close()


def test_bounds_are_exact():
    check_schema(ref_chain(MAX_REF_CHAIN - 1), "json_schema")  # MAX_REF_CHAIN links: allowed
    with pytest.raises(InvalidRequestError, match=r"json_schema: the chain of \$ref links"):
        check_schema(ref_chain(MAX_REF_CHAIN), "json_schema")
    check_lark(rule_chain(MAX_RULE_CHAIN - 2), "grammar")
    with pytest.raises(InvalidRequestError, match="grammar: the chain of rules"):
        check_lark(rule_chain(MAX_RULE_CHAIN), "grammar")


def test_recursion_and_names_in_literals_are_not_chains():
    tree = {"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array",
                                                                         "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    check_schema(tree, "json_schema")
    # rule names inside strings, regexes and comments are not references
    words = " ".join(f"r{i}" for i in range(500))
    check_lark(f'start: "{words}" | /{words}/ // {words}\n', "grammar")


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(0, 30), st.lists(st.integers(0, 30), max_size=4), max_size=30))
def test_longest_chain_equals_brute_force_on_acyclic_graphs(graph):
    edges = {str(k): [str(v) for v in vs if v > k and v in graph] for k, vs in graph.items()}  # acyclic

    def brute(node):
        return 1 + max((brute(n) for n in edges[node]), default=0)

    assert longest_chain(edges, lambda n: edges[n], list(edges)) == max(map(brute, edges), default=0)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": ref_chain(1000)}}}, "response_format"),
    ("/v1/chat/completions", {"guided_grammar": rule_chain(1500)}, "guided_grammar"),
    ("/v1/chat/completions", {"guided_json": nested(5000)}, "guided_json"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x", "schema": ref_chain(1000)}}}, "text"),
])
def test_hostile_grammars_are_400s_and_the_host_lives(llm, path, body, field):
    app = create_app(llm)
    payload = {"input": "Hello"} if path == "/v1/responses" else {"messages": CHAT}
    response = request(app, "POST", path, json={**payload, "max_tokens" if "chat" in path else "max_output_tokens": 4,
                                                **body})
    assert response.status_code == 400, response.text
    assert json.dumps(response.json()["error"]).count("deep") or "nested" in response.text
    ok = request(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert ok.status_code == 200
    assert llm.stats()["num_running"] == 0


@pytest.mark.parametrize("key", ["²", "٣", "9" * 5000, "1e3", ""])
def test_odd_logit_bias_keys_are_400s(llm, key):
    app = create_app(llm)
    response = request(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                                  "logit_bias": {key: 1}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias", response.text
    assert request(app, "POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2,
                                                               "logit_bias": {"7": 1}}).status_code == 200
