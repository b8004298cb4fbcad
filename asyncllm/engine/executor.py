"""The processes a model runs in: this one alone, or this one as rank 0 of tensor-parallel ranks.

The engine talks to an :class:`Executor`, never to the worker processes: with
``tensor_parallel_size > 1`` it starts the other ranks (distributed/workers.py), builds rank 0's
:class:`ModelRunner` so that every rank agrees on the KV-cache size, and hands each step to the
workers before rank 0 runs it alongside them. Everything else a caller asks of the model (its
shape, platform, KV cache size, ...) is rank 0's runner's, read through the executor.
"""

from __future__ import annotations

from pathlib import Path

from ..config import EngineConfig
from ..model.runner import ModelRunner
from ..model.source import ModelSource
from ..model.step_io import StepInput, StepOutput


class Executor:
    """Rank 0's runner, plus the tensor-parallel workers when there are any."""

    def __init__(self, config: EngineConfig, hf_config, source: ModelSource | Path, max_model_len: int) -> None:
        self.workers = None
        ModelRunner.check(config, hf_config, max_model_len)  # refuse before starting any process
        agree = None
        tp = None
        if config.tensor_parallel_size > 1:
            from ..distributed.workers import WorkerGroup

            self.workers = WorkerGroup(config, hf_config, max_model_len)
            tp = self.workers.tp
            agree = lambda count: self.workers.share(count())  # noqa: E731 - rank 0 sizes the cache for all
        try:
            self.runner = ModelRunner(config, hf_config, source, max_model_len, tp=tp, agree_num_blocks=agree)
        except BaseException:
            self.shutdown()
            raise

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every rank; rank 0's result."""
        if self.workers is None:
            return self.runner.execute(step)
        with self.workers.step(step):
            return self.runner.execute(step)

    @property
    def healthy(self) -> bool:
        """False once a tensor-parallel worker is gone: the engine cannot go on without it."""
        return self.workers is None or self.workers.healthy

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do otherwise). Safe to call twice."""
        if self.workers is not None:
            self.workers.close()

    _OWN = ("workers", "runner")

    def __getattr__(self, name: str):
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def __setattr__(self, name: str, value) -> None:
        """The executor's own fields and methods here (a test may wrap ``execute``); anything else is
        rank 0's runner's, as reads are."""
        if name in self._OWN or hasattr(type(self), name) or "runner" not in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self.runner, name, value)
