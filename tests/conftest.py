"""Shared pytest fixtures: tiny random-weight HF checkpoints, built once per session.

Fixtures
--------
tokenizer_dir      directory with the tiny byte-level BPE tokenizer
model_dir_factory  ``factory(kind, **kwargs) -> Path``; kwargs go to
                   ``checkpoints.build_checkpoint`` (config overrides, or
                   ``sharded=True``); cached per session by arguments
llama_dir, qwen2_dir, qwen3_dir, mistral_dir
                   default checkpoints of each kind
model_dirs         ``{"llama": Path, "qwen2": ..., "qwen3": ..., "mistral": ...}``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Never touch the network: everything is built locally. Set before anything
# imports transformers / huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Let tests (and this file) do `from checkpoints import ...` under any
# pytest import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in triton's CPU interpreter. Triton reads the variable when
# a kernel module is imported, which asyncllm does lazily, so setting it here is early enough; with
# CUDA the real kernels run (tests/kernel_cases.py picks the device to match).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from checkpoints import KINDS, build_checkpoint, build_tokenizer  # noqa: E402


def _default_test_max_num_seqs() -> None:
    """On CUDA every engine captures one CUDA graph per batch bucket up to max_num_seqs (9 for the
    default 256); the test engines run a few sequences, so ASYNCLLM_TEST_MAX_NUM_SEQS (set by
    scripts/gpu_check.sh) becomes their default: 16 captures 5. Engines that pass max_num_seqs keep it."""
    value = os.environ.get("ASYNCLLM_TEST_MAX_NUM_SEQS")
    if not value:
        return
    from asyncllm.config import EngineConfig

    init = EngineConfig.__init__

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("max_num_seqs", int(value))
        init(self, *args, **kwargs)

    EngineConfig.__init__ = __init__


_default_test_max_num_seqs()

# The test models are tiny: intra-op threading only adds overhead (and is
# badly hurt by a busy machine). Override with ASYNCLLM_TEST_TORCH_THREADS.
torch.set_num_threads(int(os.environ.get("ASYNCLLM_TEST_TORCH_THREADS", "1")))


def _cache_key(kind: str, kwargs: dict) -> tuple:
    # repr() handles unhashable override values such as rope_parameters dicts.
    return (kind, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def model_dir_factory(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    cache: dict[tuple, Path] = {}

    def factory(kind: str, **kwargs) -> Path:
        key = _cache_key(kind, kwargs)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{kind}")
            cache[key] = build_checkpoint(kind, out, tokenizer_dir=tokenizer_dir, **kwargs)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def llama_dir(model_dir_factory) -> Path:
    return model_dir_factory("llama")


@pytest.fixture(scope="session")
def qwen2_dir(model_dir_factory) -> Path:
    return model_dir_factory("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(model_dir_factory) -> Path:
    return model_dir_factory("qwen3")


@pytest.fixture(scope="session")
def mistral_dir(model_dir_factory) -> Path:
    return model_dir_factory("mistral")


@pytest.fixture(scope="session")
def model_dirs(model_dir_factory) -> dict[str, Path]:
    return {kind: model_dir_factory(kind) for kind in KINDS}
