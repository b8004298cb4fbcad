"""Tool-call parsers on realistic texts: a stream split at every character boundary (and fed one
character at a time) gives the same content and calls as the whole-text parse."""

import json

import pytest

from asyncllm.tools import HermesParser, Llama3JsonParser, MistralParser, merge_fragments

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"query": "brace } and \\"quote\\" and [bracket]", "filters": {"tags": ["a", "b"], "n": 3}, "x": null}'

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    (HermesParser, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    (HermesParser, "Let me look that up for you.\n\n<tool_call>\n"
     f'{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n<tool_call>\n'
     f'{{"name": "search", "arguments": {NESTED}}}\n</tool_call>',
     "Let me look that up for you.", [("get_weather", WEATHER), ("search", NESTED)]),
    (HermesParser, '<tool_call>\n{"arguments": {"a": 1}, "name": "late_name"}\n</tool_call>\nDone, see above.',
     "Done, see above.", [("late_name", '{"a": 1}')]),
    (HermesParser, "No tools needed: 3 < 4 and <tool isn't a tag.\n", "No tools needed: 3 < 4 and <tool isn't a tag.\n",
     []),
    (HermesParser, '<tool_call>\n{"name": "f", "arguments": "{\\"k\\": 2}"}\n</tool_call>', "", [("f", '{"k": 2}')]),
    (HermesParser, '<tool_call>\n{"name": "no_args"}\n</tool_call>', "", [("no_args", "{}")]),
    (HermesParser, '<tool_call>\n{"name": "cut", "arguments": {"city": "Par', "", [("cut", '{"city": "Par')]),
    (HermesParser, '<tool_call>\n{"not_a_call": 1}\n</tool_call>', '{"not_a_call": 1}', []),
    (Llama3JsonParser, f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    (Llama3JsonParser, f'<|python_tag|>{{"name": "a", "parameters": {{}}}}; {{"name": "b", "parameters": {NESTED}}}',
     "", [("a", "{}"), ("b", NESTED)]),
    (Llama3JsonParser, '  The answer is {"name": "not a call"}.', '  The answer is {"name": "not a call"}.', []),
    (Llama3JsonParser, "<|python_ta", "<|python_ta", []),
    (MistralParser, f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]', "",
     [("get_weather", WEATHER)]),
    (MistralParser, f'Checking. [TOOL_CALLS] [{{"name": "a", "arguments": {NESTED}}}, {{"name": "b", "arguments": {{}}}}]',
     "Checking.", [("a", NESTED), ("b", "{}")]),
    (MistralParser, "Plain [TOOL answer with [brackets]", "Plain [TOOL answer with [brackets]", []),
]


def _calls(parser) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parser.calls]


def _streamed(cls, pieces: list[str]):
    parser, content, fragments = cls(), "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, fragments = content + text, fragments + new
    text, new = parser.finish()
    return parser, content + text, fragments + new


@pytest.mark.parametrize("cls, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_whole_text_parse(cls, text, content, calls):
    parser = cls()
    assert parser.parse(text) == (content, parser.calls)
    assert _calls(parser) == calls
    for name, arguments in calls:
        if arguments.startswith("{") and not name == "cut":
            json.loads(arguments)


@pytest.mark.parametrize("cls, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_every_split_gives_the_same_result(cls, text, content, calls):
    for cut in range(len(text) + 1):
        parser, got, fragments = _streamed(cls, [text[:cut], text[cut:]])
        assert (got, _calls(parser)) == (content, calls), cut
        rebuilt = []
        merge_fragments(rebuilt, fragments)  # the fragments alone rebuild the calls
        assert [(c.name, c.arguments) for c in rebuilt] == calls
    parser, got, fragments = _streamed(cls, list(text))  # one character at a time
    assert (got, _calls(parser)) == (content, calls)


@pytest.mark.parametrize("cls, text, content, calls", CASES[:3], ids=["one", "two", "late-name"])
def test_fragments_follow_openai_order(cls, text, content, calls):
    """Per call: a first fragment with id and name (empty arguments), then argument pieces only."""
    _, _, fragments = _streamed(cls, list(text))
    seen: set[int] = set()
    for fragment in fragments:
        if fragment.index not in seen:
            assert fragment.id and fragment.name and fragment.arguments == ""
            seen.add(fragment.index)
        else:
            assert fragment.id is None and fragment.name is None and fragment.arguments
    assert sorted(seen) == list(range(len(calls)))


def test_content_before_a_call_streams_before_the_call_ends():
    parser = HermesParser()
    content, fragments = parser.feed("Sure, checking the weather. <tool_")
    assert content == "Sure, checking the weather." and not fragments  # "<tool_" may start a call: held
    content, fragments = parser.feed('call>\n{"name": "get_weather", "arguments": {"ci')
    assert content == "" and [f.name for f in fragments] == ["get_weather", None]
    assert fragments[1].arguments == '{"ci'
