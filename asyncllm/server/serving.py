"""What chat and text completions share: the app's context, starting streams, disconnects, SSE.

A request's streams are *primed* (their first delta awaited) before any HTTP status is sent, so
bad input becomes a 400 rather than an error event in a 200 stream. Until the answer starts,
the client's disconnect is watched explicitly; once an SSE stream runs, sse-starlette watches it.
Either way the request's generator is closed at once, which aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import anyio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import Response

from ..errors import AsyncLLMError
from ..gil import GILHandover
from ..outputs import RequestOutput
from ..tools import merge_fragments
from .errors import APIError, ClientDisconnected, from_engine_error, from_validation_error
from .limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BATCH_INPUTS, DEFAULT_MAX_BODY_BYTES, LARGE_BODY_BYTES,
                     check_body_structure)
from .metrics import ServerMetrics
from .protocol import UsageInfo
from .raw_json import RawJSON

if TYPE_CHECKING:
    from ..async_llm import AsyncLLM

T = TypeVar("T")
RESPOND_WORKERS = 4
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerContext:
    """Everything the routes of one app share."""

    llm: "AsyncLLM"
    model_name: str
    api_key: str | None
    metrics: ServerMetrics
    created: int
    lora_roots: tuple[Path, ...] = ()     # where /v1/load_lora_adapter may read from; () = disabled
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_batch_inputs: int = DEFAULT_MAX_BATCH_INPUTS  # prompts x n of /v1/completions, inputs of /v1/embeddings
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S    # a POST body must arrive within this (408 past it)
    reasoning_parser: str | None = None   # "qwen3" / "deepseek_r1": reasoning_content apart (reasoning.py)
    pooling: str | None = None            # /v1/embeddings: "last", "mean" or None (the model's default)
    responses: Any = None                 # /v1/responses: the ResponseStore behind previous_response_id
    # answers are built in threads of their own: the engine's input workers render chat templates and
    # compile grammars, and a burst of those must not hold up requests that have finished
    respond_pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        RESPOND_WORKERS, thread_name_prefix="asyncllm-respond"))

    async def json_answer(self, build: Callable[..., Any], *args: Any) -> Response:
        """``build(*args)`` (a pydantic model or plain data) as a JSON response, built and serialised in the
        response threads: n x logprobs x tokens of entries must not be assembled on the event loop."""
        def render() -> bytes:
            return json_bytes(build(*args))

        loop = asyncio.get_running_loop()
        return Response(await loop.run_in_executor(self.respond_pool, render), media_type="application/json")

    def resolve_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the base model); 404 if unknown."""
        if name is None or name == self.model_name:
            return None
        if name in self.llm.list_loras():
            return name
        raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_batch(self, count: int, param: str, n: int = 1) -> None:
        """A 400 when a batched request asks for more than ``max_batch_inputs`` engine sequences (one
        prompt's ``n`` alone is bounded by the engine's ``max_n``)."""
        if count > 1 and count * n > self.max_batch_inputs:
            what = f"{count} prompts x n={n}" if n != 1 else f"{count} inputs"
            raise APIError(400, f"{param}: {what} is more than the {self.max_batch_inputs} one request may ask "
                           "for; split the batch", param=param)


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


# Lists at least this long are serialised one item at a time (see json_bytes), handing the GIL over.
PIECEWISE_ITEMS = 16


def json_bytes(data: Any) -> bytes:
    """A response model (or plain data) as JSON. Every long list in it (2,048 choices or vectors, a prompt's
    logprobs) is serialised one item at a time: serialising all of it at once holds the GIL, and so the host's
    loop, for its whole length (a 2,000-token prompt's 20 logprobs each: ~110 ms; 64 choices: ~150 ms)."""
    return _json_text(data).encode()


def _json_text(value: Any) -> str:
    if isinstance(value, RawJSON):
        return str(value)
    if isinstance(value, BaseModel):
        long = {name: items for name, items in value.__dict__.items() if _written_apart(items)}
        if not long:
            return _dumps(value.model_dump(mode="json"))
        # each long field is first a placeholder no client text can contain, then its items
        placeholders = {name: f"asyncllm-{uuid.uuid4().hex}" for name in long}
        text = _dumps(value.model_copy(update=placeholders).model_dump(mode="json", warnings=False))
        for name, items in long.items():
            marker = f'"{placeholders[name]}"'
            if text.count(marker) != 1:  # (a field the model renames or hides: serialise it whole)
                return _dumps(value.model_dump(mode="json"))
            text = text.replace(marker, str(items) if isinstance(items, RawJSON) else _json_list(items))
        return text
    if _is_long(value):
        return _json_list(value)
    return _dumps(value)


