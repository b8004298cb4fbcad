"""The transformers peers of W-CPU (workloads: docs/benchmarks.md), on the same checkpoint and requests.

- :func:`make_static_runner`: ``model.generate`` in static batches of 32 (left padding + attention mask, greedy;
  each batch runs to its longest request; only requested tokens count).
- :func:`make_cb_runner`: transformers continuous batching (``init_continuous_batching`` + ``add_request``).

Each factory loads the model (not timed) and returns a runner ``run(workload, progress) -> RunResult``.
Token timestamps: static batching takes the time of each decoding step from a ``generate`` streamer (a row's
tokens are stamped at the steps that produced them, so a request of the second batch sees its first token only
after the first batch has finished); continuous batching uses transformers' own per-token timestamps
(``record_timestamps=True``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable

from benchmarks.common import EOS_ID, PAD_ID, Workload
from benchmarks.measure import RunResult

STATIC_BATCH_SIZE = 32
ENGINE_STATIC = "hf-static"
ENGINE_CB = "hf-continuous"
STATIC_TIMING = "generate streamer: end of each decoding step of the request's static batch"
CB_TIMING = "transformers continuous batching per-token timestamps (record_timestamps=True)"

Runner = Callable[[Workload, bool], RunResult]


def load_hf_model(model_dir: str, attn: str = "sdpa"):
    """The checkpoint as a float32 transformers model in eval mode, without progress bars or psutil noise."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    _quiet_cb_logger()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


class _DropPsutilNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "psutil" not in record.getMessage()


def _quiet_cb_logger() -> None:
    """transformers' continuous batching logs an ERROR (and a warning) on CPU when psutil is missing although it
    carries on fine; the cache is sized explicitly here, so drop that noise."""
    lg = logging.getLogger("ContinuousBatchingLogger")
    if not any(isinstance(f, _DropPsutilNoise) for f in lg.filters):
        lg.addFilter(_DropPsutilNoise())


class _StepClock:
    """A ``generate`` streamer: stamps each decoding step and advances a tqdm bar by the requested tokens it
    produced."""

    def __init__(self, bar: Any, max_tokens: list[int]) -> None:
        self.bar, self.max_tokens, self.times = bar, max_tokens, []

    def put(self, value: Any) -> None:
        if getattr(value, "dim", lambda: 1)() > 1:  # the prompt, pushed once before decoding
            return
        self.times.append(time.perf_counter())
        step = len(self.times)
        self.bar.update(sum(1 for m in self.max_tokens if m >= step))

    def end(self) -> None:
        pass


def _left_padded(reqs: list, idx: list[int]):
    import torch

    plen = max(reqs[i].prompt_len for i in idx)
    ids = torch.full((len(idx), plen), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(idx), plen), dtype=torch.long)
    for row, i in enumerate(idx):
        p = reqs[i].prompt_token_ids
        ids[row, plen - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, plen - len(p):] = 1
    return ids, mask


def make_static_runner(model_dir: str, batch_size: int = STATIC_BATCH_SIZE) -> Runner:
    import torch

    model = load_hf_model(model_dir)

    def run(w: Workload, progress: bool) -> RunResult:
        from tqdm.auto import tqdm

        reqs = w.requests
        outputs: list[list[int]] = [[] for _ in reqs]
        token_times: list[list[float]] = [[] for _ in reqs]
        bar = tqdm(total=w.output_tokens, desc=ENGINE_STATIC, unit="tok", disable=not progress, file=sys.stdout)
        t0 = time.perf_counter()
        with torch.inference_mode():
            for first in range(0, len(reqs), batch_size):
                idx = list(range(first, min(first + batch_size, len(reqs))))
                ids, mask = _left_padded(reqs, idx)
                new = max(reqs[i].max_tokens for i in idx)
                clock = _StepClock(bar, [reqs[i].max_tokens for i in idx])
                out = model.generate(
                    streamer=clock, input_ids=ids, attention_mask=mask, do_sample=False,
                    max_new_tokens=new, min_new_tokens=new,  # with eos suppressed until then: ignore_eos
                    pad_token_id=PAD_ID, eos_token_id=EOS_ID,
                )
                plen = ids.shape[1]
                for row, i in enumerate(idx):
                    outputs[i] = out[row, plen:plen + reqs[i].max_tokens].tolist()
                    token_times[i] = clock.times[:reqs[i].max_tokens]
        dt = time.perf_counter() - t0
        bar.close()
        return RunResult(dt, outputs, t0, token_times, STATIC_TIMING)

    return run


def make_cb_runner(model_dir: str, page_size: int, max_batch_tokens: int) -> Runner:
    import torch

    model = load_hf_model(model_dir)

    def run(w: Workload, progress: bool) -> RunResult:
        from tqdm.auto import tqdm

        with torch.inference_mode():
            mgr = model.init_continuous_batching(generation_config=_cb_generation_config(w),
                                                 continuous_batching_config=_cb_config(w, page_size, max_batch_tokens))
            mgr.start()
            try:
                bar = tqdm(total=len(w.requests), desc=ENGINE_CB, unit="req", disable=not progress, file=sys.stdout)
                t0 = time.perf_counter()
                rids = [mgr.add_request(list(r.prompt_token_ids), max_new_tokens=r.max_tokens, eos_token_id=-1,
                                        record_timestamps=True) for r in w.requests]
                results = _collect_cb(mgr, len(rids), bar)
                dt = time.perf_counter() - t0
                bar.close()
            finally:
                mgr.stop(block=True, timeout=10)
                mgr.destroy()
        outs = [results[rid] for rid in rids]
        return RunResult(dt, [list(o.generated_tokens) for o in outs], t0,
                         [list(o.timestamps or []) for o in outs], CB_TIMING)

    return run


def _cb_config(w: Workload, page_size: int, max_batch_tokens: int):
    from transformers.generation import ContinuousBatchingConfig

    # Size the paged cache for the whole workload at once (the default sizes it from total RAM, and its attention
    # masks scale with the cache size, which is needlessly slow on CPU).
    num_blocks = sum(math.ceil((r.prompt_len + r.max_tokens) / page_size) for r in w.requests) + 2
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    max_memory_percent=0.5, allow_block_sharing=False, seed=0)


def _cb_generation_config(w: Workload):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in w.requests),
                            eos_token_id=-1, pad_token_id=PAD_ID)


def _collect_cb(mgr: Any, count: int, bar: Any) -> dict[str, Any]:
    results: dict[str, Any] = {}
    while len(results) < count:
        res = mgr.get_result(timeout=1.0)
        if res is None:
            if not mgr.is_running():
                raise RuntimeError("transformers continuous batching thread stopped unexpectedly")
            continue
        if res.is_finished():
            if res.error is not None:
                raise RuntimeError(f"continuous batching request {res.request_id} failed: {res.error}")
            results[res.request_id] = res
            bar.update(1)
    return results
