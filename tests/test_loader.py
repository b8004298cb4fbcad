"""Checkpoint loading: sharded safetensors, dtypes, rope scaling, clear errors."""

import json

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.model.rotary import RotaryEmbedding, rope_frequencies

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_sharded_checkpoint_equals_single_file(model_dir_factory, model_dirs):
    sharded = model_dir_factory("qwen2", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    prompts = [[5, 6, 7, 8], [9, 10]]
    a = LLM(str(sharded), dtype="float32").generate(prompts, GREEDY)
    b = LLM(str(model_dirs["qwen2"]), dtype="float32").generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_half_precision_dtypes_run(model_dirs):
    from asyncllm.kernels.cpu_decode_stack import panels_supported

    llm = LLM(str(model_dirs["qwen3"]), dtype="bfloat16")
    # on AVX-512 builds bf16 weights with float32 arithmetic (tests/test_cpu_bf16.py), else bfloat16 throughout
    held = torch.float32 if panels_supported() else torch.bfloat16
    assert llm.engine.runner.dtype == held
    # kv_cache_dtype="auto" keeps the cache in bfloat16 either way (docs/cpu.md, "A bfloat16 KV cache")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    half = LLM(str(model_dirs["qwen3"]), dtype="bfloat16", attention_backend="torch")  # the plain torch path
    assert half.engine.runner.dtype == torch.bfloat16 and half.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    (out,) = llm.generate([[5, 6, 7]], GREEDY)
    assert len(out.outputs[0].token_ids) == 8
    assert LLM(str(model_dirs["llama"])).engine.runner.dtype == torch.float32  # auto on CPU


def test_llama3_rope_scaling_matches_transformers(model_dirs):
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.from_pretrained(model_dirs["llama"])
    assert config.rope_parameters["rope_type"] == "llama3"
    ours = RotaryEmbedding(*rope_frequencies(config, 16), max_positions=512)
    ours.build(torch.device("cpu"), torch.float32)
    theirs = LlamaRotaryEmbedding(config)
    default = rope_frequencies(type("C", (), {"rope_parameters": {"rope_theta": 500000.0}})(), 16)[0]
    assert not torch.allclose(theirs.inv_freq, default)  # the scaling really changes frequencies
    positions = torch.arange(512)
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions[None])
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])


def _with_edited_weights(source, target, edit):
    """A copy of checkpoint ``source`` in ``target`` whose tensors went through ``edit(dict)``."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_missing_weight_is_named(tmp_path, model_dirs):
    broken = _with_edited_weights(model_dirs["llama"], tmp_path / "broken",
                                  lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ModelLoadError, match="layers.1.self_attn.qkv_proj.weight"):
        LLM(str(broken))


def test_shape_mismatch_is_named(tmp_path, model_dirs):
    broken = _with_edited_weights(model_dirs["llama"], tmp_path / "mismatch",
                                  lambda t: t.update({"model.norm.weight": torch.ones(3)}))
    with pytest.raises(ModelLoadError, match="model.norm.weight"):
        LLM(str(broken))


def test_no_weights_at_all(tmp_path, model_dirs):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((model_dirs["llama"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(empty))
    assert json.loads((empty / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
