"""Runs an EngineCore in a daemon thread: steps while there is work, sleeps on an Event otherwise."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .core import EngineCore, SequenceOutput

logger = logging.getLogger(__name__)


class EngineThread:
    """The background loop behind ``AsyncLLM``.

    ``on_outputs`` receives each step's outputs (in this thread). ``on_fault`` receives an
    exception raised by a step, in this thread, with no step running; it fails the requests that
    were in flight, resets the engine, and returns True to keep stepping or False to end the loop
    (the engine is then dead until a new EngineThread is started). The thread is a daemon, so it
    never keeps the interpreter alive.
    """

    def __init__(self, engine: EngineCore, on_outputs: Callable[[list[SequenceOutput]], None],
                 on_fault: Callable[[BaseException], bool]) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_fault = on_fault
        self._wakeup = threading.Event()
        self._stopping = False
        self._arrival_window_s = float(getattr(engine.config, "arrival_window_ms", 0.0)) / 1000
        self.stats: dict[str, int] = engine.stats()  # a snapshot, replaced (never mutated) after each step
        self._thread = threading.Thread(target=self._run, name="asyncllm-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        """Call after putting something in the engine's inbox."""
        self._wakeup.set()

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def publish_stats(self) -> None:
        """Refresh the stats snapshot (after a reset, from the thread that did it)."""
        self.stats = self.engine.stats()

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._step_until_stopped()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach the streams
                logger.exception("engine step failed")
                try:
                    keep_going = self._on_fault(exc)
                except BaseException:  # noqa: BLE001 - the handler itself failed: the engine is dead
                    logger.exception("engine fault handler failed")
                    return
                if not keep_going:
                    return
        try:
            self._publish(self.engine.apply_pending())  # aborts queued by the shutdown itself
        except BaseException:  # noqa: BLE001 - shutting down anyway
            logger.exception("engine shutdown failed")

    def _step_until_stopped(self) -> None:
        while not self._stopping:
            self._wakeup.clear()
            if not self.engine.has_work():
                self._wakeup.wait()
                self._let_a_burst_arrive()
                continue
            self._publish(self.engine.step())

    # a burst may spread over this many windows before the first step starts anyway
    BURST_WINDOWS = 5

    def _let_a_burst_arrive(self) -> None:
        """Woken from idle: wait while requests keep arriving, each within ``arrival_window_ms`` of the last (for
        at most BURST_WINDOWS windows), so that requests sent together share the first prefill step.

        Why: requests sent at once reach the engine one by one (an HTTP server parses them in turn, about a
        millisecond each), and without the wait the first starts a step alone that all the others then queue
        behind: 8 x 128-token prompts 2 ms apart took a 128-token step (128 ms) and then an 896-token one, TTFT
        p99 727 ms, against 681-709 ms for one 1,024-token step (docs/async.md). A lone request pays one window."""
        window = self._arrival_window_s
        if window <= 0:
            return
        deadline = time.perf_counter() + self.BURST_WINDOWS * window
        seen = self.engine.queued_count()
        while not self._stopping:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wakeup.clear()
            self._wakeup.wait(min(window, left))
            now_seen = self.engine.queued_count()
            if now_seen == seen:  # a whole window without a new arrival
                return
            seen = now_seen

    def _publish(self, outputs: list[SequenceOutput]) -> None:
        self.stats = self.engine.stats()
        if outputs:
            self._on_outputs(outputs)
