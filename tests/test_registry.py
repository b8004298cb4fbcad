"""The model registry: architecture name -> the family class whose declaration the loader, the LoRA
loader and the fast paths read; Phi-3 (fused qkv/gate_up checkpoints) greedy-equal to transformers;
unsupported variants refused with the feature and its config key named."""

from __future__ import annotations

import json

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import LoRAError, ModelLoadError
from asyncllm.model.registry import NATIVE, architecture_for
from checkpoints import load_reference_model, reference_greedy
from test_parity import GREEDY, NEW_TOKENS, parity_prompts


@pytest.fixture(scope="module")
def phi3_dir(model_dir_factory):
    return model_dir_factory("phi3")


def test_phi3_checkpoint_is_fused_and_loads_without_mapping(phi3_dir):
    from safetensors import safe_open

    with safe_open(phi3_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    from transformers import AutoConfig

    assert architecture_for(AutoConfig.from_pretrained(phi3_dir)).fused == {}


@pytest.mark.parametrize("engine_kwargs", [{}, {"block_size": 4, "max_num_batched_tokens": 32},
                                           {"attention_backend": "torch"}],
                         ids=["default", "chunked-prefill", "torch-reference"])
def test_phi3_greedy_equals_transformers(phi3_dir, engine_kwargs):
    expected = reference_greedy(phi3_dir, parity_prompts("phi3"), NEW_TOKENS, model=load_reference_model(phi3_dir))
    llm = LLM(str(phi3_dir), dtype="float32", **engine_kwargs)
    got = [o.outputs[0].token_ids for o in llm.generate(parity_prompts("phi3"), GREEDY)]
    assert got == expected
    assert llm.stats()["kv_blocks_used"] == 0


def test_unsupported_variants_name_the_feature_and_config_key(phi3_dir, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(phi3_dir)
    architecture_for(config)  # partial rotary and longrope are implemented now (test_families.py)
    config.rope_parameters = {"rope_type": "proportional", "rope_theta": 10000.0}
    with pytest.raises(ModelLoadError, match=r"rope type 'proportional' \(config key rope_parameters.rope_type\)"):
        architecture_for(config)
    config = AutoConfig.from_pretrained(phi3_dir)
    config.hidden_act = "relu2"
    with pytest.raises(ModelLoadError, match=r"activation 'relu2' \(config key hidden_act\)"):
        architecture_for(config)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ModelLoadError, match="Phi3ForCausalLM"):  # the error lists the native families
        architecture_for(config, model_impl="native")
    with pytest.raises(ModelLoadError, match="model_impl"):
        architecture_for(config, model_impl="fast")


def test_a_checkpoint_asking_for_remote_code_says_so(phi3_dir, tmp_path):
    from asyncllm.model.loader import load_hf_config

    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps(
        {"architectures": ["MyModelForCausalLM"], "model_type": "my_model",
         "auto_map": {"AutoConfig": "configuration_my.MyConfig"}}))
    with pytest.raises(ModelLoadError, match="trust_remote_code"):
        load_hf_config(remote)
    assert len(NATIVE) >= 13


def test_lora_targets_come_from_the_registry(phi3_dir, tmp_path):
    adapter = tmp_path / "phi3-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["qkv_proj"]}))
    from safetensors.torch import save_file
    import torch

    save_file({"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": torch.zeros(4, 64)},
              str(adapter / "adapter_model.safetensors"))
    llm = LLM(str(phi3_dir), dtype="float32")
    with pytest.raises(LoRAError, match="not supported for this architecture"):
        llm.add_lora("x", str(adapter))
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
