"""Validating a request's ``tools`` and ``tool_choice`` (OpenAI's shapes) into a ToolContext."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError

_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolFunction:
    """One function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: dict(_NO_PARAMETERS))


@dataclass
class ToolContext:
    """A request's tool settings, resolved; the front keeps it on the EngineRequest.

    ``choice`` is "none" (tools shown, nothing parsed), "auto" (calls parsed from free text),
    "required" (at least one call, forced by grammar) or "function" (``forced`` is called).
    """

    tools: list[dict[str, Any]]
    functions: list[ToolFunction]
    choice: str = "auto"
    forced: str | None = None
    parallel: bool = True
    parser: str = "hermes"

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    @property
    def forces_call(self) -> bool:
        return self.choice in ("required", "function")

    def forced_functions(self) -> list[ToolFunction]:
        if self.choice == "function":
            return [f for f in self.functions if f.name == self.forced]
        return self.functions


def _fail(field_name: str, message: str) -> None:
    raise InvalidRequestError(f"{field_name}: {message}", field=field_name)


def parse_tools(tools: Any) -> list[ToolFunction]:
    """OpenAI's ``tools`` list (``{"type": "function", "function": {...}}`` items) as ToolFunctions."""
    if not isinstance(tools, (list, tuple)) or not tools:
        _fail("tools", "expected a non-empty list of tools")
    functions: list[ToolFunction] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            _fail("tools", f"tools[{i}]: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        spec = tool.get("function")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            _fail("tools", f"tools[{i}]: 'function' needs a non-empty 'name'")
        parameters = spec.get("parameters")
        if parameters is None:
            parameters = dict(_NO_PARAMETERS)  # OpenAI: no parameters means an empty parameter list
        elif not isinstance(parameters, dict):
            _fail("tools", f"tools[{i}]: 'parameters' must be a JSON schema object")
        functions.append(ToolFunction(spec["name"], spec.get("description"), parameters))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        _fail("tools", "function names must be unique")
    return functions


def build_tool_context(tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                       parser: str = "hermes") -> ToolContext | None:
    """Validate ``tools``/``tool_choice``; None when the request has no tools."""
    if tools is None:
        if tool_choice not in (None, "none"):
            _fail("tool_choice", "only allowed when tools are given")
        return None
    functions = parse_tools(tools)
    choice, forced = _parse_choice(tool_choice, functions)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        _fail("parallel_tool_calls", "expected a boolean")
    return ToolContext(list(tools), functions, choice, forced, parallel_tool_calls is not False, parser)


def _parse_choice(tool_choice: Any, functions: list[ToolFunction]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            _fail("tool_choice", f"expected 'none', 'auto', 'required' or a named function, got {tool_choice!r}")
        return tool_choice, None
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type", "function") == "function":
        spec = tool_choice.get("function")
        name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str):
        _fail("tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}")
    if name not in {f.name for f in functions}:
        _fail("tool_choice", f"function {name!r} is not in tools")
    return "function", name
