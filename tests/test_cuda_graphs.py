"""CUDA graphs of decode steps: replays give transformers' tokens; padding rows are harmless.

Without CUDA the bucketing, static buffers, padding and the runner's hook still run: a stand-in
graph "replays" by running the model again on the static buffers (with the Triton kernels in
the interpreter). The real capture is tested where CUDA is available.
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.model.cuda_graphs import DecodeGraphs, _Graph, bucket_sizes
from checkpoints import reference_greedy
from kernel_cases import DEVICE

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")


class _EagerGraph:
    """Stands in for a captured graph: replay runs the same call on the same static buffers."""

    def __init__(self, run, output: torch.Tensor) -> None:
        self.run, self.output = run, output

    def replay(self) -> None:
        self.output.copy_(self.run())


def _capture_eagerly(graphs: DecodeGraphs) -> DecodeGraphs:
    for bucket in graphs.buckets:
        meta = graphs._static_meta(bucket)
        hidden = graphs._run(bucket, meta)
        graphs.graphs[bucket] = _Graph(_EagerGraph(lambda b=bucket, m=meta: graphs._run(b, m), hidden), meta, hidden)
    return graphs


def test_bucket_sizes():
    assert bucket_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(4096)[-1] == 512


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """The batch size of every graph replay; each replay must leave its padding rows inert."""
    seen: list[int] = []
    original = DecodeGraphs.replay

    def counting_replay(self, input_ids, positions, meta):
        n = meta.num_seqs
        seen.append(n)
        hidden = original(self, input_ids, positions, meta)
        bucket = next(b for b in self.buckets if b >= n)
        assert hidden.shape[0] == n
        assert bool((self.slot_mapping[n:bucket] == -1).all()) and bool((self.seq_lens[n:bucket] == 0).all())
        return hidden

    monkeypatch.setattr(DecodeGraphs, "replay", counting_replay)
    return seen


def shrinking_batch(kind: str) -> tuple[list[list[int]], list[SamplingParams]]:
    """Five prompts with different budgets: the decode batch shrinks 5 -> 1, so buckets 8, 4, 2, 1
    replay with padding rows that held live sequences a step before."""
    rng = random.Random(kind)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (2, 7, 16, 31, 40)]
    return prompts, [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 6, 8, 10)]


def test_replay_path_on_cpu_equals_transformers(model_dirs, replays):
    """The runner's graph path (buckets, static buffers, padding resets) on CPU with stand-in graphs."""
    prompts, params = shrinking_batch("llama")
    llm = LLM(str(model_dirs["llama"]), dtype="float32", device=str(DEVICE), attention_backend="triton",
              max_num_seqs=8)
    runner = llm.engine.runner
    if runner.cuda_graphs is None:
        runner.cuda_graphs = _capture_eagerly(DecodeGraphs(runner.model, runner.kv_caches, runner.backend, 8,
                                                           llm.max_model_len, runner.block_size))
    outs = llm.generate(prompts, params)
    expected = reference_greedy(model_dirs["llama"], prompts, 10)
    assert [o.outputs[0].token_ids for o in outs] == [e[:p.max_tokens] for e, p in zip(expected, params)]
    assert {5, 4, 3, 2, 1} <= set(replays)


@needs_cuda
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graph_replays_equal_transformers(kind, model_dirs, replays):
    """Five prompts with different lengths and budgets: the decode batch shrinks from 5 to 1, so
    buckets 8, 4, 2, 1 replay with padding rows that held live sequences a step before."""
    prompts, params = shrinking_batch(kind)
    llm = LLM(str(model_dirs[kind]), dtype="float32", max_num_seqs=8)
    assert llm.engine.runner.cuda_graphs is not None
    outs = llm.generate(prompts, params)
    expected = reference_greedy(model_dirs[kind], prompts, 10)
    assert [o.outputs[0].token_ids for o in outs] == [e[:p.max_tokens] for e, p in zip(expected, params)]
    assert {5, 4, 3, 2, 1} <= set(replays)


@needs_cuda
def test_graphs_off_runs_eagerly(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="bfloat16", enable_cuda_graphs=False)
    assert llm.engine.runner.cuda_graphs is None
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 8


@needs_cuda
def test_bfloat16_graphs_with_long_contexts(model_dir_factory):
    """bf16 (the GPU default) with contexts long enough for split-KV at small batch, where graphs
    and eager steps split differently: they agree until bf16 rounding may flip a rare near-tie
    (after which greedy paths diverge), so only each continuation's start is compared."""
    model_dir = model_dir_factory("qwen3", max_position_embeddings=2048)
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (900, 1500)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = []
    for graphs in (True, False):
        llm = LLM(str(model_dir), dtype="bfloat16", max_num_seqs=4, enable_cuda_graphs=graphs)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        del llm
    assert all(len(tokens) == 32 for run in runs for tokens in run)
    assert [tokens[:4] for tokens in runs[0]] == [tokens[:4] for tokens in runs[1]]
