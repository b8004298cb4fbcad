"""Injecting engine faults in tests: the model's forward pass raises, as a device error would."""

from __future__ import annotations


def inject_faults(llm, after_calls: int, times: int) -> dict:
    """Make ``llm``'s forward pass raise ``RuntimeError("injected engine fault")`` on ``times`` calls
    after the first ``after_calls``; returns the counters (set ``["left"] = 0`` to stop the faults)."""
    real_execute = llm.engine.runner.execute
    state = {"calls": 0, "left": times}

    def execute(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] > after_calls and state["left"] > 0:
            state["left"] -= 1
            raise RuntimeError("injected engine fault")
        return real_execute(*args, **kwargs)

    llm.engine.runner.execute = execute
    return state
