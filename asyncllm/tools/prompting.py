"""Putting tools into the prompt, and choosing the tool-call format of a model.

Templates that know tools (Qwen2.5/3, Llama 3.1+, Mistral, Hermes) render ``tools`` and the
``tool_calls`` of earlier assistant turns themselves. Many templates do not (plain ChatML, for
one): their output would silently lack the tool definitions. So each template is probed once
(does a tool's name reach the prompt? does a call's?) and, where it ignores them, the request's
messages are rewritten before rendering: the format's instructions with the tool definitions go
into the system message (prepended to an existing one), earlier calls become assistant text in
the format the parser reads, and tool results are wrapped as the format expects.
"""

from __future__ import annotations

import json
from typing import Any

from .formats import PARSERS
from .parser_base import ToolParser

_PROBE = "asyncllm_probe_fn_7f3a"
_PROBE_TOOL = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_template_support: dict[str, tuple[bool, bool]] = {}  # chat template -> (renders tools, renders tool_calls)


def parser_class(name: str) -> type[ToolParser]:
    from ..errors import InvalidRequestError

    try:
        return PARSERS[name]
    except KeyError:
        raise InvalidRequestError(f"tool_parser: unknown format {name!r} (known: {', '.join(sorted(PARSERS))})",
                                  field="tool_parser") from None


def detect_tool_parser(tokenizer, model_type: str | None = None) -> str:
    """The format a model family writes: a vocabulary with ``[TOOL_CALLS]`` is Mistral's, one with
    ``<|python_tag|>`` Llama 3's JSON; everything else (Qwen, Hermes, ChatML models) hermes."""
    vocab = tokenizer.get_vocab()
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<|python_tag|>" in vocab or (model_type == "llama" and "<|eom_id|>" in vocab):
        return "llama3_json"
    return "hermes"


def template_support(tokenizer) -> tuple[bool, bool]:
    """(renders ``tools``, renders assistant ``tool_calls``) for this tokenizer's chat template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True, default=str)
    if template not in _template_support:
        user = {"role": "user", "content": "hi"}
        call = {"role": "assistant", "content": "",
                "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}
        _template_support[template] = (_renders(tokenizer, [user], [_PROBE_TOOL]),
                                       _renders(tokenizer, [user, call], None))
    return _template_support[template]


def _renders(tokenizer, messages: list[dict], tools: list | None) -> bool:
    from ..frontend.chat_template import render_chat_template  # the sandbox, bounded as every rendering is

    try:
        text = render_chat_template(tokenizer, messages, tools, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that chokes on the probe (or passes a bound) does not render it
        return False
    return _PROBE in text


def prepare_messages(messages: list[dict[str, Any]], tools: list[dict] | None, tokenizer,
                     parser: str) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """Messages and ``tools`` ready for ``apply_chat_template`` (see the module doc)."""
    messages = [_with_dict_arguments(m) for m in messages]
    has_calls = any(m.get("tool_calls") for m in messages)
    if not tools and not has_calls:
        return messages, tools
    renders_tools, renders_calls = template_support(tokenizer)
    fmt = parser_class(parser)
    if has_calls and not renders_calls:
        messages = [_history_as_text(m, fmt) for m in messages]
    if tools and not renders_tools:
        messages = _with_instructions(messages, fmt.instructions(tools))
        tools = None
    return messages, tools


def _with_dict_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends a call's arguments as a JSON string; templates expect a mapping (as vLLM does)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except (ValueError, RecursionError):  # not JSON (or nested past the decoder): kept as the text
                pass
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def _history_as_text(message: dict[str, Any], fmt: type[ToolParser]) -> dict[str, Any]:
    if message.get("role") == "assistant" and message.get("tool_calls"):
        calls = [((c.get("function") or {}).get("name"), (c.get("function") or {}).get("arguments", {}))
                 for c in message["tool_calls"]]
        text = "\n".join(part for part in (message.get("content") or "", fmt.render_calls(calls)) if part)
        return {k: v for k, v in message.items() if k != "tool_calls"} | {"content": text}
    if message.get("role") == "tool":
        return {**message, "content": fmt.render_tool_result(str(message.get("content") or ""))}
    return message


def _with_instructions(messages: list[dict[str, Any]], instructions: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") in ("system", "developer"):
        first = messages[0]
        content = f"{first.get('content') or ''}\n\n{instructions}".lstrip()
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": instructions}, *messages]