def _written_apart(value: Any) -> bool:
    """A field serialised on its own: a long list, raw JSON, or models (which may hold either)."""
    return _is_long(value) or isinstance(value, RawJSON) or (
        isinstance(value, list) and bool(value) and isinstance(value[-1], BaseModel))


def _is_long(value: Any) -> bool:
    """A list worth serialising piecewise: long, and of containers (a vector of floats is one fast call)."""
    return isinstance(value, list) and len(value) >= PIECEWISE_ITEMS and \
        isinstance(value[-1], (BaseModel, dict, list))


def _json_list(items: list) -> str:
    pieces = []
    hand_over = GILHandover()  # (asyncllm/gil.py: the interpreter's own switching left the host's loop waiting)
    for item in items:
        pieces.append(_json_text(item))
        hand_over()
    return "[" + ",".join(pieces) + "]"


async def parse_body(request: Request, model: type[M]) -> M:
    """The request's JSON body validated into ``model``; a 400 naming the parameter otherwise.

    A large body is first measured (limits.check_body_structure: what it holds bounds the time the
    parser holds the GIL), then validated, both in a worker thread: the event loop is the host's."""
    body = await request.body()
    try:
        if len(body) < LARGE_BODY_BYTES:
            return model.model_validate_json(body)
        await anyio.to_thread.run_sync(check_body_structure, body)
        return await anyio.to_thread.run_sync(model.model_validate_json, body)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then cancel it: that aborts)."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finished_first = work.done()
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if not finished_first:
        raise ClientDisconnected()
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    # the body has been read already, so the next message is the disconnect (or nothing)
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def open_streams(ctx: ServerContext, request: Request, prompts: list[Any], kwargs: dict[str, Any], *,
                       request_id: str, lora: str | None, tools: list | None,
                       param_for: Callable[[str | None], str | None]) -> list[AsyncIterator[RequestOutput]]:
    """Submit one request per prompt and wait for each one's first delta (a 400 if one is refused)."""
    n = kwargs.get("n", 1)
    streams = []
    for i, prompt in enumerate(prompts):
        rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
        stream = ctx.llm.stream_outputs(prompt, lora=lora, request_id=rid, tools=tools, **kwargs)
        streams.append(ctx.metrics.track(stream, n, lora))
    try:
        return await until_disconnect(request, _prime_all(streams))
    except AsyncLLMError as exc:
        raise from_engine_error(exc, param_for) from None


# Streams started per turn of the event loop when a batch is submitted: each submission is front-side
# work on the loop (a short prompt is not worth a thread hop), so a batch of 2,048 is spread out.
PRIME_GROUP = 16


async def _prime_all(streams: list[AsyncIterator[T]]) -> list[AsyncIterator[T]]:
    tasks: list[asyncio.Future] = []
    try:
        for start in range(0, len(streams), PRIME_GROUP):
            tasks.extend(asyncio.ensure_future(stream.__anext__()) for stream in streams[start:start + PRIME_GROUP])
            if len(streams) > PRIME_GROUP:
                await asyncio.sleep(0)  # this group's submissions run before the next group starts
        firsts = await asyncio.gather(*tasks)
    except BaseException:  # one was refused, or the client left: abort all of them
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise
    return [_prepend(first, stream) for first, stream in zip(firsts, streams)]


