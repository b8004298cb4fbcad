"""The whole engine on the Triton kernels gives transformers' greedy tokens; backend selection.

Without a GPU the kernels run in triton's interpreter (slow), so a few short prompts and a few
tokens; block size 4 and a 16-token budget still make chunked prefills, and a second batch
reuses the first one's cached prefix.
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.kernels import elementwise, triton_utils
from checkpoints import reference_greedy
from kernel_cases import DEVICE

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def prompts(kind: str) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(kind)
    first = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 9, 19)]
    second = [first[2][:13] + [rng.randrange(5, 1000) for _ in range(3)]]  # 3 cached blocks of 4
    return first, second


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts calls of the fused elementwise kernels' launchers."""
    calls: dict[str, int] = {}
    for name in ("rms_norm", "rotary_embedding_", "silu_and_mul"):
        original = getattr(elementwise, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(elementwise, name, spy)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_triton_engine_greedy_equals_transformers(kind, model_dirs, kernel_calls):
    first, second = prompts(kind)
    llm = LLM(str(model_dirs[kind]), dtype="float32", device=str(DEVICE), attention_backend="triton",
              block_size=4, max_num_batched_tokens=16)
    assert llm.engine.runner.backend.name == "triton"
    got = [o.outputs[0].token_ids for o in llm.generate(first, GREEDY)]
    got += [o.outputs[0].token_ids for o in llm.generate(second, GREEDY)]
    assert got == reference_greedy(model_dirs[kind], first + second, NEW_TOKENS)
    assert llm.stats()["prefix_cache_hits"] >= 1
    assert set(kernel_calls) == {"rms_norm", "rotary_embedding_", "silu_and_mul"}


def test_auto_never_picks_triton_on_cpu(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device="cpu")
    assert llm.engine.runner.backend.name in ("cpu", "torch")  # the C kernel where it builds (tests/test_cpu_attention.py)
    assert llm.engine.runner.cuda_graphs is None


def test_triton_on_cpu_needs_the_interpreter(model_dirs, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        LLM(str(model_dirs["llama"]), device="cpu", attention_backend="triton")


def test_triton_needs_the_package(model_dirs, monkeypatch):
    monkeypatch.setattr(triton_utils, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match="needs the triton package"):
        LLM(str(model_dirs["llama"]), device="cpu", attention_backend="triton")


def test_enable_cuda_graphs_is_validated(model_dirs):
    with pytest.raises(ConfigError, match="enable_cuda_graphs"):
        LLM(str(model_dirs["llama"]), enable_cuda_graphs="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_picks_triton_and_graphs_on_cuda(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="bfloat16", max_num_seqs=8)
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.runner.cuda_graphs.buckets == [1, 2, 4, 8]
