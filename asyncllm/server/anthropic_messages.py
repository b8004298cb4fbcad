"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A request becomes the chat messages and OpenAI-style tools chat.py hands the engine (system first,
``tool_use`` blocks as assistant ``tool_calls``, ``tool_result`` blocks as ``tool`` messages), so both
APIs render the same prompt. Answers and errors take Anthropic's shapes; a stream is Anthropic's named
SSE events, which, unlike OpenAI's, do not end with ``data: [DONE]``: hence its own writer here.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

import anyio
from pydantic import Field
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import AsyncLLMError
from ..frontend.prompts import ChatPrompt, chat_token_ids
from ..outputs import CompletionOutput, RequestOutput
from .errors import APIError, from_engine_error
from .protocol import _Request
from .serving import (SHUTDOWN_GRACE_S, ServerContext, ServerShuttingDown, UsageCounter, until_shutdown,
                      check_not_aborted, collect, merged, open_streams, parse_body)

# ---- errors -------------------------------------------------------------------------------------

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(exc: APIError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``: Anthropic's shape of an APIError."""
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    """The HTTP answer of an APIError raised in (or before) these routes; statuses as the OpenAI routes'."""
    return JSONResponse(error_body(exc), status_code=exc.status, headers=exc.headers)


# ---- requests -----------------------------------------------------------------------------------

class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ImageSource(_Request):
    type: Literal["base64", "url"]
    media_type: Optional[str] = None
    data: Optional[str] = None
    url: Optional[str] = None

    def as_url(self, field: str) -> str:
        """The source as an image URL (a data: URL for base64); ``field``: the block's path, for errors."""
        if self.type == "url":
            if not self.url:
                raise APIError(400, f"{field}.source.url: required for a url image source", param="messages")
            return self.url
        if not self.data or not self.media_type:
            raise APIError(400, f"{field}.source: a base64 image needs media_type and data", param="messages")
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Request):
    """An image for a vision-language model (base64 data or a URL the operator lets the server fetch)."""

    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: bool = False

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(block.text for block in content)
        # the chat message has no error flag: say so in its text, so the model still sees it
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(_Request):
    role: Literal["user", "assistant"]
    content: Union[str, list[ContentBlock]]


class Tool(_Request):
    name: str
    description: Optional[str] = None
    input_schema: dict[str, Any]
    type: Optional[Literal["custom"]] = None  # Anthropic's server tools (web search...) are not ours to run


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: what a prompt is made of."""

    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages, in the shape /v1/chat/completions takes them."""
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
                else message.content
            texts = [b.text for b in blocks if isinstance(b, TextBlock)]
            if message.role == "assistant":
                if any(isinstance(b, ToolResultBlock) for b in blocks):
                    raise APIError(400, f"messages[{i}]: tool_result blocks belong in user messages")
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                         for b in blocks if isinstance(b, ToolUseBlock)]
                entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
                if calls:
                    entry["tool_calls"] = calls
                out.append(entry)
                continue
            if any(isinstance(b, ToolUseBlock) for b in blocks):
                raise APIError(400, f"messages[{i}]: tool_use blocks belong in assistant messages")
            # the results answer the assistant turn just before: they come first, then the user's text
            out.extend({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                       for b in blocks if isinstance(b, ToolResultBlock))
            if any(isinstance(b, ImageBlock) for b in blocks):  # text and images in order, as chat parts
                out.append({"role": "user", "content": [
                    {"type": "text", "text": b.text} if isinstance(b, TextBlock)
                    else {"type": "image_url", "image_url": {"url": b.source.as_url(f"messages[{i}].content[{j}]")}}
                    for j, b in enumerate(blocks) if isinstance(b, (TextBlock, ImageBlock))]})
            elif texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "\n".join(texts)})
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as OpenAI function tools."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.tools]


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    metadata: Optional[dict[str, Any]] = None  # accepted and ignored
    stream: bool = False

    def sampling_kwargs(self) -> dict[str, Any]:
        """The engine's keywords; it validates the values (errors named through ``param_for``)."""
        kwargs: dict[str, Any] = {"max_tokens": self.max_tokens}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.stop_sequences:
            kwargs["stop"] = self.stop_sequences
        choice = self.tool_choice
        if choice is not None:
            if choice.type == "tool" and not choice.name:
                raise APIError(400, "tool_choice.name: required when tool_choice.type is 'tool'")
            kwargs["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                kwargs["parallel_tool_calls"] = False
        return kwargs

    @staticmethod
    def param_for(field: str | None) -> str | None:
        """The request parameter an engine field came from."""
        return {"stop": "stop_sequences", "prompt": "messages", "parallel_tool_calls": "tool_choice"}.get(field, field)


# ---- answers ------------------------------------------------------------------------------------

def stop_reason(c: CompletionOutput, body: MessagesRequest) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished choice."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.finish_reason == "tool_calls" or c.tool_calls:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in (body.stop_sequences or ()):
        return "stop_sequence", c.stop_reason
    return "end_turn", None  # EOS or a stop token


def _tool_input(arguments: str) -> dict[str, Any]:
    """Anthropic's ``input``: always an object, and one the answer can carry. The tool parser hands over
    the model's text as written; what is no JSON object, or one holding what strict JSON cannot
    (NaN, Infinity, a number past a double's range such as ``1e999``, a lone surrogate ``"\\ud800"``,
    nesting deeper than the encoder goes), is ``{}`` (a stream's partial_json still shows the text)."""
    try:
        value = json.loads(arguments or "{}", parse_constant=_not_json)
        probe = value
        for _ in range(8):  # nested as deep as the answer holds it, and then some
            probe = [probe]
        json.dumps(probe, ensure_ascii=False, allow_nan=False).encode()
    except (ValueError, RecursionError):  # (UnicodeEncodeError is a ValueError)
        return {}
    return value if isinstance(value, dict) else {}


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _tool_name(name: str | None) -> str | None:
    """A call's name, as the parser read it from a JSON string: a lone surrogate (``"\\ud800"``) cannot
    be sent as UTF-8 (the answer would fail, a stream would stop short), so it becomes U+FFFD, as
    undecodable bytes of the text do."""
    return _SURROGATE.sub("\ufffd", name) if name else name


def _message(body: MessagesRequest, request_id: str, model: str, output: RequestOutput) -> dict[str, Any]:
    usage = UsageCounter()
    usage.add(0, output)
    c = output.outputs[0]
    content: list[dict[str, Any]] = []
    if c.text.strip():  # (whitespace around a tool call is no block: Anthropic refuses those sent back)
        content.append({"type": "text", "text": c.text})
    content.extend({"type": "tool_use", "id": t.id, "name": _tool_name(t.name), "input": _tool_input(t.arguments)}
                   for t in c.tool_calls or [])
    reason, sequence = stop_reason(c, body)
    return {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}}


