"""AsyncLLM keeps the start-up heap out of full garbage collections while it runs (asyncllm/gc_freeze.py): the
freeze is counted across engines, undone by the last close, and left alone where the application froze first."""

from __future__ import annotations

import gc

import pytest

from asyncllm import AsyncLLM
from asyncllm import gc_freeze
from asyncllm.errors import ConfigError


@pytest.fixture(autouse=True)
def _nothing_frozen():
    gc.unfreeze()
    assert gc_freeze.holders() == 0
    yield
    gc.unfreeze()


def test_started_engine_freezes_and_last_close_unfreezes(model_dirs):
    kept = [[i] for i in range(1000)]  # containers alive at start-up: frozen with everything else
    first = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    assert gc.get_freeze_count() > len(kept) and gc_freeze.holders() == 1
    second = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    assert gc_freeze.holders() == 2
    first.close()
    first.close()  # twice: one release only
    assert gc_freeze.holders() == 1 and gc.get_freeze_count() > 0
    second.close()
    assert gc_freeze.holders() == 0 and gc.get_freeze_count() == 0


def test_objects_made_later_are_still_collected(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    try:
        cycle = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1  # a cycle made after the freeze is found
    finally:
        llm.close()


def test_opt_out_and_bad_value(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", freeze_gc=False)
    try:
        assert gc.get_freeze_count() == 0 and gc_freeze.holders() == 0
    finally:
        llm.close()
    with pytest.raises(ConfigError, match="freeze_gc"):
        AsyncLLM(str(model_dirs["llama"]), dtype="float32", freeze_gc="yes")


def test_application_freeze_is_left_to_the_application(model_dirs):
    gc.freeze()
    before = gc.get_freeze_count()
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    llm.close()
    assert gc_freeze.holders() == 0 and gc.get_freeze_count() >= before > 0
