"""The CPU decode stack (kernels/cpu_decode_stack.py): small decode-only steps in one C call must give
the module-by-module path's tokens and log-probabilities, and be used exactly when it should."""

from __future__ import annotations

import random

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.kernels import cpu_decode_stack
from asyncllm.kernels.cpu_decode_stack import MAX_PANEL_ROWS, MAX_ROWS, StackLimits, panels_supported, to_panels

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def _run(llm: LLM, prompts, use_stack: bool, params=GREEDY):
    runner = llm.engine.runner
    stack = runner.decode_stack
    calls = []
    if stack is not None:
        original = stack.run
        stack.run = lambda ids, *a, **k: (calls.append(ids.shape[0]), original(ids, *a, **k))[1]
    runner.decode_stack = stack if use_stack else None
    try:
        outputs = llm.generate(prompts, params)
    finally:
        runner.decode_stack = stack
        if stack is not None:
            stack.run = original
    return outputs, calls


def _compare(llm: LLM, prompts, atol: float = 1e-4) -> int:
    fused, calls = _run(llm, prompts, True)
    plain, _ = _run(llm, prompts, False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())) for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())) for d in b.outputs[0].logprobs]
        assert la == pytest.approx(lb, abs=atol)
    return len(calls)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_stack_equals_module_path(kind, model_dirs):
    llm = LLM(str(model_dirs[kind]), dtype="float32", block_size=4)
    assert llm.engine.runner.decode_stack is not None
    calls = _compare(llm, _prompts(3))
    assert calls >= 19  # every decode step of the 3 sequences ran there


def test_stack_with_two_threads_and_full_batches(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_num_seqs=80)
    stack = llm.engine.runner.decode_stack
    assert stack.max_rows == (MAX_PANEL_ROWS if panels_supported() else MAX_ROWS)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls = _compare(llm, _prompts(stack.max_rows))
        assert calls >= 19
        _, calls = _run(llm, _prompts(stack.max_rows + 1), True)  # too many rows: the regular path
        assert max(calls, default=0) <= stack.max_rows  # only mixed steps' smaller decode parts ran there
    finally:
        torch.set_num_threads(threads)