async def _prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several streams as they come, tagged with their stream's position."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))  # bounded: a slow reader backs up the pumps

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item, None))
            await queue.put((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, None, exc))
        finally:
            await stream.aclose()

    tasks: list[asyncio.Task] = []

    async def start_pumps() -> None:  # each pump's first turn hands over a primed delta: start them in groups
        for start in range(0, len(streams), PRIME_GROUP):
            tasks.extend(asyncio.create_task(pump(i, streams[i])) for i in range(start, min(len(streams), start + PRIME_GROUP)))
            await asyncio.sleep(0)

    starter = asyncio.create_task(start_pumps())
    try:
        remaining = len(streams)
        while remaining:
            i, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        starter.cancel()
        await asyncio.gather(starter, return_exceptions=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def fold(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Add a delta to a cumulative output (deltas are fresh objects, so the first one is reused)."""
    if total is None:
        for c in delta.outputs:  # fragments become whole calls
            if c.tool_calls:
                c.tool_calls, fragments = [], c.tool_calls
                merge_fragments(c.tool_calls, fragments)
        return delta
    for acc, new in zip(total.outputs, delta.outputs):
        if new.tool_calls:
            acc.tool_calls = acc.tool_calls or []
            merge_fragments(acc.tool_calls, new.tool_calls)
        acc.text += new.text
        acc.token_ids += new.token_ids
        if new.logprobs is not None:
            acc.logprobs = (acc.logprobs or []) + new.logprobs
        acc.finish_reason = new.finish_reason or acc.finish_reason
        acc.stop_reason = new.stop_reason if new.finish_reason else acc.stop_reason
        acc.cumulative_logprob = new.cumulative_logprob
    total.prompt_logprobs = total.prompt_logprobs or delta.prompt_logprobs
    total.finished = delta.finished
    return total


async def collect(request: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Run every stream to its end (aborting all if the client leaves); final outputs in order."""
    async def run() -> list[RequestOutput]:
        totals: list[RequestOutput | None] = [None] * len(streams)
        async for i, delta in merged(streams):
            totals[i] = fold(totals[i], delta)
        return totals

    try:
        totals = await until_disconnect(request, run())
    except AsyncLLMError as exc:
        raise from_engine_error(exc) from None
    for total in totals:
        check_not_aborted(total)
    return totals


def check_not_aborted(output: RequestOutput) -> None:
    """An abort the client did not cause (the host closed the engine, or aborted the request)."""
    if any(c.finish_reason == "abort" for c in output.outputs):
        raise APIError(503, "the request was aborted by the server (shutting down or cancelled)",
                       code="request_aborted")


class UsageCounter:
    """Token usage of a (possibly batched, possibly streamed) request."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._seen: set[int] = set()

    def add(self, position: int, delta: RequestOutput) -> None:
        if position not in self._seen:
            self._seen.add(position)
            self.prompt_tokens += len(delta.prompt_token_ids)
        self.completion_tokens += sum(len(c.token_ids) for c in delta.outputs)

    def info(self) -> UsageInfo:
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                         total_tokens=self.prompt_tokens + self.completion_tokens)


def chunk_json(chunk: BaseModel, include_usage: bool) -> str:
    """A stream chunk; with ``include_usage`` every chunk carries ``"usage"`` (null but the last)."""
    data = chunk.model_dump(mode="json")
    if include_usage:
        data.setdefault("usage", None)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


# How long a stream open at server shutdown has to send its error event and [DONE] before the
# SSE library cancels it (well inside uvicorn's graceful-shutdown timeout).
SHUTDOWN_GRACE_S = 2.0


def sse_response(chunks: AsyncIterator[str | tuple[str, str]]) -> EventSourceResponse:
    """Stream JSON chunks as OpenAI does: ``data: {...}`` events, then ``data: [DONE]``.

    A failure after the status was sent becomes an error event; so does the server shutting down
    (sse-starlette sees uvicorn's exit signal and sets ``shutdown``), and the request is aborted.
    Either way the stream ends with ``[DONE]``, never a cut connection."""
    shutdown = anyio.Event()

    async def events() -> AsyncIterator[dict[str, str]]:
        try:
            async for data in until_shutdown(chunks, shutdown):
                # a (name, data) pair is a named event (the Responses API's "event: response.created")
                yield {"event": data[0], "data": data[1]} if isinstance(data, tuple) else {"data": data}
        except APIError as exc:  # the status is sent already: report it in the stream, as OpenAI does
            yield {"data": json.dumps(exc.body())}
        except AsyncLLMError as exc:
            yield {"data": json.dumps(from_engine_error(exc).body())}
        except ServerShuttingDown:
            yield {"data": json.dumps(APIError(503, "the server is shutting down; the request was aborted",
                                               code="server_shutdown").body())}
        finally:
            await chunks.aclose()
        yield {"data": "[DONE]"}

    return EventSourceResponse(events(), sep="\n", shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)


class ServerShuttingDown(Exception):
    """The ASGI server is stopping: open streams say so and end."""


async def until_shutdown(items: AsyncIterator[T], shutdown: anyio.Event) -> AsyncIterator[T]:
    """``items`` until they end, or raise ServerShuttingDown once ``shutdown`` is set."""
    stop = asyncio.ensure_future(shutdown.wait())
    step: asyncio.Future | None = None
    try:
        while True:
            step = asyncio.ensure_future(items.__anext__())
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                raise ServerShuttingDown()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            step = None
            yield item
    finally:
        # ``items`` must not be left running in a task (the caller closes it next): cancel and wait
        stop.cancel()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
