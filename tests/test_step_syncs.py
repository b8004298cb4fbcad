"""The decode step on the device path waits for the device at most twice (issue: a step without host syncs).

A CUDA step that reads values back (``.item()``, ``.tolist()``, ``bool(t)``) or copies host data
from pageable memory makes the CPU wait for the GPU, so the host cannot prepare the next step
while the GPU runs this one. ``tests/sync_counter.py`` counts, on the CPU, every call that would
synchronise on CUDA; the engine runs the Triton kernels (interpreted here) with the sampler's
device path (no fused CPU greedy pick), as it does on CUDA. On a GPU (scripts/gpu_check.sh) the same
engine runs on CUDA with CUDA graphs, and torch's own sync debug mode counts the real syncs too.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.engine import core
from asyncllm.kernels import transfer
from asyncllm.kernels.transfer import stage, to_device
from kernel_cases import DEVICE
from sync_counter import SyncCounter

MAX_SYNCS_PER_STEP = 2
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, max_tokens=4, ignore_eos=True,
                              seed=3),
    "logprobs_and_penalties": SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.2,
                                             presence_penalty=0.5, logit_bias={7: 2.0}, min_tokens=2,
                                             max_tokens=4, ignore_eos=True),
    "json_schema": SamplingParams(temperature=0, max_tokens=4, json_schema={"type": "object"}),
}


def test_the_counter_sees_syncing_operations():
    """The counter could fail: each of these would wait for a CUDA device."""
    t = torch.arange(6)
    with SyncCounter() as counter, counter.counting():
        t.sum().item()
        t.tolist()
        bool(t.any())
        torch.tensor([1, 2], device="cpu")
        t.to("cpu")
        t[[0, 2]]
        t[t > 2]
        torch.repeat_interleave(t, t)
        transfer.to_host(t)
        to_device([1, 2], torch.device("cpu"))          # non-blocking: not counted
        stage([[1], [2, 3]], torch.device("cpu"))
        torch.repeat_interleave(t, t, output_size=15)   # size known: not counted
    assert counter.counts == {"Tensor.item": 1, "Tensor.tolist": 1, "Tensor.__bool__": 1,
                              "torch.tensor(device=...)": 1, "Tensor.to(device)": 1, "index with list/mask": 2,
                              "repeat_interleave": 1, "to_host": 1}


@pytest.fixture(scope="module")
def triton_llm(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device=str(DEVICE), attention_backend="triton",
              block_size=4, max_num_seqs=4)
    runner = llm.engine.runner
    runner.platform = replace(runner.platform, fused_greedy=False)  # the sampler's device path, as on CUDA
    return llm


def _syncs_per_step(llm, params: SamplingParams, monkeypatch) -> list[dict[str, int]]:
    """The syncing calls of every engine step while ``llm`` generates ``PROMPTS``."""
    counter = SyncCounter()
    steps = []
    original = core.EngineCore.step

    def counted_step(self):
        before = dict(counter.counts)
        with counter.counting():
            outputs = original(self)
        steps.append({k: v - before.get(k, 0) for k, v in counter.counts.items() if v != before.get(k, 0)})
        return outputs

    monkeypatch.setattr(core.EngineCore, "step", counted_step)
    with counter:
        outputs = llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) >= 1 for o in outputs)
    return steps


@pytest.mark.parametrize("case", list(CASES))
def test_engine_step_syncs_at_most_twice(case, triton_llm, monkeypatch):
    if case == "json_schema":
        pytest.importorskip("llguidance", reason="structured output needs the grammar engine (absent on the GPU image)")
    steps = _syncs_per_step(triton_llm, CASES[case], monkeypatch)
    assert len(steps) >= 4  # a prefill step and decode steps
    worst = max(steps, key=lambda s: sum(s.values()))
    assert sum(worst.values()) <= MAX_SYNCS_PER_STEP, worst
    assert all(s.get("to_host", 0) <= 1 for s in steps)  # the step's single copy back


@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's sync debug mode needs a CUDA device")
@pytest.mark.parametrize("case", ["greedy", "sampled"])
def test_cuda_decode_steps_sync_at_most_twice(case, triton_llm, monkeypatch):
    """On the GPU: torch warns at every synchronising call; decode steps (CUDA graph replays) stay within the bound."""
    import warnings

    per_step: list[int] = []
    original = core.EngineCore.step

    def counted_step(self):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = original(self)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        per_step.append(sum("synchroniz" in str(w.message) for w in caught))
        return outputs

    monkeypatch.setattr(core.EngineCore, "step", counted_step)
    triton_llm.generate(PROMPTS, CASES[case])
    assert triton_llm.engine.runner.cuda_graphs is not None
    assert max(per_step[1:]) <= MAX_SYNCS_PER_STEP, per_step  # the first step is the prefill
