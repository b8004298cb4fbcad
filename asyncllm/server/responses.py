"""``POST /v1/responses``: OpenAI's Responses API over the same engine as chat completions.

A request becomes a chat conversation: ``instructions`` as a system message, then the conversation
of ``previous_response_id`` (kept in a bounded in-memory store for the server's lifetime), then
``input`` (a text, or items: messages, earlier ``function_call`` items and ``function_call_output``
items). Function tools, ``tool_choice``, ``text.format`` (json_schema / json_object),
``max_output_tokens``, ``temperature`` and ``top_p`` map to the chat request's equivalents. The
answer's items: a ``reasoning`` item when the app has a reasoning parser and the model thought, a
``message`` with its ``output_text``, and a ``function_call`` item per tool call. Streamed, the
events follow OpenAI's sequence: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its deltas (``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.reasoning_text.delta``) and closing events, then
``response.completed`` (``status`` "incomplete" with ``incomplete_details.reason``
"max_output_tokens" when the length ran out).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from pydantic import Field, StringConstraints

from starlette.requests import Request
from starlette.responses import Response

from ..errors import InvalidRequestError
from ..outputs import RequestOutput
from .protocol import _Request
from .reasoning import ReasoningSplitter, split_reasoning
from .errors import APIError
from .serving import ServerContext, check_not_aborted, collect, open_streams, parse_body, sse_response

# previous_response_id works for this many most recent responses of the app
STORE_SIZE = 1024


class ResponsesRequest(_Request):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: bool = True
    # OpenAI's bounds: 16 pairs of strings, keys of at most 64 characters and values of at most 512
    metadata: Optional[Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                                      Annotated[str, StringConstraints(max_length=512)]],
                                 Field(max_length=16)]] = None
    user: Optional[str] = None  # accepted and ignored
    reasoning: Optional[dict[str, Any]] = None  # accepted; thinking is the model's and the template's affair

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"max_tokens": self.max_output_tokens}
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        fmt = (self.text or {}).get("format")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        if fmt is not None and forced:
            fmt = None  # a forced tool call writes no text: the text format applies to later turns
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
                raise InvalidRequestError("text.format: expected {'type': 'text' | 'json_schema' | 'json_object'}",
                                          field="text")
            if fmt["type"] == "json_object":
                kwargs["json_schema"] = {"type": "object"}
            elif fmt["type"] == "json_schema":
                if not isinstance(fmt.get("schema"), dict):
                    raise InvalidRequestError("text.format: json_schema needs a 'schema' object", field="text")
                kwargs["json_schema"] = fmt["schema"]
        if self.tool_choice is not None:
            kwargs["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = self.parallel_tool_calls
        return kwargs

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """Responses' function tools in the chat format (other tool types are refused by name)."""
        if not self.tools:
            return None
        tools = []
        for tool in self.tools:
            if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise InvalidRequestError(f"tools: only function tools with a name are supported, got "
                                          f"{tool.get('type')!r}", field="tools")
            function = {"name": tool["name"], "description": tool.get("description") or "",
                        "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
            tools.append({"type": "function", "function": function})
        return tools

    def param_for(self, field: str | None) -> str | None:
        return {"max_tokens": "max_output_tokens", "json_schema": "text", "prompt": "input",
                "messages": "input"}.get(field, field)


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise InvalidRequestError("tool_choice: expected 'none', 'auto', 'required' or "
                                  "{'type': 'function', 'name': ...}", field="tool_choice")
    return choice


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(f"input: a message's role must be user, system, developer or assistant, "
                                          f"got {role!r}", field="input")
            messages.append({"role": role, "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
                messages[-1]["tool_calls"].append(call)  # parallel calls of one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # the model's earlier thinking is not fed back
        else:
            raise InvalidRequestError(f"input: item type {kind!r} is not supported", field="input")
    if not messages:
        raise InvalidRequestError("input: must not be empty", field="input")
    return messages


def _text_of(content: Any) -> str | list[dict[str, Any]]:
    """A message's content as chat content: its text, or with ``input_image`` parts a list of chat parts
    (text and ``image_url``) for a vision-language model."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "input_image":
                url = part.get("image_url")
                if not isinstance(url, str) or not url:
                    raise InvalidRequestError("input: an input_image part needs an image_url (a data: or http(s) "
                                              "URL; file_id is not supported)", field="input")
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind in ("input_text", "output_text", "text"):
                parts.append({"type": "text", "text": part.get("text", "")})
            else:
                raise InvalidRequestError("input: only text and input_image content parts are supported",
                                          field="input")
        if any(p["type"] == "image_url" for p in parts):
            return parts
        return "\n".join(p["text"] for p in parts)
    raise InvalidRequestError("input: a message's content must be a string or a list of text parts", field="input")


class ResponseStore:
    """Recent stored responses, each with the conversation behind it (bounded: the least recently used goes
    first), so that ``previous_response_id`` and ``GET /v1/responses/{id}`` agree on what is kept."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()  # answers are finished in response threads

    def get(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation of a stored response (for ``previous_response_id``)."""
        item = self._lookup(response_id)
        if item is None:
            raise InvalidRequestError(f"previous_response_id: no response {response_id!r} is stored (this server "
                                      f"keeps its last {self.size})", field="previous_response_id")
        return list(item[0])

    def response(self, response_id: str) -> dict[str, Any] | None:
        """The stored response object itself, or None."""
        item = self._lookup(response_id)
        return None if item is None else item[1]

    def _lookup(self, response_id: str):
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
        with self._lock:
            self._items[response_id] = (messages, response)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


async def retrieve_response(ctx: ServerContext, request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a response created with ``store`` (the default), while kept."""
    response_id = request.path_params["response_id"]
    stored = ctx.responses.response(response_id)
    if stored is None:
        raise APIError(404, f"No response found with id '{response_id[:100]}' (this server keeps its last "
                       f"{ctx.responses.size} stored responses).", param="response_id", code="not_found")
    return await ctx.json_answer(lambda: stored)


async def create_response(ctx: ServerContext, request: Request) -> Response:
    body = await parse_body(request, ResponsesRequest)
    lora = ctx.resolve_model(body.model)
    history = ctx.responses.get(body.previous_response_id) if body.previous_response_id else []
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    conversation = history + input_messages(body)  # what previous_response_id will bring back
    messages = system + conversation
    kwargs = body.sampling_kwargs()
    response_id = f"resp_{uuid.uuid4().hex}"
    tools = body.chat_tools()
    streams = await open_streams(ctx, request, [messages], kwargs, request_id=response_id, lora=lora, tools=tools,
                                 param_for=body.param_for)
    builder = _Builder(ctx, body, response_id)
    if body.stream:
        return sse_response(builder.events(streams[0], conversation))
    (output,) = await collect(request, streams)
    return await ctx.json_answer(builder.whole, output, conversation)


class _Builder:
    """Builds the response object (whole, or as the stream of events) for one request."""

    def __init__(self, ctx: ServerContext, body: ResponsesRequest, response_id: str) -> None:
        self.ctx = ctx
        self.body = body
        self.id = response_id
        self.created = int(time.time())
        self.sequence = 0

    def skeleton(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        body = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": body.model or self.ctx.model_name, "output": output,
                "instructions": body.instructions, "previous_response_id": body.previous_response_id,
                "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
                "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
                "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
                "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
                "error": None, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "usage": usage}

    def whole(self, output: RequestOutput, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The non-streamed answer to ``output`` (built in a response thread)."""
        c = output.outputs[0]
        cached = output.metrics.num_cached_tokens if output.metrics else 0
        return self.finish(self.items(output), c.finish_reason, len(output.prompt_token_ids), len(c.token_ids),
                           cached, conversation)

    def items(self, output: RequestOutput) -> list[dict[str, Any]]:
        c = output.outputs[0]
        reasoning, text = (split_reasoning(self.ctx.reasoning_parser, c.text) if self.ctx.reasoning_parser
                           else ("", c.text))
        items = []
        if reasoning:
            items.append(_reasoning_item(f"rs_{self.id[5:]}", reasoning))
        if text or not c.tool_calls:
            items.append(_message_item(f"msg_{self.id[5:]}", text, "completed"))
        for i, call in enumerate(c.tool_calls or []):
            items.append(_call_item(f"fc_{self.id[5:]}_{i}", call.id, call.name, call.arguments, "completed"))
        if c.finish_reason == "length" and items:  # cut by max_output_tokens: the item being written is not done
            items[-1]["status"] = "incomplete"
        return items

    def finish(self, items: list[dict[str, Any]], reason: str | None, input_tokens: int, output_tokens: int,
               cached_tokens: int, conversation: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object; with ``store``, it is kept (``GET /v1/responses/{id}``) with the
        conversation and this answer for a later ``previous_response_id`` (text and calls, not reasoning)."""
        usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
                 "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": input_tokens + output_tokens}
        cut = reason == "length"
        response = self.skeleton("incomplete" if cut else "completed", items, usage,
                                 "max_output_tokens" if cut else None)
        if self.body.store:
            answer: dict[str, Any] = {"role": "assistant", "content": None}
            for item in items:
                if item["type"] == "message":
                    answer["content"] = item["content"][0]["text"] or None
                elif item["type"] == "function_call":
                    answer.setdefault("tool_calls", []).append(
                        {"id": item["call_id"], "type": "function",
                         "function": {"name": item["name"], "arguments": item["arguments"]}})
            self.ctx.responses.put(self.id, conversation + [answer], response)
        return response

    def event(self, kind: str, **fields: Any) -> tuple[str, str]:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    async def events(self, stream: AsyncIterator[RequestOutput], messages: list[dict[str, Any]]
                     ) -> AsyncIterator[tuple[str, str]]:
        yield self.event("response.created", response=self.skeleton("in_progress", []))
        yield self.event("response.in_progress", response=self.skeleton("in_progress", []))
        stream_state = _StreamState(self)
        final = None
        async for delta in stream:
            for event in stream_state.feed(delta):
                yield event
            if delta.finished:
                check_not_aborted(delta)
                final = delta
        for event in stream_state.close():
            yield event
        cached = final.metrics.num_cached_tokens if final is not None and final.metrics else 0
        response = self.finish(stream_state.items, stream_state.finish_reason,
                               len(final.prompt_token_ids) if final is not None else 0, stream_state.num_tokens,
                               cached, messages)
        yield self.event(f"response.{response['status']}", response=response)


class _StreamState:
    """The items of a streamed response as they open, grow and close."""

    def __init__(self, builder: _Builder) -> None:
        self.b = builder
        self.items: list[dict[str, Any]] = []
        self.splitter = ReasoningSplitter(builder.ctx.reasoning_parser) if builder.ctx.reasoning_parser else None
        self.reasoning: dict[str, Any] | None = None
        self.message: dict[str, Any] | None = None
        self.calls: dict[int, dict[str, Any]] = {}
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def feed(self, delta: RequestOutput) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        c = delta.outputs[0] if delta.outputs else None
        if c is None:
            return events
        self.num_tokens += len(c.token_ids)
        reasoning, text = ("", c.text)
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(c.text)
            if c.finish_reason is not None:
                more_reasoning, more_text = self.splitter.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        if reasoning:
            events += self._reasoning(reasoning)
        if text:
            events += self._close_reasoning() + self._text(text)
        for fragment in c.tool_calls or []:
            events += self._close_reasoning() + self._close_message() + self._call(fragment)
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
        return events

    def _reasoning(self, text: str) -> list[tuple[str, str]]:
        events = []
        if self.reasoning is None:
            self.reasoning = _reasoning_item(f"rs_{self.b.id[5:]}", "")
            self.items.append(self.reasoning)
            events.append(self.b.event("response.output_item.added", output_index=len(self.items) - 1,
                                       item=self.reasoning))
        self.reasoning["content"][0]["text"] += text
        events.append(self.b.event("response.reasoning_text.delta", item_id=self.reasoning["id"],
                                   output_index=self.items.index(self.reasoning), content_index=0, delta=text))
        return events

    def _close_reasoning(self) -> list[tuple[str, str]]:
        if self.reasoning is None or self.reasoning.get("status") == "completed":
            return []
        index = self.items.index(self.reasoning)
        self.reasoning["status"] = "completed"
        return [self.b.event("response.reasoning_text.done", item_id=self.reasoning["id"], output_index=index,
                             content_index=0, text=self.reasoning["content"][0]["text"]),
                self.b.event("response.output_item.done", output_index=index, item=self.reasoning)]

    def _text(self, text: str) -> list[tuple[str, str]]:
        events = []
        if self.message is None:
            self.message = _message_item(f"msg_{self.b.id[5:]}", "", "in_progress")
            self.items.append(self.message)
            index = len(self.items) - 1
            events.append(self.b.event("response.output_item.added", output_index=index,
                                       item={**self.message, "content": []}))
            events.append(self.b.event("response.content_part.added", item_id=self.message["id"],
                                       output_index=index, content_index=0,
                                       part={"type": "output_text", "text": "", "annotations": []}))
        if text:
            self.message["content"][0]["text"] += text
            events.append(self.b.event("response.output_text.delta", item_id=self.message["id"],
                                       output_index=self.items.index(self.message), content_index=0, delta=text))
        return events

    def _close_message(self, status: str = "completed") -> list[tuple[str, str]]:
        if self.message is None or self.message["status"] != "in_progress":
            return []
        index = self.items.index(self.message)
        self.message["status"] = status
        part = self.message["content"][0]
        return [self.b.event("response.output_text.done", item_id=self.message["id"], output_index=index,
                             content_index=0, text=part["text"]),
                self.b.event("response.content_part.done", item_id=self.message["id"], output_index=index,
                             content_index=0, part=part),
                self.b.event("response.output_item.done", output_index=index, item=self.message)]

    def _call(self, fragment) -> list[tuple[str, str]]:
        events = []
        item = self.calls.get(fragment.index)
        if item is None:
            item = _call_item(f"fc_{self.b.id[5:]}_{fragment.index}", fragment.id, fragment.name, "", "in_progress")
            self.calls[fragment.index] = item
            self.items.append(item)
            events.append(self.b.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if fragment.arguments:
            item["arguments"] += fragment.arguments
            events.append(self.b.event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.items.index(item), delta=fragment.arguments))
        return events

    def close(self) -> list[tuple[str, str]]:
        events = self._close_reasoning()
        if self.message is None and not self.calls:  # an empty answer is still a message
            events += self._text("")
        # cut by max_output_tokens: the item being written when it stopped is "incomplete", as OpenAI marks it
        cut = self.items[-1] if self.finish_reason == "length" and self.items else None
        events += self._close_message("incomplete" if cut is not None and cut is self.message else "completed")
        for item in self.calls.values():
            index = self.items.index(item)
            item["status"] = "incomplete" if item is cut else "completed"
            events.append(self.b.event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
            events.append(self.b.event("response.output_item.done", output_index=index, item=item))
        return events


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}
