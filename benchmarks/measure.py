"""Measurement helpers shared by the benchmarks.

- :func:`latency_report` turns per-token timestamps into time-to-first-token and inter-token latency
  percentiles (milliseconds).
- :class:`StepRecorder` wraps an asyncllm ``EngineCore.step`` to timestamp every generated token at the
  end of the step that produced it, time each step, and sample KV-cache utilization.
- :class:`MemoryMeter` measures what an engine adds to the process's peak resident memory.
- :func:`model_config`, :func:`loadavg`, :func:`write_report` describe the run.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

# ---------------------------------------------------------------------------------------------------------------
# Latency statistics
# ---------------------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summarize_ms(values_s: list[float]) -> dict[str, float | int | None]:
    """p50 / p99 / mean of durations given in seconds, reported in milliseconds."""
    if not values_s:
        return {"p50": None, "p99": None, "mean": None, "count": 0}
    ms = lambda v: round(v * 1000.0, 3)  # noqa: E731
    return {
        "p50": ms(percentile(values_s, 50)),
        "p99": ms(percentile(values_s, 99)),
        "mean": ms(sum(values_s) / len(values_s)),
        "count": len(values_s),
    }


def split_latencies(start: float, token_times: list[list[float]]) -> tuple[list[float], list[float]]:
    """(time to first token of each request, every gap between consecutive tokens of a request)."""
    ttfts, gaps = [], []
    for times in token_times:
        if not times:
            continue
        ttfts.append(times[0] - start)
        gaps.extend(b - a for a, b in zip(times, times[1:]))
    return ttfts, gaps


def latency_report(start: float, token_times: list[list[float]]) -> dict[str, Any]:
    """``{"ttft_ms": {...}, "itl_ms": {...}}`` from absolute per-token timestamps (all requests submitted at
    ``start``)."""
    ttfts, gaps = split_latencies(start, token_times)
    return {"ttft_ms": summarize_ms(ttfts), "itl_ms": summarize_ms(gaps)}


# ---------------------------------------------------------------------------------------------------------------
# asyncllm engine instrumentation
# ---------------------------------------------------------------------------------------------------------------


def kv_usage(engine: Any) -> tuple[int, int]:
    """(token slots whose KV is computed, token slots in the KV blocks held) for the running sequences.

    Utilization = first / second: the share of the held KV memory that actually holds tokens. Blocks are counted
    once however many sequences share them (``kv_blocks_used``)."""
    tokens = sum(seq.num_computed_tokens for seq in engine.scheduler.running)
    slots = engine.kv.num_used_blocks * engine.kv.block_size
    return tokens, slots


def reset_prefix_cache(engine: Any) -> bool:
    """Forget every cached prefix of an idle engine (an ``EngineCore``), so that a repeat of the same prompts is
    not served from the previous run's KV. Returns False if this engine has no way to do it."""
    pool = getattr(getattr(engine, "kv", None), "pool", None)
    reset = getattr(pool, "reset_prefix_cache", None)
    if reset is None:
        return False
    reset()
    return True


@dataclass
class StepRecorder:
    """Wraps ``engine.step`` (an ``EngineCore``) while installed; works for both fronts since ``LLM`` and the
    ``AsyncLLM`` engine thread both call ``engine.step()`` through the instance.

    ``token_times[request_id]``: ``time.perf_counter()`` at the end of the step that produced each token.
    ``step_s``: duration of every step that produced output. ``kv_samples``: :func:`kv_usage` after each step
    that left sequences running."""

    engine: Any
    token_times: dict[str, list[float]] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    kv_samples: list[tuple[int, int]] = field(default_factory=list)

    @contextmanager
    def installed(self) -> Iterator["StepRecorder"]:
        original = self.engine.step
        wrapped_already = "step" in vars(self.engine)  # someone else's wrapper: put it back as it was

        def step():
            t0 = time.perf_counter()
            outputs = original()
            now = time.perf_counter()
            if outputs:
                self.step_s.append(now - t0)
            for out in outputs:
                if out.new_token_ids:
                    self.token_times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            tokens, slots = kv_usage(self.engine)
            if slots:
                self.kv_samples.append((tokens, slots))
            return outputs

        self.engine.step = step
        try:
            yield self
        finally:
            if wrapped_already:
                self.engine.step = original
            else:
                del self.engine.step  # back to the class's method

    def kv_utilization(self) -> dict[str, float | int | None]:
        return kv_utilization_summary(self.kv_samples)


def kv_utilization_summary(samples: list[tuple[int, int]]) -> dict[str, float | int | None]:
    """Mean and minimum of per-step utilization, and the token-weighted figure (sum of tokens / sum of slots)."""
    if not samples:
        return {"mean": None, "min": None, "weighted": None, "samples": 0}
    ratios = [t / s for t, s in samples]
    return {
        "mean": round(sum(ratios) / len(ratios), 4),
        "min": round(min(ratios), 4),
        "weighted": round(sum(t for t, _ in samples) / sum(s for _, s in samples), 4),
        "samples": len(samples),
    }


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------


