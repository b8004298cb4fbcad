"""``AsyncLLM``: the engine in a background thread, one async stream per request.

The engine thread never waits for an event loop and an event loop never waits for a step:
requests and aborts go in through the engine's thread-safe inbox; each step's outputs come back
to each event loop with a single ``call_soon_threadsafe``, where they are detokenized and merged
into the request's state. A stream wakes on an ``asyncio.Event`` and takes everything new at once,
so a slow consumer costs no memory beyond its request's own text.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
import uuid
import weakref
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from .config import EngineConfig
from .errors import ConfigError
from .frontend.pooling import embedding_kwargs, model_pooling
from .gc_freeze import freeze_startup_heap, release_startup_heap
from .engine.core import EngineCore, SequenceOutput
from .engine.engine_thread import EngineThread
from .errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError, RequestTimeoutError
from .frontend.input_processor import make_input_processor
from .frontend.lora import cached_lora, load_lora
from .frontend.output_processor import OutputProcessor, RequestState
from .frontend.prompts import Prompt
from .model.loader import load_tokenizer
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INPUT_WORKERS = 4  # threads that tokenize, render chat templates and compile grammars off the event loop
# Sequence outputs turned into deltas per turn of the event loop: a step of 2,048 sequences is
# detokenized in slices, with the loop's other callbacks (the host's own) run between them.
DELIVER_SLICE = 128


class _LoopBridge:
    """Everything of one event loop's requests; only ever touched from that loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, processor: OutputProcessor) -> None:
        self.loop = loop
        self.processor = processor
        self.events: dict[str, asyncio.Event] = {}
        self.errors: dict[str, BaseException] = {}
        self._pending: deque[SequenceOutput] = deque()  # delivered, not yet processed (in step order)

    def deliver(self, outputs: list[SequenceOutput]) -> None:
        """Queue one step's outputs; they are processed in order, at most DELIVER_SLICE per loop turn."""
        draining = bool(self._pending)
        self._pending.extend(outputs)
        if not draining:
            self._drain()

    def _drain(self) -> None:
        pending = self._pending
        batch = [pending.popleft() for _ in range(min(DELIVER_SLICE, len(pending)))]
        if pending:
            self.loop.call_soon(self._drain)  # after the callbacks already waiting, the host's included
        self._process(batch)

    def _process(self, outputs: list[SequenceOutput]) -> None:
        try:
            states = self.processor.process(outputs)  # isolates each request's own failures
        except Exception as exc:  # noqa: BLE001 - a bug outside any one request: fail these, not the loop
            logger.exception("processing a step's outputs failed")
            error = RequestFailedError(f"processing the engine's output failed ({type(exc).__name__})")
            error.__cause__ = exc
            self.fail({out.request_id for out in outputs}, error)
            return
        for state in states:
            event = self.events.get(state.request_id)
            if event is not None:
                if state.error is not None:
                    self.errors[state.request_id] = state.error
                event.set()

    def fail(self, request_ids, error: BaseException) -> None:
        """End these requests' streams with ``error`` (each raises it at its next wake-up)."""
        for request_id in request_ids:
            self.processor.requests.pop(request_id, None)
            event = self.events.get(request_id)
            if event is not None:
                self.errors[request_id] = error
                event.set()


