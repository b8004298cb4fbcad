"""Chat messages: one validation for the Python API and the server alike.

A message is a mapping with a ``role`` (system, developer, user, assistant, tool) and a ``content``
(text, a list of text parts, or null); assistant turns may carry ``tool_calls`` (each
``{"id", "type": "function", "function": {"name", "arguments"}}``) and tool turns a
``tool_call_id``. Other keys pass through to the chat template untouched. Every string must be
encodable as UTF-8: a lone surrogate cannot be tokenized.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..errors import InvalidRequestError
from .text import check_utf8

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Strict):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallItem(_Strict):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """One input message; extra keys (name, tool_call_id, ...) are passed to the chat template."""

    role: Role
    content: Union[str, list[TextContentPart], None] = None
    tool_calls: Optional[list[ToolCallItem]] = None

    @field_validator("content")
    @classmethod
    def _encodable(cls, value):
        for text in ([value] if isinstance(value, str) else [p.text for p in value or []]):
            check_utf8(text, "content")
        return value

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined, absent fields dropped."""
        message = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list):  # text parts are joined, as vLLM does
            content = "\n".join(part.text for part in content)
        message["content"] = content or ""
        return message


def validate_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Messages from the Python API, checked as the server checks them; template-ready dicts.

    Raises InvalidRequestError naming the bad message and key (``messages[0].role: ...``)."""
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}]: expected a mapping, got {type(message).__name__}",
                                      field="messages")
        try:
            result.append(ChatMessage.model_validate(message).to_template_dict())
        except ValidationError as exc:
            raise InvalidRequestError(f"messages[{i}]{describe_error(exc)}", field="messages") from None
    return result


def describe_error(exc: ValidationError) -> str:
    """``.path.to.field: what is wrong`` for pydantic's first error (without echoing the value)."""
    first = exc.errors(include_url=False, include_input=False)[0]
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first.get("loc", ()))
    return f"{path}: {first['msg']}"
