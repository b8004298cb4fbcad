"""Runs an EngineCore in a daemon thread: steps while there is work, sleeps on an Event otherwise."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .core import EngineCore, SequenceOutput

logger = logging.getLogger(__name__)


class EngineThread:
    """The background loop behind ``AsyncLLM``.

    ``on_outputs`` receives each step's outputs (in this thread); ``on_death`` receives the
    exception that killed the loop. The thread is a daemon, so it never keeps the interpreter alive.
    """

    def __init__(self, engine: EngineCore, on_outputs: Callable[[list[SequenceOutput]], None],
                 on_death: Callable[[BaseException], None]) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_death = on_death
        self._wakeup = threading.Event()
        self._stopping = False
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

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wakeup.clear()
                if not self.engine.has_work():
                    self._wakeup.wait()
                    continue
                self._publish(self.engine.step())
            self._publish(self.engine.apply_pending())  # aborts queued by the shutdown itself
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the streams
            logger.exception("engine loop died")
            self._on_death(exc)

    def _publish(self, outputs: list[SequenceOutput]) -> None:
        self.stats = self.engine.stats()
        if outputs:
            self._on_outputs(outputs)