class AsyncLLM:
    """Async front of the engine, usable from any asyncio event loop (several at once).

    ``async with AsyncLLM(path) as llm: async for piece in llm.stream("Hello", max_tokens=32): ...``
    """

    def __init__(self, model: str, *, tool_parser: str | None = None, auto_restart: bool = True,
                 max_restarts: int = 3, restart_window_s: float = 300.0, freeze_gc: bool = True,
                 **engine_kwargs: Any) -> None:
        """``tool_parser``: the tool-call format ("hermes", "llama3_json", "mistral"); by default the
        model family's (see docs/tools.md). After an engine fault the engine is reset and goes on
        (``auto_restart``), at most ``max_restarts`` times within ``restart_window_s`` seconds; past
        that it stays dead until ``restart()`` (docs/async.md). ``freeze_gc``: once started, keep the
        objects alive then out of the garbage collector's full collections until close (gc_freeze.py:
        a full collection over the start-up heap held the GIL, and so the host's loop, for ~180 ms).
        Other keywords configure the engine (docs/api.md)."""
        if not isinstance(freeze_gc, bool):
            raise ConfigError(f"freeze_gc must be a bool, got {freeze_gc!r}")
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise ConfigError(f"max_restarts must be a non-negative integer, got {max_restarts!r}")
        if not isinstance(restart_window_s, (int, float)) or not restart_window_s > 0:
            raise ConfigError(f"restart_window_s must be a positive number, got {restart_window_s!r}")
        self.config = EngineConfig.from_kwargs(model, engine_kwargs)
        self.engine = EngineCore(self.config)
        # skip_tokenizer_init: token ids in and out, no text (docs/api.md)
        self.tokenizer = None if self.config.skip_tokenizer_init else load_tokenizer(self.engine.model_dir)
        self.inputs = make_input_processor(self.engine, self.tokenizer, tool_parser)
        self.auto_restart, self.max_restarts, self.restart_window_s = bool(auto_restart), max_restarts, restart_window_s
        self.num_restarts = 0  # engine resets so far (automatic and by restart())
        self._faults: deque[float] = deque()  # times of recent faults, for the restart bound
        self._lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._owners: dict[str, _LoopBridge] = {}   # live request id -> the loop that streams it
        self._error: EngineDeadError | None = None
        self._closed = False
        self._input_pool = ThreadPoolExecutor(INPUT_WORKERS, thread_name_prefix="asyncllm-input")
        self._thread = EngineThread(self.engine, self._dispatch, self._on_fault)
        self._holds_gc_freeze = freeze_gc
        if freeze_gc:  # last: everything start-up made is in place
            freeze_startup_heap()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_pooling(self) -> str:
        """The pooling :meth:`embed` uses by default ("last", or what the checkpoint's config says)."""
        return model_pooling(self.engine.model_dir)

    @property
    def tool_parser(self) -> str:
        """The tool-call format of this model ("hermes", "llama3_json" or "mistral")."""
        return self.inputs.tool_parser

    # ---- public API -----------------------------------------------------------------------------
    async def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, lora: Any = None,
                     request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                     parallel_tool_calls: bool | None = None, timeout: float | None = None, priority: int = 0,
                     **sampling_kwargs: Any) -> AsyncIterator[str]:
        """Yield the newly decoded text of the request as it is generated (never cumulative).

        ``timeout``: seconds the whole request may take; past it the request is aborted (its KV
        blocks freed) and the stream raises RequestTimeoutError. ``priority``: lower values are
        scheduled first and may preempt running requests of a higher value (docs/async.md)."""
        n = sampling_kwargs.get("n", params.n if params is not None else 1)
        if n != 1:
            raise InvalidRequestError("n: stream() yields one text; use stream_outputs() for n > 1", field="n")
        tool_args = (tools, tool_choice, parallel_tool_calls)
        async for _, delta in self._run(prompt, params, lora, request_id, tool_args, sampling_kwargs,
                                        timeout, priority):
            if delta.outputs[0].text:
                yield delta.outputs[0].text

    async def stream_outputs(self, prompt: Prompt, params: SamplingParams | None = None, *, lora: Any = None,
                             request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                             parallel_tool_calls: bool | None = None, timeout: float | None = None, priority: int = 0,
                             **sampling_kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs holding only what is new since the previous one.

        With ``tools`` (chat prompts only), ``text`` is the content and ``tool_calls`` the call
        fragments (see docs/tools.md); ``tool_choice`` is "none", "auto", "required" or
        ``{"type": "function", "function": {"name": ...}}``; ``timeout`` as in :meth:`stream`."""
        tool_args = (tools, tool_choice, parallel_tool_calls)
        async for _, delta in self._run(prompt, params, lora, request_id, tool_args, sampling_kwargs,
                                        timeout, priority):
            yield delta

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, lora: Any = None,
                       request_id: str | None = None, tools: list | None = None, tool_choice: Any = None,
                       parallel_tool_calls: bool | None = None, timeout: float | None = None, priority: int = 0,
                       **sampling_kwargs: Any) -> RequestOutput:
        """Run the request to completion and return its whole output (with ``tools``: the parsed
        ``tool_calls`` and finish_reason "tool_calls" when the model called any)."""
        tool_args = (tools, tool_choice, parallel_tool_calls)
        state = None
        async for state, _ in self._run(prompt, params, lora, request_id, tool_args, sampling_kwargs,
                                        timeout, priority):
            pass
        return state.output()

    async def embed(self, prompt: Prompt, *, pooling: str | None = None, lora: Any = None,
                    request_id: str | None = None, timeout: float | None = None, priority: int = 0,
                    truncate_prompt_tokens: int | None = None) -> list[float]:
        """The prompt's embedding: the model's final hidden states (after the last norm), pooled
        ("last": the last token's, "mean": the average over the prompt; None: as the checkpoint's
        sentence-transformers config says, else "last") and L2-normalised. It runs through the
        engine's own forward pass, batched with everything else; nothing is sampled."""
        output = await self.encode(prompt, pooling=pooling, lora=lora, request_id=request_id, timeout=timeout,
                                   priority=priority, truncate_prompt_tokens=truncate_prompt_tokens)
        return output.embedding

    async def encode(self, prompt: Prompt, *, pooling: str | None = None, lora: Any = None,
                     request_id: str | None = None, timeout: float | None = None, priority: int = 0,
                     truncate_prompt_tokens: int | None = None) -> RequestOutput:
        """:meth:`embed`, returning the whole RequestOutput (``embedding``, ``prompt_token_ids``)."""
        pooling = pooling or self.default_pooling
        state = None
        async for state, _ in self._run(prompt, None, lora, request_id, (None, None, None),
                                        embedding_kwargs(truncate_prompt_tokens), timeout,
                                        priority, pooling=pooling):
            pass
        if state.embedding is None:  # aborted before its prompt was computed
            raise RequestFailedError(f"request {state.request_id}: ended without an embedding")
        return state.output()

    async def abort(self, request_id: str) -> None:
        """Abort a running request from anywhere; its stream ends with finish_reason "abort"."""
        self.engine.abort_request(request_id)
        self._thread.wake()

    def stats(self) -> dict[str, int]:
        """Engine counters as of the last step (docs/api.md); after a fault, those of the reset engine."""
        return dict(self._thread.stats)

    async def offload(self, fn, *args: Any) -> Any:
        """Run blocking front-side work (tokenizing, rendering, decoding) in the input worker pool,
        so the event loop keeps serving; the server's /tokenize and /detokenize use it."""
        return await asyncio.get_running_loop().run_in_executor(self._input_pool, functools.partial(fn, *args))

    async def restart(self) -> None:
        """Reset the engine in this process: in-flight streams end with EngineDeadError, every KV
        block is freed, and new requests are served again (also after the automatic restarts ran
        out). The weights stay loaded. Raises EngineDeadError once closed."""
        await asyncio.to_thread(self._restart_now)

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
        with self._restart_lock:
            self._thread.stop()
            self._thread.join()
            self.engine.shutdown()
        self._input_pool.shutdown(wait=False)
        self.inputs.grammars.close()  # the grammar engine's guard processes
        with self._lock:
            release, self._holds_gc_freeze = self._holds_gc_freeze, False
        if release:
            release_startup_heap()

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    # ---- event-loop side --------------------------------------------------------------------------
    async def _run(self, prompt, params, lora, request_id, tool_args, sampling_kwargs, timeout=None, priority=0,
                   pooling=None) -> AsyncIterator[tuple[RequestState, RequestOutput]]:
        """``tool_args``: (tools, tool_choice, parallel_tool_calls) as the public methods got them."""
        _check_timeout(timeout)
        with self._lock:
            self._check_usable()  # before any work: a dead engine answers at once
        adapter = cached_lora(self.engine.loras, lora)
        if adapter is None and lora is not None:  # hot load from disk, off the event loop and the engine
            adapter = await asyncio.to_thread(load_lora, self.engine.loras, lora)
        tools, tool_choice, parallel_tool_calls = tool_args
        process = functools.partial(self.inputs.process, prompt, params, request_id or f"req-{uuid.uuid4().hex}",
                                    sampling_kwargs, tools, lora=adapter, tool_choice=tool_choice,
                                    parallel_tool_calls=parallel_tool_calls, priority=priority, pooling=pooling)
        if self.inputs.needs_worker(prompt, params, sampling_kwargs, tools):
            text, request = await self.offload(process)  # the loop keeps serving meanwhile
        else:
            text, request = process()
        loop = asyncio.get_running_loop()
        rid = request.request_id
        bridge = self._bridge_for(loop)
        event = asyncio.Event()
        with self._lock:  # registered and queued together: a fault's reset sees both or neither
            self._check_usable()
            if rid in self._owners:
                raise InvalidRequestError(f"request_id: {rid!r} is already running", field="request_id")
            self._check_backlog()
            state = bridge.processor.add(request, text)
            self._owners[rid] = bridge
            bridge.events[rid] = event
            self.engine.add_request(request)
        self._thread.wake()
        expiry = loop.call_later(timeout, self._expire, bridge, rid, timeout) if timeout is not None else None
        try:
            done = False
            while not done:
                await event.wait()
                event.clear()
                if rid in bridge.errors:
                    # tokens made before the failure reach the consumer first (a loop running behind the engine
                    # may see several steps' outputs and the fault at one wake-up), then the error
                    delta = state.take_delta()
                    if _has_news(delta):
                        event.set()
                        yield state, delta
                        continue
                    raise bridge.errors.pop(rid)
                # read before yielding: a request that finishes while the consumer holds this delta
                # must still hand out its last one (tokens and finish_reason) at the next wake-up
                done = state.finished
                delta = state.take_delta()
                if done or _has_news(delta):
                    yield state, delta
        finally:
            if expiry is not None:
                expiry.cancel()
            bridge.events.pop(rid, None)
            bridge.errors.pop(rid, None)
            bridge.processor.requests.pop(rid, None)
            with self._lock:
                if self._owners.get(rid) is bridge:
                    del self._owners[rid]
            if not state.finished:  # the consumer left early: free the request's blocks now
                self.engine.abort_request(rid)
                self._thread.wake()

    def _check_backlog(self) -> None:
        """Refuse a request when ``max_waiting_requests`` wait already (call with the lock held)."""
        waiting = len(self._owners) - self._thread.stats.get("num_running_requests", 0)
        if waiting >= self.config.max_waiting_requests:
            raise EngineOverloadedError(
                f"too many requests are waiting ({waiting}; max_waiting_requests is "
                f"{self.config.max_waiting_requests}): retry later")

    @staticmethod
    def _expire(bridge: _LoopBridge, request_id: str, timeout: float) -> None:
        event = bridge.events.get(request_id)
        if event is not None:
            bridge.errors[request_id] = RequestTimeoutError(f"request {request_id} ran past its timeout of {timeout} s")
            event.set()

    def _bridge_for(self, loop: asyncio.AbstractEventLoop) -> _LoopBridge:
        with self._lock:
            bridge = self._bridges.get(loop)
            if bridge is None:
                bridge = _LoopBridge(loop, OutputProcessor(self.tokenizer, self._stop_sequence, self._abort_now))
                self._bridges[loop] = bridge
            return bridge

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        self._thread.wake()

    def _stop_sequence(self, request_id: str, index: int) -> None:
        self.engine.stop_sequence(request_id, index)
        self._thread.wake()

    def _check_usable(self) -> None:
        if self._error is None and not self._closed and not self.engine.healthy:
            self._error = EngineDeadError("a tensor-parallel worker is gone: the engine cannot recover; "
                                          "create a new AsyncLLM")
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

    def _on_fault(self, exc: BaseException) -> bool:
        """A step raised (engine thread, no step running): reset the engine, fail what was in flight,
        and go on if the restart bound allows. Returns whether the loop keeps running."""
        now = time.monotonic()
        self._faults.append(now)
        while self._faults and now - self._faults[0] > self.restart_window_s:
            self._faults.popleft()
        healthy = self.engine.healthy
        restart = self.auto_restart and len(self._faults) <= self.max_restarts and not self._closed and healthy
        what = "the engine was reset and serves again" if restart else (
            "a tensor-parallel worker is gone: the engine cannot recover; create a new one" if not healthy else
            f"{len(self._faults)} faults in {self.restart_window_s:g} s: not restarting; call restart()"
            if self.auto_restart else "auto_restart is off; call restart()")
        error = EngineDeadError(f"the engine loop died: {exc!r} ({what})")
        error.__cause__ = exc
        with self._lock:
            in_flight = self._reset_engine()
            self._error = None if restart else error  # dead: new work is refused with the cause
            if restart:
                self.num_restarts += 1
        self._thread.publish_stats()  # stats() and /metrics read 0 running, 0 blocks from now on
        if restart:
            logger.warning("engine reset after a fault (%d within %g s)", len(self._faults), self.restart_window_s)
        # streams learn of the fault only now, so a client that retries at once finds the engine serving
        self._fail_streams(in_flight, error)
        return restart

    def _restart_now(self) -> None:
        with self._restart_lock:
            with self._lock:
                if self._closed:
                    raise EngineDeadError("this AsyncLLM has been closed")
                if not self.engine.healthy:
                    raise EngineDeadError("a tensor-parallel worker is gone: this engine cannot restart; "
                                          "create a new AsyncLLM")
                self._error = EngineDeadError("the engine is restarting (AsyncLLM.restart())")  # /health: 503
            self._thread.stop()
            self._thread.join()
            with self._lock:
                in_flight = self._reset_engine()
            self._thread = EngineThread(self.engine, self._dispatch, self._on_fault)
            with self._lock:
                self._error = None
                self._faults.clear()
                self.num_restarts += 1
            self._fail_streams(in_flight, EngineDeadError("the engine was restarted (AsyncLLM.restart())"))

    def _reset_engine(self) -> dict[str, _LoopBridge]:
        """Reset the engine and return the requests that were in flight (call with the lock held,
        and no step running). Requests are registered and queued under the same lock, so every
        request is either among those returned or submitted to the reset engine."""
        in_flight, self._owners = self._owners, {}
        self.engine.reset()
        return in_flight

    @staticmethod
    def _fail_streams(in_flight: dict[str, _LoopBridge], error: EngineDeadError) -> None:
        """End these requests' streams with ``error``, one thread-safe call per event loop."""
        per_bridge: dict[_LoopBridge, list[str]] = defaultdict(list)
        for request_id, bridge in in_flight.items():
            per_bridge[bridge].append(request_id)
        for bridge, request_ids in per_bridge.items():
            try:
                bridge.loop.call_soon_threadsafe(bridge.fail, request_ids, error)
            except RuntimeError:  # that event loop is closed: nobody is waiting there
                pass


def _check_timeout(timeout: Any) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise InvalidRequestError(f"timeout: expected a positive number of seconds, got {timeout!r}", field="timeout")


def _has_news(delta: RequestOutput) -> bool:
    return delta.prompt_logprobs is not None or any(c.text or c.token_ids or c.finish_reason for c in delta.outputs)