async def create_message(ctx: ServerContext, request: Request) -> Response:
    """Validate, submit one engine request, answer whole or as Anthropic's event stream."""
    body = await parse_body(request, MessagesRequest)
    lora = ctx.resolve_model(body.model)
    kwargs = body.sampling_kwargs()
    request_id = f"msg_{uuid.uuid4().hex}"
    streams = await open_streams(ctx, request, [ChatPrompt(body.chat_messages())], kwargs, request_id=request_id,
                                 lora=lora, tools=body.chat_tools(), param_for=body.param_for)
    model = body.model or ctx.model_name
    if body.stream:
        return _sse(_events(body, request_id, model, streams))
    (output,) = await collect(request, streams)
    return await ctx.json_answer(_message, body, request_id, model, output)


async def count_tokens(ctx: ServerContext, request: Request) -> Response:
    """``{"input_tokens": N}``: the prompt rendered as /tokenize renders chat messages."""
    body = await parse_body(request, CountTokensRequest)
    ctx.resolve_model(body.model)
    messages, tools = body.chat_messages(), body.chat_tools()

    def run() -> int:  # a chat template renders in the input worker threads, not on the host's loop
        return len(chat_token_ids(messages, ctx.llm.tokenizer, tools, getattr(ctx.llm, "tool_parser", "hermes"),
                                  getattr(getattr(ctx.llm, "inputs", None), "multimodal", None)))

    return JSONResponse({"input_tokens": await ctx.llm.offload(run)})


# ---- streams ------------------------------------------------------------------------------------

Event = tuple[str, dict[str, Any]]


async def _events(body: MessagesRequest, request_id: str, model: str,
                  streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[Event]:
    """message_start, each block's start / deltas / stop, then message_delta and message_stop."""
    usage = UsageCounter()
    index = -1
    open_kind: str | None = None  # "text" or "tool_use": the block deltas go to
    pending = ""  # leading whitespace: a text block opens only once it has something to show
    started = False
    async for position, delta in merged(streams):
        usage.add(position, delta)
        if not started:
            started = True
            yield "message_start", {"type": "message_start", "message": {
                "id": request_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": 0}}}
            yield "ping", {"type": "ping"}
        c = delta.outputs[0]
        if c.text:
            if open_kind != "text":
                pending += c.text
            if open_kind != "text" and pending.strip():
                if open_kind is not None:
                    yield "content_block_stop", {"type": "content_block_stop", "index": index}
                index, open_kind = index + 1, "text"
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": {"type": "text", "text": ""}}
                text, pending = pending, ""
            else:
                text = c.text if open_kind == "text" else ""
            if text:
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": text}}
        for fragment in c.tool_calls or []:
            if fragment.name is not None:  # a call's first fragment: its own block
                if open_kind is not None:
                    yield "content_block_stop", {"type": "content_block_stop", "index": index}
                index, open_kind, pending = index + 1, "tool_use", ""
                yield "content_block_start", {"type": "content_block_start", "index": index, "content_block": {
                    "type": "tool_use", "id": fragment.id, "name": _tool_name(fragment.name), "input": {}}}
            if fragment.arguments:
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "input_json_delta", "partial_json": fragment.arguments}}
        if c.finish_reason is not None:
            check_not_aborted(delta)
            if open_kind is not None:
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
            reason, sequence = stop_reason(c, body)
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": usage.completion_tokens}}
            yield "message_stop", {"type": "message_stop"}


def _sse(events: AsyncIterator[Event]) -> EventSourceResponse:
    """Named events; a failure after the status was sent (or the server stopping) is an ``error`` event."""
    shutdown = anyio.Event()

    async def frames() -> AsyncIterator[dict[str, str]]:
        try:
            async for name, data in until_shutdown(events, shutdown):
                yield {"event": name, "data": json.dumps(data, ensure_ascii=False, separators=(",", ":"))}
        except APIError as exc:
            yield {"event": "error", "data": json.dumps(error_body(exc))}
        except AsyncLLMError as exc:
            yield {"event": "error", "data": json.dumps(error_body(from_engine_error(exc)))}
        except ServerShuttingDown:
            yield {"event": "error", "data": json.dumps(error_body(
                APIError(503, "the server is shutting down; the request was aborted")))}
        finally:
            await events.aclose()

    return EventSourceResponse(frames(), sep="\n", shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)
