"""``AsyncLLM``: the engine in a background thread, one async stream per request.

The engine thread never waits for an event loop and an event loop never waits for a step:
requests and aborts go in through the engine's thread-safe inbox; each step's outputs come back
to each event loop with a single ``call_soon_threadsafe``, where they are detokenized and merged
into the request's state. A stream wakes on an ``asyncio.Event`` and takes everything new at once,
so a slow consumer costs no memory beyond its request's own text.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections import defaultdict
from typing import Any, AsyncIterator

from .config import EngineConfig
from .engine.core import EngineCore, SequenceOutput
from .engine.engine_thread import EngineThread
from .errors import EngineDeadError, InvalidRequestError
from .frontend.input_processor import make_input_processor
from .frontend.lora import cached_lora, load_lora
from .frontend.output_processor import OutputProcessor, RequestState
from .frontend.prompts import Prompt
from .model.loader import load_tokenizer
from .outputs import RequestOutput
from .sampling_params import SamplingParams


class _LoopBridge:
    """Everything of one event loop's requests; only ever touched from that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, processor: OutputProcessor) -> None:
        self.loop = loop
        self.processor = processor
        self.events: dict[str, asyncio.Event] = {}
        self.errors: dict[str, BaseException] = {}

    def deliver(self, outputs: list[SequenceOutput]) -> None:
        for state in self.processor.process(outputs):
            event = self.events.get(state.request_id)
            if event is not None:
                event.set()

    def fail_all(self, error: BaseException) -> None:
        for request_id, event in self.events.items():
            self.errors[request_id] = error
            event.set()


