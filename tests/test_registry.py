"""The model registry: one entry per checkpoint layout, used by the loader and the LoRA loader; Phi-3
(fused qkv/gate_up checkpoints) joins by an entry and a config check, greedy-equal to transformers."""

from __future__ import annotations

import json

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import LoRAError, ModelLoadError
from asyncllm.model.registry import ARCHITECTURES, architecture_for
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
    config = json.loads((phi3_dir / "config.json").read_text())
    assert ARCHITECTURES[config["architectures"][0]].fused == {}


@pytest.mark.parametrize("engine_kwargs", [{}, {"block_size": 4, "max_num_batched_tokens": 32},
                                           {"attention_backend": "torch"}],
                         ids=["default", "chunked-prefill", "torch-reference"])
def test_phi3_greedy_equals_transformers(phi3_dir, engine_kwargs):
    expected = reference_greedy(phi3_dir, parity_prompts("phi3"), NEW_TOKENS, model=load_reference_model(phi3_dir))
    llm = LLM(str(phi3_dir), dtype="float32", **engine_kwargs)
    got = [o.outputs[0].token_ids for o in llm.generate(parity_prompts("phi3"), GREEDY)]
    assert got == expected
    assert llm.stats()["kv_blocks_used"] == 0


def test_phi3_variants_the_decoder_lacks_are_refused(phi3_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(phi3_dir)
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        architecture_for(config)
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                              "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    with pytest.raises(ModelLoadError, match="longrope"):
        architecture_for(config)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ModelLoadError, match="Phi3ForCausalLM"):  # the error lists what is supported
        architecture_for(config)


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
