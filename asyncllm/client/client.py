"""``AsyncLLMClient``: ``AsyncLLM``'s methods, served by an engine elsewhere (httpx, SSE)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
import weakref
from typing import Any, AsyncIterator

import httpx

from ..errors import EngineDeadError, InvalidRequestError, RequestTimeoutError
from ..lora_request import LoRARequest
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .errors import error_from_event, error_from_status, retry_after
from .requests import request_body, route_for
from .responses import DeltaReader

RETRY_STATUSES = (429, 503)  # the engine is busy or restarting: worth asking again


class _Live:
    """A request being streamed: what ``abort`` needs to end it from elsewhere."""

    def __init__(self) -> None:
        self.response: httpx.Response | None = None
        self.aborted = False


class AsyncLLMClient:
    """The ``AsyncLLM`` API against a served engine: ``asyncllm serve``, its Ray Serve replicas, or (for
    the OpenAI-shaped subset) any OpenAI-compatible server.

    ``async with AsyncLLMClient("http://127.0.0.1:8000") as llm: async for piece in llm.stream(...)``.
    Requests stream over SSE on pooled connections; leaving a stream early closes its connection,
    which aborts the request on the server and frees its KV blocks. Errors are AsyncLLM's classes
    (docs/client.md). 429 and 503 answers, and connections refused, are retried ``max_retries``
    times, waiting as Retry-After says (at most ``max_retry_wait`` s) or backing off from 0.5 s.
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, model: str | None = None,
                 timeout: float | None = 600.0, connect_timeout: float = 10.0, max_retries: int = 2,
                 max_retry_wait: float = 30.0, max_connections: int = 256,
                 http_client: httpx.AsyncClient | None = None) -> None:
        """``base_url``: the server's root (``http://host:port``, or the mount path of the sub-app);
        ``model``: the ``model`` field sent (None: the server's own model); ``timeout``: seconds a read
        may wait (one SSE event, or a whole non-streamed answer); ``http_client``: one of your own
        (its base URL, headers and transport are used as they are; it is not closed for you)."""
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ValueError(f"max_retries must be a non-negative integer, got {max_retries!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries, self.max_retry_wait = max_retries, float(max_retry_wait)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout, connect=connect_timeout)
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._own_client = http_client
        # httpx's pools belong to the event loop that opened them: one client per loop, as AsyncLLM
        # serves several loops at once
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._live: dict[str, _Live] = {}
        self._closed = False

    # ---- AsyncLLM's generation API -------------------------------------------------------------
    async def stream(self, prompt: Any, params: SamplingParams | None = None, *, lora: Any = None,
                     request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                     parallel_tool_calls: bool | None = None, timeout: float | None = None, priority: int = 0,
                     **sampling_kwargs: Any) -> AsyncIterator[str]:
        """Yield the newly decoded text as it is generated, as ``AsyncLLM.stream``."""
        n = sampling_kwargs.get("n", params.n if params is not None else 1)
        if n != 1:
            raise InvalidRequestError("n: stream() yields one text; use stream_outputs() for n > 1", field="n")
        async for delta in self.stream_outputs(prompt, params, lora=lora, request_id=request_id, tools=tools,
                                               tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                                               timeout=timeout, priority=priority, **sampling_kwargs):
            if delta.outputs and delta.outputs[0].text:
                yield delta.outputs[0].text

    async def stream_outputs(self, prompt: Any, params: SamplingParams | None = None, *, lora: Any = None,
                             request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                             parallel_tool_calls: bool | None = None, timeout: float | None = None,
                             priority: int = 0, **sampling_kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs holding only what is new, as ``AsyncLLM.stream_outputs``."""
        async for _, delta in self._run(prompt, params, lora, request_id, (tools, tool_choice, parallel_tool_calls),
                                        sampling_kwargs, timeout, priority):
            yield delta

    async def generate(self, prompt: Any, params: SamplingParams | None = None, *, lora: Any = None,
                       request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                       parallel_tool_calls: bool | None = None, timeout: float | None = None, priority: int = 0,
                       **sampling_kwargs: Any) -> RequestOutput:
        """The whole output, as ``AsyncLLM.generate`` (with ``tools``: the parsed ``tool_calls``)."""
        reader = None
        async for reader, _ in self._run(prompt, params, lora, request_id, (tools, tool_choice, parallel_tool_calls),
                                         sampling_kwargs, timeout, priority):
            pass
        return reader.output()

    async def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                   **kwargs: Any) -> RequestOutput:
        """``generate`` on chat messages (rendered with the served model's chat template)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("prompt: chat() takes a non-empty list of messages", field="prompt")
        return await self.generate(list(messages), params, **kwargs)

    async def embed(self, prompt: Any, *, pooling: str | None = None, lora: Any = None,
                    request_id: str | None = None, timeout: float | None = None, priority: int = 0,
                    truncate_prompt_tokens: int | None = None) -> list[float]:
        """The prompt's embedding from ``/v1/embeddings``, as ``AsyncLLM.embed``."""
        output = await self.encode(prompt, pooling=pooling, lora=lora, request_id=request_id, timeout=timeout,
                                   priority=priority, truncate_prompt_tokens=truncate_prompt_tokens)
        return output.embedding

    async def encode(self, prompt: Any, *, pooling: str | None = None, lora: Any = None,
                     request_id: str | None = None, timeout: float | None = None, priority: int = 0,
                     truncate_prompt_tokens: int | None = None) -> RequestOutput:
        """``embed`` as a RequestOutput (``embedding``; ``prompt_token_ids`` only for a token-id prompt)."""
        body: dict[str, Any] = {"input": prompt}
        model = self._model_for(lora)
        if model is not None:
            body["model"] = model
        if pooling is not None:
            body["pooling"] = pooling
        if truncate_prompt_tokens is not None:
            body["truncate_prompt_tokens"] = truncate_prompt_tokens
        data = await self._json("POST", "/v1/embeddings", body, lora=lora is not None, timeout=timeout)
        rid = request_id or f"embd-{uuid.uuid4().hex}"
        ids = list(prompt) if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else []
        return RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids, [], finished=True,
                             embedding=data["data"][0]["embedding"])

    async def abort(self, request_id: str) -> None:
        """End a request this client streams (its connection is closed: the server aborts it and frees
        its blocks); its stream ends with finish_reason "abort". Unknown ids are ignored."""
        live = self._live.get(request_id)
        if live is not None:
            live.aborted = True
            if live.response is not None:
                await live.response.aclose()

    # ---- the engine's side routes ----------------------------------------------------------------
    async def stats(self) -> dict[str, int]:
        """The served engine's counters (``GET /stats``), as ``AsyncLLM.stats()``; a coroutine here."""
        return await self._json("GET", "/stats")

    async def check_health(self) -> None:
        """Return if the server's engine accepts work; raise EngineDeadError if not (or unreachable)."""
        await self._json("GET", "/health", expect_json=False)

    async def list_loras(self) -> list[str]:
        """Names of the served LoRA adapters (``GET /v1/models``); a coroutine here."""
        data = await self._json("GET", "/v1/models")
        return [card["id"] for card in data.get("data", []) if card.get("parent")]

    async def add_lora(self, name: str, path: str) -> None:
        """Load an adapter on the server (``/v1/load_lora_adapter``; the server must allow its directory)."""
        await self._json("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                         lora=True, expect_json=False)

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter on the server (``/v1/unload_lora_adapter``)."""
        await self._json("POST", "/v1/unload_lora_adapter", {"lora_name": name}, lora=True, expect_json=False)

    async def aclose(self) -> None:
        """Close this loop's connections (the others' go with their loops). Safe to call twice."""
        self._closed = True
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    async def __aenter__(self) -> "AsyncLLMClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    # ---- internals -------------------------------------------------------------------------------
    def _http(self) -> httpx.AsyncClient:
        if self._own_client is not None:
            return self._own_client
        if self._closed:
            raise EngineDeadError("this AsyncLLMClient was closed")
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout,
                                       limits=self._limits)
            self._clients[loop] = client
        return client

    def _model_for(self, lora: Any) -> str | None:
        if lora is None:
            return self.model
        if isinstance(lora, LoRARequest):
            return lora.name  # the server serves adapters by name (add_lora loads one there)
        if isinstance(lora, str) and lora:
            return lora
        raise InvalidRequestError(f"lora: expected an adapter name or a LoRARequest, got {type(lora).__name__}",
                                  field="lora")

    async def _run(self, prompt, params, lora, request_id, tool_args, sampling_kwargs, timeout, priority
                   ) -> AsyncIterator[tuple[DeltaReader, RequestOutput]]:
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise InvalidRequestError(f"timeout: expected a positive number of seconds, got {timeout!r}",
                                      field="timeout")
        tools, tool_choice, parallel_tool_calls = tool_args
        sp = SamplingParams.from_kwargs(params, sampling_kwargs).validate()  # AsyncLLM's checks, before any I/O
        route = route_for(prompt, tools)
        body = request_body(route, prompt, sp, model=self._model_for(lora), tools=tools, tool_choice=tool_choice,
                            parallel_tool_calls=parallel_tool_calls, priority=priority)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._live:
            raise InvalidRequestError(f"request_id: {rid!r} is already running", field="request_id")
        reader = DeltaReader(route, rid, prompt, sp.n, sp.logprobs, sp.prompt_logprobs)
        live = self._live[rid] = _Live()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            async with self._open_stream(route, body, lora is not None, live, deadline) as response:
                async for chunk in _sse_chunks(response, deadline, live):
                    if "error" in chunk and isinstance(chunk["error"], dict):
                        raise error_from_event(chunk["error"])
                    delta = reader.feed(chunk)
                    if delta is not None:
                        yield reader, delta
        except _Aborted:
            yield reader, reader.aborted()
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"request {rid}: ran past its timeout of {timeout} s and was aborted") from None
        finally:
            self._live.pop(rid, None)
        if not reader.finished:  # the server closed the stream before every output ended
            raise EngineDeadError(f"request {rid}: the server ended the stream before the request finished")

    @contextlib.asynccontextmanager
    async def _open_stream(self, route: str, body: dict, lora: bool, live: _Live, deadline: float | None):
        """The streaming response once its status is 200 (retrying 429/503 and refused connections)."""
        client = self._http()
        for attempt in range(self.max_retries + 1):
            request = client.build_request("POST", route, json=body)
            try:
                response = await _within(client.send(request, stream=True), deadline)
            except httpx.ConnectError as exc:
                if attempt == self.max_retries:
                    raise EngineDeadError(f"cannot reach the server at {self.base_url}: {exc}") from None
                await _within(asyncio.sleep(self._backoff(attempt, None)), deadline)
                continue
            except httpx.TransportError as exc:
                raise EngineDeadError(f"the connection to {self.base_url} failed: {exc}") from None
            if response.status_code == 200:
                break
            content = await response.aread()
            await response.aclose()
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await _within(asyncio.sleep(self._backoff(attempt, response.headers)), deadline)
                continue
            raise error_from_status(response.status_code, content, response.headers, lora)
        live.response = response
        if live.aborted:  # aborted while the request was being sent
            await response.aclose()
        try:
            yield response
        finally:
            await response.aclose()  # early exit, cancellation or abort: the server aborts the request

    def _backoff(self, attempt: int, headers: Any) -> float:
        wait = retry_after(headers)
        return min(self.max_retry_wait, wait if wait is not None else 0.5 * 2 ** attempt)

    async def _json(self, method: str, path: str, body: dict | None = None, *, lora: bool = False,
                    timeout: float | None = None, expect_json: bool = True) -> Any:
        """One non-streamed call with the same retries and error mapping as the streams."""
        client = self._http()
        deadline = None if timeout is None else time.monotonic() + timeout
        for attempt in range(self.max_retries + 1):
            try:
                response = await _within(client.request(method, path, json=body), deadline)
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"{method} {path}: ran past its timeout of {timeout} s") from None
            except httpx.ConnectError as exc:
                if attempt == self.max_retries:
                    raise EngineDeadError(f"cannot reach the server at {self.base_url}: {exc}") from None
                await asyncio.sleep(self._backoff(attempt, None))
                continue
            except httpx.TransportError as exc:
                raise EngineDeadError(f"the connection to {self.base_url} failed: {exc}") from None
            if response.status_code < 300:
                return response.json() if expect_json else None
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await asyncio.sleep(self._backoff(attempt, response.headers))
                continue
            raise error_from_status(response.status_code, response.content, response.headers, lora)


class _Aborted(Exception):
    """``abort()`` closed this request's stream."""


async def _within(awaitable, deadline: float | None):
    """``await awaitable``, or asyncio.TimeoutError once ``deadline`` (monotonic) passes."""
    if deadline is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, max(0.0, deadline - time.monotonic()))


async def _sse_chunks(response: httpx.Response, deadline: float | None, live: _Live) -> AsyncIterator[dict]:
    """The JSON of each ``data:`` event until ``[DONE]``; _Aborted once ``abort()`` closed the stream."""
    lines = response.aiter_lines()
    data: list[str] = []
    while True:
        try:
            line = await _within(lines.__anext__(), deadline)
        except StopAsyncIteration:
            break
        except (httpx.StreamClosed, httpx.ReadError, httpx.RemoteProtocolError) as exc:
            if live.aborted:
                raise _Aborted() from None
            raise EngineDeadError(f"the server's stream broke off: {exc}") from None
        if live.aborted:
            raise _Aborted()
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
            continue
        if line or not data:
            continue  # comments (": ping"), event names, retry fields, blank lines between events
        text, data = "\n".join(data), []
        if text == "[DONE]":
            return
        yield json.loads(text)
    if live.aborted:
        raise _Aborted()
    if data and "\n".join(data) != "[DONE]":  # a last event without its blank line
        yield json.loads("\n".join(data))