def _status_kb(name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


MEMORY_METHOD = (
    "peak RSS delta = (RSS after the engine's setup and warm-up - RSS before it) + the largest rise of the "
    "process's RSS high-water mark (VmHWM, reset via /proc/self/clear_refs before each timed run) over the RSS at "
    "the start of that run; engines share one process, idle ones cancel out")


class MemoryMeter:
    """What one engine adds to the process's peak resident memory, without a subprocess per engine.

    peak delta = (RSS after the engine's setup and warm-up - RSS before it) + the largest rise of the RSS
    high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` before each run) over the RSS at the start
    of a timed run. Other engines built in the same process stay resident but idle, so they cancel out. Where the
    high-water mark cannot be reset, the rise is measured against the unreset mark (``method`` says so)."""

    def __init__(self) -> None:
        self.setup_kb: int | None = None
        self.run_rise_kb = 0
        self.method = "VmHWM reset per run" if reset_peak_rss() else "VmHWM without reset (approximate)"
        self._before = _status_kb("VmRSS")

    def setup_done(self) -> None:
        after = _status_kb("VmRSS")
        if after is not None and self._before is not None:
            self.setup_kb = max(0, after - self._before)

    @contextmanager
    def run(self) -> Iterator[None]:
        reset_peak_rss()
        start = _status_kb("VmRSS")
        try:
            yield
        finally:
            peak = _status_kb("VmHWM")
            if peak is not None and start is not None:
                self.run_rise_kb = max(self.run_rise_kb, peak - start)

    def report(self) -> dict[str, Any]:
        mb = lambda kb: round(kb / 1024, 1) if kb is not None else None  # noqa: E731
        total = None if self.setup_kb is None else self.setup_kb + self.run_rise_kb
        return {"peak_rss_delta_mb": mb(total), "setup_rss_mb": mb(self.setup_kb),
                "run_peak_rise_mb": mb(self.run_rise_kb), "method": self.method}


# ---------------------------------------------------------------------------------------------------------------
# Run description
# ---------------------------------------------------------------------------------------------------------------


def model_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The shape fields of a checkpoint's ``config.json`` that the workloads and the roofline need."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "tie_word_embeddings")
    return {k: cfg[k] for k in keys if cfg.get(k) is not None}


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_record(load_start: list[float] | None) -> dict[str, Any]:
    """The machine (see common.machine_info) with the load average at the start and now."""
    from benchmarks.common import machine_info

    return {**machine_info(), "loadavg_start": load_start, "loadavg_end": loadavg()}


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


REPO_ROOT = Path(__file__).resolve().parent.parent


def portable(value: Any) -> Any:
    """``value`` with this machine's paths taken out: the checkout's own paths become relative to
    it, the interpreter's path becomes ``python`` and the home folder ``~`` (reports are committed
    with the figures and read elsewhere)."""
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(item) for item in value]
    if isinstance(value, str):
        value = value.replace(sys.executable, "python").replace(f"{REPO_ROOT}{os.sep}", "")
        home = os.path.expanduser("~")
        return "~" + value[len(home):] if home != "/" and value.startswith(home + os.sep) else value
    return value


def write_report(path: str | os.PathLike | None, report: dict[str, Any]) -> None:
    """Write ``report`` as indented JSON (creating the folder), with :func:`portable` paths; no-op for ``None``."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(portable(report), indent=2, default=str) + "\n")


def finish_report(report: dict[str, Any], model_dir: str, load_start: list[float] | None, json_path: str | None,
                  printer: Any) -> dict[str, Any]:
    """The common end of a workload's ``main``: the model and machine records, the table, the JSON."""
    model = {"dir": model_dir, "config": model_config(model_dir), "dtype": "float32"}
    return publish_report(report, model, load_start, json_path, printer)


def publish_report(report: dict[str, Any], model: dict[str, Any], load_start: list[float] | None,
                   json_path: str | None, printer: Any) -> dict[str, Any]:
    """Record the model and the machine in ``report``, print its table, write its JSON; return it."""
    report["model"] = model
    report["machine"] = machine_record(load_start)
    printer(report)
    write_report(json_path, report)
    return report


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@dataclass
class RunResult:
    """One timed run of an engine over a workload.

    ``token_times[i]``: ``time.perf_counter()`` of each generated token of request ``i`` (workload order), taken
    as ``timing`` says; ``start``: when the requests were submitted."""

    wall_s: float
    outputs: list[list[int]]
    start: float
    token_times: list[list[float]]
    timing: str
    extra: dict[str, Any] = field(default_factory=dict)
