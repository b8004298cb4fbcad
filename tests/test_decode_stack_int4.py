"""The CPU decode stack on 4-bit and 8-bit zero-point checkpoints (kernels/cpu_decode_stack.py, weights "int4" and
"uint8"): GPTQ / AWQ layers read as their packed nibbles or bytes, act-order ones included, must give the module
path's tokens and log-probabilities, at one row, a few, and past the register tiles (widened panels); layouts the
kernel does not take leave it off."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncllm import LLM
from asyncllm.kernels import cpu_decode_stack
from asyncllm.kernels.cpu_decode_stack import MAX_PANEL_ROWS, _int4_group
from asyncllm.kernels.quant_linear import GroupQuantLinear
from asyncllm.toy import quantized as qc
from test_decode_stack import GREEDY, _compare, _prompts


@pytest.fixture(scope="module")
def source(model_dir_factory):
    return model_dir_factory("llama")


def _stack(llm: LLM):
    stack = llm.engine.runner.decode_stack
    assert stack is not None and stack.weights == "int4"  # built, on the packed weights
    layer = llm.engine.runner.model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, GroupQuantLinear)
    return stack


def _compare_on_two_threads(llm: LLM, prompts) -> int:
    """:func:`_compare` with the kernel's work split over two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return _compare(llm, prompts)
    finally:
        torch.set_num_threads(threads)


def _assert_same_outputs(fused, plain) -> None:
    """Two engines' outputs: the same tokens, log-probabilities to 1e-4."""
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())) for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())) for d in b.outputs[0].logprobs]
        assert la == pytest.approx(lb, abs=1e-4)


@pytest.fixture(scope="module")
def gptq4(source, tmp_path_factory):
    path = qc.write_gptq(source, tmp_path_factory.mktemp("gptq4") / "q", bits=4, group_size=32, sym=False)
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_seqs=MAX_PANEL_ROWS)
    yield path, llm
    llm.close()


def test_gptq4_batch_1_and_several(gptq4):
    _, llm = gptq4
    stack = _stack(llm)
    assert stack.group == 32 and stack.max_rows == MAX_PANEL_ROWS
    assert _compare(llm, _prompts(1)) >= 19
    assert _compare(llm, _prompts(5, seed=1)) >= 19


def test_gptq4_rows_past_the_register_tiles_on_two_threads(gptq4):
    """14 and 20 rows (more than the 12 that stream the nibbles: widened panels), split over two threads."""
    _, llm = gptq4
    _stack(llm)
    assert _compare_on_two_threads(llm, _prompts(14, seed=2)) >= 19
    assert _compare_on_two_threads(llm, _prompts(20, seed=3)) >= 19


def test_gptq4_equals_the_engine_with_the_stack_switched_off(gptq4, monkeypatch):
    path, llm = gptq4
    prompts = _prompts(3, seed=4)
    fused = llm.generate(prompts, GREEDY)
    monkeypatch.setenv(cpu_decode_stack.ENV_SWITCH, "0")
    with LLM(str(path), dtype="float32", block_size=4) as plain_llm:
        assert plain_llm.engine.runner.decode_stack is None
        plain = plain_llm.generate(prompts, GREEDY)
    _assert_same_outputs(fused, plain)


def test_awq_g32(source, tmp_path):
    with LLM(str(qc.write_awq(source, tmp_path / "q", group_size=32)), dtype="float32", block_size=4) as llm:
        assert _stack(llm).group == 32
        assert _compare(llm, _prompts(3, seed=5)) >= 19


def test_gptq4_one_group_per_row(source, tmp_path):
    path = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=-1, sym=False)
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        assert _stack(llm).group == 0
        assert _compare(llm, _prompts(3, seed=6)) >= 19


def test_gptq4_padded_partial_last_group(model_dir_factory, tmp_path):
    """80-wide inputs in groups of 64 (qkv, o and gate_up store 128 columns, down 192 for 176: zero-padded
    partial groups, and inputs not a multiple of 32); o and down have 80 outputs (half a 32-column panel left)."""
    source = model_dir_factory("llama", hidden_size=80, intermediate_size=176)
    path = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=64, sym=True)
    with LLM(str(path), dtype="float32", block_size=4, max_num_seqs=32) as llm:
        stack = _stack(llm)
        layer = llm.engine.runner.model.model.layers[0]
        assert stack.group == 64 and layer.self_attn.qkv_proj.stored_features == 128
        assert layer.mlp.down_proj.out_features == 80 and layer.mlp.down_proj.stored_features == 192
        assert _compare(llm, _prompts(2, seed=7)) >= 19
        assert _compare(llm, _prompts(16, seed=8)) >= 19


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq4_act_order(source, tmp_path, sym):
    """desc_act: the columns are stored sorted by group and the kernel gathers each input row by ``perm`` first;
    one row, a few, and past the register tiles on two threads."""
    path = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=sym, desc_act=True, seed=3)
    with LLM(str(path), dtype="float32", block_size=4, max_num_seqs=16) as llm:
        stack = _stack(llm)
        layer = llm.engine.runner.model.model.layers[0]
        perm = layer.mlp.down_proj.perm
        assert stack.group == 32 and perm is not None and not torch.equal(perm, torch.arange(perm.numel()))
        assert _compare(llm, _prompts(1)) >= 19
        assert _compare_on_two_threads(llm, _prompts(14, seed=10)) >= 19


