"""The tool-call formats: hermes/Qwen, Llama 3.x JSON and Mistral.

Each format is a :class:`~asyncllm.tools.parser_base.ToolParser` subclass that also knows how to
*write* its calls: the grammar that forces a call (``tool_choice`` "required" or a named
function), the instructions put in the prompt when the chat template ignores ``tools``, and a call
rendered as assistant text for templates that ignore ``tool_calls`` in the history.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from ..structured.schema import lark_json, lark_literal
from .parser_base import CALL_START, ToolParser
from .spec import ToolFunction

MAX_PARALLEL_CALLS = 8  # a forced "required" answer holds at most this many calls (bounded for weak models)

TokenLookup = Callable[[str], "int | None"]  # a special token's id, or None if the tokenizer has none


def _call_schema(function: ToolFunction, arguments_key: str, arguments: Any) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": function.name}, arguments_key: arguments},
            "required": ["name", arguments_key], "additionalProperties": False}


def _body_rule(functions: list[ToolFunction], arguments_key: str) -> str:
    definitions: dict[str, Any] = {}
    schemas = [_call_schema(f, arguments_key, _rebased(f.parameters, f"f{i}_", definitions))
               for i, f in enumerate(functions)]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if definitions:
        schema = {**schema, "$defs": definitions}
    return "body: " + lark_json(schema) + "\n"


def _rebased(parameters: Any, prefix: str, definitions: dict[str, Any]) -> Any:
    """``parameters`` ready to sit under the call's ``arguments``, its references still valid.

    A schema's ``$ref``s point from its own root (``#/$defs/City``: pydantic writes every nested model
    so); nested in the call grammar they would point from the grammar's root and not resolve. So its
    ``$defs``/``definitions`` move to the grammar's root under ``prefix`` (functions cannot collide),
    and every local reference is rewritten: into those, or (``#``, ``#/properties/...``) into a copy
    of the parameters kept there too."""
    if not isinstance(parameters, dict):
        return parameters
    own = {}
    for key in ("$defs", "definitions"):
        if isinstance(parameters.get(key), dict):
            own.update({f"{key}/{name}": value for name, value in parameters[key].items()})
    body = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions") or not isinstance(v, dict)}
    uses_root = []

    def rewrite(ref: str) -> str:
        for key in ("$defs", "definitions"):
            if ref.startswith(f"#/{key}/"):
                name, _, rest = ref[len(key) + 3:].partition("/")
                return f"#/$defs/{prefix}{_def_name(key, name)}" + (f"/{rest}" if rest else "")
        uses_root.append(True)
        return f"#/$defs/{prefix}root" + ref[1:]

    body = _with_refs(body, rewrite)
    for qualified, value in own.items():
        key, name = qualified.split("/", 1)
        definitions[f"{prefix}{_def_name(key, name)}"] = _with_refs(value, rewrite)
    if uses_root:
        definitions[f"{prefix}root"] = body
    return body


def _def_name(key: str, name: str) -> str:
    # both spellings may hold the same name; JSON-pointer escapes (~0, ~1) stay as they are
    return name if key == "$defs" else f"definitions_{name}"


def _with_refs(value: Any, rewrite: Callable[[str], str]) -> Any:
    """A copy of ``value`` with every local ``$ref`` (``#...``) passed through ``rewrite`` (no recursion:
    schemas reach here after limits.check_nesting bounded only their size, not their depth)."""
    root: dict[str, Any] = {"v": None}
    stack: list[tuple[Any, Any, Any]] = [(value, root, "v")]
    while stack:
        node, parent, key = stack.pop()
        if isinstance(node, dict):
            copy: dict[str, Any] = dict.fromkeys(node)  # the keys' order is the properties' order
            parent[key] = copy
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                    copy[k] = rewrite(v)
                else:
                    stack.append((v, copy, k))
        elif isinstance(node, list):
            items: list[Any] = [None] * len(node)
            parent[key] = items
            stack.extend((v, items, i) for i, v in enumerate(node))
        else:
            parent[key] = node
    return root["v"]


def _literal(text: str, special_id: TokenLookup | None) -> str:
    """A marker in a Lark grammar: the special token itself if the tokenizer has it, else its text."""
    token = special_id(text) if special_id else None
    return f"<[{token}]>" if token is not None else lark_literal(text)


def _repeat(item: str, separator: str, parallel: bool) -> str:
    if not parallel:
        return item
    return f"{item} ({lark_literal(separator)} {item}){{0,{MAX_PARALLEL_CALLS - 1}}}"


def _tools_json(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    start = "<tool_call>"
    close = "</tool_call>"
    markers = ("<tool_call>", "</tool_call>")

    @classmethod
    def forced_grammar(cls, functions: list[ToolFunction], parallel: bool, special_id: TokenLookup | None = None) -> str:
        call = f"{_literal('<tool_call>', special_id)} \"\\n\" body \"\\n\" {_literal('</tool_call>', special_id)}"
        return f"start: {_repeat('call', chr(10), parallel)}\ncall: {call}\n" + _body_rule(functions, "arguments")

    @staticmethod
    def instructions(tools: list[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                f"{_tools_json(tools)}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    @staticmethod
    def render_calls(calls: list[tuple[str, Any]]) -> str:
        return "\n".join("<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                         + "\n</tool_call>" for name, args in calls)

    @staticmethod
    def render_tool_result(content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonParser(ToolParser):
    """Llama 3.1-3.3 JSON tool calling: the reply *is* ``{"name": ..., "parameters": {...}}``
    (several joined by ``; ``), optionally after ``<|python_tag|>``. A reply that starts otherwise
    is plain content."""

    name = "llama3_json"
    start = "<|python_tag|>"
    separator = ";"
    markers = ("<|python_tag|>",)

    def __init__(self) -> None:
        super().__init__()
        self._decided = False  # whether the reply's opening (a call or not) has been seen

    def _on_content(self, final: bool) -> bool:
        if self._decided:
            self._emit_content(self._buf)
            self._buf = ""
            return False
        head = self._buf.lstrip()
        if head.startswith("{") or head.startswith(self.start):
            self._buf = head[len(self.start):] if head.startswith(self.start) else head
            self._decided, self._state = True, CALL_START
            return True
        if not final and (not head or self.start.startswith(head)):
            return False  # still only whitespace, or maybe the start of <|python_tag|>
        self._decided = True
        return True

    @classmethod
    def forced_grammar(cls, functions: list[ToolFunction], parallel: bool, special_id: TokenLookup | None = None) -> str:
        return f"start: {_repeat('body', '; ', parallel)}\n" + _body_rule(functions, "parameters")

    @staticmethod
    def instructions(tools: list[dict[str, Any]]) -> str:
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                "its value}. Do not use variables.\n\n" + _tools_json(tools))

    @staticmethod
    def render_calls(calls: list[tuple[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls)

    @staticmethod
    def render_tool_result(content: str) -> str:
        return content


class MistralParser(ToolParser):
    """Mistral (v3 tokenizer format): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``."""

    name = "mistral"
    start = "[TOOL_CALLS]"
    list_open = "["
    separator = ","
    close = "]"
    markers = ("[TOOL_CALLS]",)

    @classmethod
    def forced_grammar(cls, functions: list[ToolFunction], parallel: bool, special_id: TokenLookup | None = None) -> str:
        calls = _repeat("body", ", ", parallel)
        return f"start: {_literal('[TOOL_CALLS]', special_id)} \"[\" {calls} \"]\"\n" + _body_rule(functions, "arguments")

    @staticmethod
    def instructions(tools: list[dict[str, Any]]) -> str:
        return ("You can call the following functions. To call one or more of them, answer with [TOOL_CALLS] "
                'followed by a JSON list: [TOOL_CALLS][{"name": <function-name>, "arguments": <args-json-object>}]'
                "\n\nFunctions:\n" + _tools_json(tools))

    @staticmethod
    def render_calls(calls: list[tuple[str, Any]]) -> str:
        return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args} for name, args in calls],
                                           ensure_ascii=False)

    @staticmethod
    def render_tool_result(content: str) -> str:
        return content


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser, "qwen": HermesParser,
    "llama3_json": Llama3JsonParser, "llama": Llama3JsonParser,
    "mistral": MistralParser,
}
