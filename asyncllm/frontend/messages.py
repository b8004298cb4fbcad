"""Chat messages: one validation for the Python API and the server alike.

A message is a mapping with a ``role`` (system, developer, user, assistant, tool) and a ``content``
(text, a list of parts, or null: text parts, and for vision-language models image parts, OpenAI's
``{"type": "image_url", "image_url": {"url": ...}}`` or ``{"type": "image", "image": ...}`` with a
PIL image, bytes, a path or a URL); assistant turns may carry ``tool_calls`` (each
``{"id", "type": "function", "function": {"name", "arguments"}}``) and tool turns a
``tool_call_id``. Other keys pass through to the chat template untouched. Every string must be
encodable as UTF-8: a lone surrogate cannot be tokenized.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import InvalidRequestError
from .multimodal import IMAGE_PART
from .text import check_utf8

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str
    detail: Optional[str] = None


class ImageURLContentPart(_Strict):
    """OpenAI's image part: a data: URL, an http(s) URL or (where the operator allows it) a file."""

    type: Literal["image_url"]
    image_url: Union[ImageURL, str]

    @property
    def source(self) -> Any:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


class ImageContentPart(_Strict):
    """An image part of the Python API: a PIL image, bytes, a path or any URL ``image_url`` takes."""

    model_config = ConfigDict(strict=True, extra="allow", arbitrary_types_allowed=True)
    type: Literal["image"]
    image: Any = None

    @property
    def source(self) -> Any:
        return self.image


ContentPart = Annotated[Union[TextContentPart, ImageURLContentPart, ImageContentPart], Field(discriminator="type")]


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
    content: Union[str, list[ContentPart], None] = None
    tool_calls: Optional[list[ToolCallItem]] = None

    @field_validator("content")
    @classmethod
    def _encodable(cls, value):
        texts = [value] if isinstance(value, str) else [p.text for p in value or [] if isinstance(p, TextContentPart)]
        for text in texts:
            check_utf8(text, "content")
        return value

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined, absent fields dropped. With images,
        the content stays a list of ``{"type": "text", "text"}`` and ``{"type": "image", "image": source}``
        parts (frontend/multimodal.py takes the sources out before the template renders)."""
        message = self.model_dump(exclude_none=True)
        content = self.content
        if isinstance(content, list) and any(not isinstance(p, TextContentPart) for p in content):
            content = [{"type": "text", "text": p.text} if isinstance(p, TextContentPart)
                       else {"type": IMAGE_PART, "image": p.source} for p in content]
        elif isinstance(content, list):  # text parts are joined, as vLLM does
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
    errors = exc.errors(include_url=False, include_input=False)
    # a union reports one error per member: the deepest is the member the input meant (an image part's url)
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in readable_loc(first.get("loc", ())))
    return f"{path}: {first['msg']}"


def readable_loc(loc: tuple) -> list:
    """An error's location without pydantic's labels of union members (``str``, ``list[...]``, ``ImageURL``,
    a discriminator's tag): the path a client wrote."""
    parts: list = []
    for part in loc:
        if isinstance(part, str) and (part in _TYPE_LABELS or "[" in part or part[:1].isupper() or
                                      (parts and part == parts[-1])):
            continue
        parts.append(part)
    return parts


_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}