def test_stack_on_int8_weights(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", quantization="int8")
    assert llm.engine.runner.decode_stack is not None and llm.engine.runner.decode_stack.int8
    assert _compare(llm, _prompts(2), atol=1e-3) >= 19


def test_stack_off_where_it_does_not_apply(model_dirs, monkeypatch):
    assert LLM(str(model_dirs["qwen3"]), dtype="float32").engine.runner.decode_stack is None  # q/k norms
    assert LLM(str(model_dirs["llama"]), attention_backend="torch").engine.runner.decode_stack is None
    monkeypatch.setenv(cpu_decode_stack.ENV_SWITCH, "0")
    assert LLM(str(model_dirs["llama"]), dtype="float32").engine.runner.decode_stack is None


def test_sampled_rows_and_mixed_steps_are_unchanged(model_dirs):
    """Seeded sampling through the stack equals the module path (prefill steps use the modules)."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    fused, calls = _run(llm, _prompts(4, seed=3), True, params)
    plain, _ = _run(llm, _prompts(4, seed=3), False, params)
    assert [o.outputs[0].token_ids for o in fused] == [o.outputs[0].token_ids for o in plain]
    assert calls


def test_mixed_steps_send_their_decodes_through_the_stack(model_dirs, monkeypatch):
    """A step holding decodes and prefill chunks, too large for the stack to run whole, is cut in two
    (model/mixed_steps.py): the decodes run in the stack, the chunks in the modules, and tokens and logprobs
    equal the module path's."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_num_batched_tokens=16, block_size=4)
    runner = llm.engine.runner.runner  # the ModelRunner behind the Executor
    monkeypatch.setattr(runner.decode_stack, "limits", StackLimits(64, 4, 4, 1024))  # whole: up to 4 tokens
    splits = []
    original = runner._forward_split
    monkeypatch.setattr(runner, "_forward_split", lambda step, split: (
        splits.append((len(split.decodes.token_ids), len(split.prefills.token_ids))), original(step, split))[1])
    calls = _compare(llm, _prompts(6, seed=5))
    assert calls >= 19 and splits  # mixed steps were cut, and not only decode-only steps ran in the stack
    assert all(d > 0 and p > 0 and 4 < d + p <= 16 for d, p in splits)


@pytest.mark.skipif(not panels_supported(), reason="steps run whole on the stack past 8 tokens on AVX-512 panels only")
def test_mixed_steps_within_the_limits_run_whole_on_the_stack(model_dirs, monkeypatch):
    """On panels a step of decodes and prefill chunks within ``StackLimits`` runs in one stack call, one row per
    token (the chunk's rows attend to the keys its earlier rows just wrote): tokens and logprobs equal the
    module path's, and nothing is cut in two."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_num_batched_tokens=200, block_size=4)
    runner = llm.engine.runner.runner
    stack = runner.decode_stack
    assert (stack.limits.chained_rows, stack.limits.mixed_rows) == (MAX_PANEL_ROWS, 512)
    prompts = _prompts(6, seed=5) + [list(range(7, 307))]  # 300 tokens: its tail rides beside the others' decodes
    chained = []
    original = stack.run
    monkeypatch.setattr(stack, "run", lambda ids, positions, meta: (
        chained.append(ids.shape[0]) if meta.chained else None, original(ids, positions, meta))[1])
    monkeypatch.setattr(runner, "_forward_split", lambda step, split: pytest.fail("a step that fits was cut"))
    fused = llm.generate(prompts, GREEDY)
    monkeypatch.undo()
    plain, _ = _run(llm, prompts, False)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())) for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())) for d in b.outputs[0].logprobs]
        assert la == pytest.approx(lb, abs=1e-4)
    assert chained and max(chained) > MAX_PANEL_ROWS  # a mixed step past 64 tokens went through in one call


def test_panels_layout():
    weight = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)
    panels = to_panels(weight)
    assert panels.shape == (2, 8, 32) and panels.is_contiguous()
    assert torch.equal(panels[0], weight[:32].T) and torch.equal(panels[1, :, :8], weight[32:].T)
    assert not panels[1, :, 8:].any()  # columns past N are zero


def test_stack_over_every_batch_size_and_odd_widths(model_dir_factory):
    """Widths that are not multiples of a panel (gate_up 144, down 48 outputs: padded panels), a head size
    of 12, and a batch that shrinks from 14 rows to 1 as requests end (every tile height, one and two
    tiles per panel) all match the module path."""
    model = model_dir_factory("llama", hidden_size=48, intermediate_size=72, num_attention_heads=4,
                              num_key_value_heads=2)
    llm = LLM(str(model), dtype="float32", block_size=4)
    assert llm.engine.runner.decode_stack is not None
    prompts = _prompts(14, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True, logprobs=0) for i in range(14)]
    fused, calls = _run(llm, prompts, True, params)
    plain, _ = _run(llm, prompts, False, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())) for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())) for d in b.outputs[0].logprobs]
        assert la == pytest.approx(lb, abs=1e-4)
    assert len(calls) >= (14 if panels_supported() else 4)


def test_stack_built_without_avx512_reads_row_major_weights(model_dirs, tmp_path, monkeypatch):
    """A machine without AVX-512 gets the row-major loops and at most MAX_ROWS rows: built here with
    AVX-512 switched off, that build must give the module path's tokens too."""
    from kernel_cases import build_variant_or_skip

    lib = build_variant_or_skip("decode_stack", ["-mno-avx512f"], tmp_path / "decode_stack_avx2.so",
                                cpu_decode_stack._SIGNATURES)
    assert lib.decode_stack_panels() == 0
    monkeypatch.setattr(cpu_decode_stack, "_library", lambda: lib)
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_num_seqs=8)
    stack = llm.engine.runner.decode_stack
    assert not stack.panels and stack.max_rows == MAX_ROWS
    assert _compare(llm, _prompts(MAX_ROWS)) >= 19
    _, calls = _run(llm, _prompts(MAX_ROWS + 1), True)
    assert max(calls, default=0) <= MAX_ROWS