def test_act_order_stack_equals_the_stack_switched_off(source, tmp_path, monkeypatch):
    """Against the module path of a separate engine (no shared state): same tokens, log-probabilities to 1e-4."""
    path = qc.write_gptq(source, tmp_path / "q", bits=4, group_size=32, sym=False, desc_act=True, seed=4)
    prompts = _prompts(3, seed=11)
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        _stack(llm)
        fused = llm.generate(prompts, GREEDY)
    monkeypatch.setenv(cpu_decode_stack.ENV_SWITCH, "0")
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        assert llm.engine.runner.decode_stack is None
        plain = llm.generate(prompts, GREEDY)
    _assert_same_outputs(fused, plain)


@pytest.mark.parametrize("options", [dict(group_size=-1), dict(group_size=32, desc_act=True)],
                         ids=["per-row", "g32-actorder"])
def test_gptq8_zero_points(source, tmp_path, options):
    """Asymmetric 8-bit GPTQ (GroupQuantLinear bytes with zero points; symmetric 8 bits are Int8Linear): read as
    bytes by the same loops; one row, a few, and past the register tiles on two threads."""
    path = qc.write_gptq(source, tmp_path / "q", bits=8, sym=False, seed=5, **options)
    with LLM(str(path), dtype="float32", block_size=4, max_num_seqs=16) as llm:
        stack = llm.engine.runner.decode_stack
        assert stack is not None and stack.weights == "uint8" and stack.max_rows == MAX_PANEL_ROWS
        down = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(down, GroupQuantLinear) and down.bits == 8
        assert stack.group == (0 if options["group_size"] == -1 else 32)
        assert _compare(llm, _prompts(1)) >= 19
        assert _compare(llm, _prompts(3, seed=12)) >= 19
        assert _compare_on_two_threads(llm, _prompts(14, seed=13)) >= 19


def test_stack_off_for_layouts_it_does_not_read(source, tmp_path):
    with LLM(str(qc.write_gptq(source, tmp_path / "q", bits=4, group_size=16, sym=True)), dtype="float32") as llm:
        assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, GroupQuantLinear)
        assert llm.engine.runner.decode_stack is None  # groups of 16 columns (the kernel takes multiples of 32)


def test_mixed_or_uneven_layers_are_refused():
    def layer(k=64, n=32, group=32, bits=4):
        width = k // 2 if bits == 4 else k
        return GroupQuantLinear(torch.zeros(n, width, dtype=torch.uint8), torch.ones(n, k // group),
                                torch.zeros(n, k // group), bits)

    assert _int4_group([("qkv", layer()), ("down", layer(k=128))]) == 32
    assert _int4_group([("qkv", layer(group=64)), ("down", layer(k=128, group=128))]) == 0  # a group per row
    assert _int4_group([("qkv", layer(bits=8)), ("down", layer(k=128, bits=8))], bits=8) == 32
    uneven = layer()
    uneven.group_index = torch.zeros(64, dtype=torch.int64)  # act-order cut unevenly by a tensor-parallel rank
    for modules in ([("qkv", layer()), ("down", nn.Linear(64, 32))], [("qkv", uneven)],
                    [("qkv", layer()), ("down", layer(k=128, group=64))],
                    [("qkv", layer(bits=8))], [("qkv", layer(bits=8)), ("down", layer(k=128))]):
        with pytest.raises(TypeError):
            _int4_group(modules)


def test_int4_stack_built_without_avx512(gptq4, source, tmp_path, monkeypatch):
    """The AVX2 build of the kernel (no nibble tables: masked, converted, dequantized) gives the same tokens, on
    nibbles and on act-order bytes with zero points."""
    from asyncllm.kernels.cpu_build import _FLAGS, BuildError, build_variant

    path, _ = gptq4
    try:
        lib = build_variant("decode_stack", [*_FLAGS, "-mno-avx512f"], tmp_path / "decode_stack_avx2.so",
                            cpu_decode_stack._SIGNATURES)
    except BuildError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(cpu_decode_stack, "_library", lambda: lib)
    with LLM(str(path), dtype="float32", block_size=4, max_num_seqs=16) as llm:
        assert _stack(llm).max_rows == MAX_PANEL_ROWS
        assert _compare(llm, _prompts(1)) >= 19
        assert _compare(llm, _prompts(14, seed=9)) >= 19
    bytes_path = qc.write_gptq(source, tmp_path / "q8", bits=8,
                               group_size=32, sym=False, desc_act=True)
    with LLM(str(bytes_path), dtype="float32", block_size=4, max_num_seqs=16) as llm:
        assert llm.engine.runner.decode_stack.weights == "uint8"
        assert _compare(llm, _prompts(3, seed=14)) >= 19