class AsyncLLM:
    """Async front of the engine, usable from any asyncio event loop (several at once).

    ``async with AsyncLLM(path) as llm: async for piece in llm.stream("Hello", max_tokens=32): ...``
    """

    def __init__(self, model: str, *, tool_parser: str | None = None, **engine_kwargs: Any) -> None:
        """``tool_parser``: the tool-call format ("hermes", "llama3_json", "mistral"); by default the
        model family's (see docs/tools.md). Other keywords configure the engine (shared/API.md)."""
        self.config = EngineConfig.from_kwargs(model, engine_kwargs)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self.inputs = make_input_processor(self.engine, self.tokenizer, tool_parser)
        self._lock = threading.Lock()
        self._bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._owners: dict[str, _LoopBridge] = {}   # live request id -> the loop that streams it
        self._error: EngineDeadError | None = None
        self._closed = False
        self._thread = EngineThread(self.engine, self._dispatch, self._die)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tool_parser(self) -> str:
        """The tool-call format of this model ("hermes", "llama3_json" or "mistral")."""
        return self.inputs.tool_parser

    # ---- public API -----------------------------------------------------------------------------
    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, lora: Any = None,
                     request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                     parallel_tool_calls: bool | None = None, **sampling_kwargs: Any) -> AsyncIterator[str]:
        """Yield the newly decoded text of the request as it is generated (never cumulative)."""
        n = sampling_kwargs.get("n", params.n if params is not None else 1)
        if n != 1:
            raise InvalidRequestError("n: stream() yields one text; use stream_outputs() for n > 1", field="n")
        tool_args = (tools, tool_choice, parallel_tool_calls)
        async for _, delta in self._run(prompt, params, lora, request_id, tool_args, sampling_kwargs):
            if delta.outputs[0].text:
                yield delta.outputs[0].text

    async def stream_outputs(self, prompt: Prompt, params: SamplingParams | None = None, *, lora: Any = None,
                             request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                             parallel_tool_calls: bool | None = None,
                             **sampling_kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs holding only what is new since the previous one.

        With ``tools`` (chat prompts only), ``text`` is the content and ``tool_calls`` the call
        fragments (see docs/tools.md); ``tool_choice`` is "none", "auto", "required" or
        ``{"type": "function", "function": {"name": ...}}``."""
        tool_args = (tools, tool_choice, parallel_tool_calls)
        async for _, delta in self._run(prompt, params, lora, request_id, tool_args, sampling_kwargs):
            yield delta

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, lora: Any = None,
                       request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                       parallel_tool_calls: bool | None = None, **sampling_kwargs: Any) -> RequestOutput:
        """Run the request to completion and return its whole output (with ``tools``: the parsed
        ``tool_calls`` and finish_reason "tool_calls" when the model called any)."""
        tool_args = (tools, tool_choice, parallel_tool_calls)
        state = None
        async for state, _ in self._run(prompt, params, lora, request_id, tool_args, sampling_kwargs):
            pass
        return state.output()

    async def abort(self, request_id: str) -> None:
        """Abort a running request from anywhere; its stream ends with finish_reason "abort"."""
        self.engine.abort_request(request_id)
        self._thread.wake()

    def stats(self) -> dict[str, int]:
        """Engine counters as of the last step (see shared/API.md)."""
        return dict(self._thread.stats)

    async def check_health(self) -> None:
        """Return if the engine accepts work; raise EngineDeadError if it died or was closed."""
        with self._lock:
            self._check_usable()

    def list_loras(self) -> list[str]:
        """Names of the registered LoRA adapters."""
        return self.engine.loras.names()

    async def add_lora(self, name: str, path: str) -> None:
        """Load and register a PEFT adapter under ``name``; it is read in a worker thread, so
        streams keep flowing meanwhile. Raises LoRAError if it cannot be used with this model."""
        await asyncio.to_thread(self.engine.loras.load, name, str(path))

    async def remove_lora(self, name: str) -> None:
        """Unregister an adapter. Requests already running with it finish normally (removal is
        deferred for them); new requests naming it get LoRAError."""
        self.engine.loras.remove(name)

    async def aclose(self) -> None:
        """Abort what runs, stop the engine thread and wait for it. Safe to call twice."""
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Synchronous ``aclose`` for code outside an event loop."""
        with self._lock:
            self._closed = True
            open_requests = list(self._owners)
        for request_id in open_requests:
            self.engine.abort_request(request_id)
        self._thread.stop()
        self._thread.join()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    # ---- event-loop side --------------------------------------------------------------------------
    async def _run(self, prompt, params, lora, request_id, tool_args, sampling_kwargs
                   ) -> AsyncIterator[tuple[RequestState, RequestOutput]]:
        """``tool_args``: (tools, tool_choice, parallel_tool_calls) as the public methods got them."""
        adapter = cached_lora(self.engine.loras, lora)
        if adapter is None and lora is not None:  # hot load from disk, off the event loop and the engine
            adapter = await asyncio.to_thread(load_lora, self.engine.loras, lora)
        tools, tool_choice, parallel_tool_calls = tool_args
        text, request = self.inputs.process(prompt, params, request_id or f"req-{uuid.uuid4().hex}",
                                            sampling_kwargs, tools, lora=adapter, tool_choice=tool_choice,
                                            parallel_tool_calls=parallel_tool_calls)
        rid = request.request_id
        bridge = self._bridge_for(asyncio.get_running_loop())
        event = asyncio.Event()
        with self._lock:
            self._check_usable()
            if rid in self._owners:
                raise InvalidRequestError(f"request_id: {rid!r} is already running", field="request_id")
            self._owners[rid] = bridge
        state = bridge.processor.add(request, text)
        bridge.events[rid] = event
        self.engine.add_request(request)
        self._thread.wake()
        try:
            done = False
            while not done:
                await event.wait()
                event.clear()
                if rid in bridge.errors:
                    raise bridge.errors.pop(rid)
                # read before yielding: a request that finishes while the consumer holds this delta
                # must still hand out its last one (tokens and finish_reason) at the next wake-up
                done = state.finished
                delta = state.take_delta()
                if done or _has_news(delta):
                    yield state, delta
        finally:
            bridge.events.pop(rid, None)
            bridge.errors.pop(rid, None)
            bridge.processor.requests.pop(rid, None)
            with self._lock:
                self._owners.pop(rid, None)
            if not state.finished:  # the consumer left early: free the request's blocks now
                self.engine.abort_request(rid)
                self._thread.wake()

    def _bridge_for(self, loop: asyncio.AbstractEventLoop) -> _LoopBridge:
        with self._lock:
            bridge = self._bridges.get(loop)
            if bridge is None:
                bridge = _LoopBridge(loop, OutputProcessor(self.tokenizer, self._stop_sequence))
                self._bridges[loop] = bridge
            return bridge

    def _stop_sequence(self, request_id: str, index: int) -> None:
        self.engine.stop_sequence(request_id, index)
        self._thread.wake()

    def _check_usable(self) -> None:
        if self._error is not None:
            raise self._error
        if self._closed:
            raise EngineDeadError("this AsyncLLM has been closed")

    # ---- engine-thread side -----------------------------------------------------------------------
    def _dispatch(self, outputs: list[SequenceOutput]) -> None:
        """Hand one step's outputs to each event loop with a single thread-safe call."""
        per_bridge: dict[_LoopBridge, list[SequenceOutput]] = defaultdict(list)
        with self._lock:
            for out in outputs:
                bridge = self._owners.get(out.request_id)
                if bridge is not None:
                    per_bridge[bridge].append(out)
        for bridge, outs in per_bridge.items():
            try:
                bridge.loop.call_soon_threadsafe(bridge.deliver, outs)
            except RuntimeError:  # that event loop is closed: nobody will read these requests
                for request_id in {o.request_id for o in outs}:
                    self.engine.abort_request(request_id)

    def _die(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine loop died: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._error = error
            bridges = list(self._bridges.values())
        for bridge in bridges:
            try:
                bridge.loop.call_soon_threadsafe(bridge.fail_all, error)
            except RuntimeError:
                pass


def _has_news(delta: RequestOutput) -> bool:
    return delta.prompt_logprobs is not None or any(c.text or c.token_ids or c.finish_reason for c in delta.outputs)
