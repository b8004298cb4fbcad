"""The platform decision (asyncllm/platform.py): one place, read by the runner, the core and the sampler."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.kernels.cpu_attention import cpu_kernels_available
from asyncllm.platform import decide_platform


class _Config:  # the few transformers-config fields the decision reads
    dtype = "float32"


def test_cpu_defaults():
    p = decide_platform(EngineConfig(model="x"), _Config())
    assert p.device == torch.device("cpu") and p.dtype == torch.float32
    assert p.attention_backend == ("cpu" if cpu_kernels_available() else "torch")
    assert p.fused_greedy and not p.cuda_graphs and p.default_token_budget == 2048
    assert p.distributed_backend == "gloo" and not p.is_cuda


def test_torch_reference_is_plain_torch():
    p = decide_platform(EngineConfig(model="x", attention_backend="torch"), _Config())
    assert p.attention_backend == "torch" and p.kernel_family is None
    assert not p.packed_linears and not p.fused_greedy


def test_impossible_choices_are_config_errors():
    from asyncllm.kernels.cpu_decode_stack import panels_supported

    if panels_supported():  # bf16 weights, float32 arithmetic: the C kernels run it (tests/test_cpu_bf16.py)
        platform = decide_platform(EngineConfig(model="x", attention_backend="cpu", dtype="bfloat16"), _Config())
        assert platform.bf16_weights and platform.dtype == torch.float32 and platform.attention_backend == "cpu"
    else:
        with pytest.raises(ConfigError, match="attention_backend='cpu'"):
            decide_platform(EngineConfig(model="x", attention_backend="cpu", dtype="bfloat16"), _Config())
    with pytest.raises(ConfigError, match="attention_backend='cpu'"):
        decide_platform(EngineConfig(model="x", attention_backend="cpu", dtype="float16"), _Config())
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            decide_platform(EngineConfig(model="x", device="cuda"), _Config())


def test_engine_reads_the_decision(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", attention_backend="torch")
    platform = llm.engine.runner.platform
    assert llm.engine.runner.backend.name == platform.attention_backend == "torch"
    assert llm.engine.scheduler.max_num_batched_tokens == platform.default_token_budget
    custom = LLM(str(model_dirs["llama"]), dtype="float32", max_num_batched_tokens=64)
    assert custom.engine.scheduler.max_num_batched_tokens == 64
