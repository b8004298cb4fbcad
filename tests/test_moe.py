"""Mixture-of-experts models (model/moe.py): routing and experts against transformers' own modules, greedy
output equal to transformers for Mixtral, Qwen2-MoE, Qwen3-MoE and GraniteMoe, tensor and expert parallel
equal to one process, LoRA on a MoE model equal to PEFT merged, and checkpoints refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ConfigError, LoRAError, ModelLoadError
from asyncllm.model.moe import expert_activation, grouped_experts, reference_experts, route
from asyncllm.model.shape import MoEShape
from checkpoints import random_prompts, reference_greedy, strong_peft_adapter

MOE_KINDS = ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe"]
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
_references: dict[str, list[list[int]]] = {}


def prompts(kind: str) -> list[list[int]]:
    return random_prompts(kind, [1, 5, 9, 17, 40])


def reference(kind: str, model_dir) -> list[list[int]]:
    if kind not in _references:
        _references[kind] = reference_greedy(model_dir, prompts(kind), NEW_TOKENS)
    return _references[kind]


# ---- routing and experts, against transformers' modules -------------------------------------------------

def _transformers_router(kind: str, config, weight: torch.Tensor):
    """transformers' own router module for ``kind`` with ``weight`` loaded."""
    if kind == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
    elif kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router
    else:
        from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter as Router
    router = Router(config)
    router.weight.data.copy_(weight)
    return router


@pytest.mark.parametrize("top_k", [1, 4])
@pytest.mark.parametrize("kind,router,norm", [("mixtral", "softmax_topk", True), ("qwen3_moe", "softmax_topk", False),
                                              ("qwen3_moe", "softmax_topk", True), ("granitemoe", "topk_softmax", True)])
def test_routing_equals_transformers(kind, router, norm, top_k):
    import transformers

    config_class = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
                    "granitemoe": transformers.GraniteMoeConfig}[kind]
    config = config_class(hidden_size=32, num_experts=16, num_local_experts=16, num_experts_per_tok=top_k,
                          norm_topk_prob=norm)
    torch.manual_seed(0)
    weight, x = torch.randn(16, 32), torch.randn(50, 32)
    *_, scores, ids = _transformers_router(kind, config, weight)(x)
    moe = MoEShape(num_experts=16, top_k=top_k, intermediate_size=8, router=router, renormalize=norm)
    got_weights, got_ids = route(x @ weight.T, moe)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_weights, scores.float(), rtol=1e-6, atol=1e-7)
    if norm:
        torch.testing.assert_close(got_weights.sum(-1), torch.ones(50))


def test_grouped_topk_keeps_the_best_groups_only():
    """DeepSeek V3's choice: experts outside each token's best group never win, however high their score."""
    moe = MoEShape(num_experts=8, top_k=2, intermediate_size=8, router="sigmoid_topk", num_groups=4, topk_groups=1,
                   routed_scaling=2.5)
    logits = torch.full((1, 8), -4.0)
    logits[0, 0] = 5.0   # the best single expert, alone in group 0 (its pair scores low)
    logits[0, 4], logits[0, 5] = 3.0, 3.0  # group 2: the best pair
    weights, ids = route(logits, moe)
    assert sorted(ids[0].tolist()) == [4, 5]
    torch.testing.assert_close(weights.sum(), torch.tensor(2.5))  # renormalised, then scaled
    bias = torch.zeros(8)
    bias[0] = bias[1] = 10.0  # the correction bias moves the choice, not the weights
    weights, ids = route(logits, moe, bias)
    assert sorted(ids[0].tolist()) == [0, 1]
    s = torch.sigmoid(logits[0, :2])
    torch.testing.assert_close(weights[0].sort().values, (2.5 * s / s.sum()).sort().values)


@pytest.mark.parametrize("activation,bias,on_input", [("silu", False, False), ("swiglu_clamped", True, False),
                                                      ("silu", False, True)])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_experts_equal_the_per_token_reference(activation, bias, on_input, tokens):
    torch.manual_seed(tokens)
    e, h, i, k = 8, 16, 12, 3
    moe = MoEShape(num_experts=e, top_k=k, intermediate_size=i, activation=activation)
    x = torch.randn(tokens, h)
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    b13, b2 = (torch.randn(e, 2 * i), torch.randn(e, h)) if bias else (None, None)
    weights, ids = route(torch.randn(tokens, e), moe)
    act = expert_activation(moe)
    expected = reference_experts(x, weights, ids, w13, w2, act, b13, b2, on_input)
    got = grouped_experts(x, weights, ids, w13, w2, act, 0, b13, b2, on_input)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # two expert-parallel halves, each with its own experts, sum to the whole
    halves = [grouped_experts(x, weights, ids, w13[s:s + 4], w2[s:s + 4], act, s,
                              None if b13 is None else b13[s:s + 4], None if b2 is None else b2[s:s + 4], on_input)
              for s in (0, 4)]
    torch.testing.assert_close(halves[0] + halves[1], expected, rtol=1e-5, atol=1e-5)


def test_clamped_swiglu_is_gpt_oss_formula():
    moe = MoEShape(num_experts=1, top_k=1, intermediate_size=2, activation="swiglu_clamped", swiglu_limit=7.0)
    gate_up = torch.tensor([[9.0, -1.0, 8.0, -9.0]])  # gate (9, -1), up (8, -9)
    gate, up = torch.tensor([7.0, -1.0]), torch.tensor([7.0, -7.0])
    expected = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    torch.testing.assert_close(expert_activation(moe)(gate_up)[0], expected)


# ---- whole models -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", MOE_KINDS)
def test_moe_family_greedy_equals_transformers(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)
    expected = reference(kind, model_dir)
    assert len(set(expected[-1])) > 5
    for engine_kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 16}):  # whole and chunked prefill
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        runner = llm.engine.runner
        assert runner.architecture.native and runner.decode_stack is None
        layers = runner.model.model.layers
        assert any(type(layer.mlp).__name__ == "SparseMoE" for layer in layers)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)]
        assert got == expected, engine_kwargs
        assert llm.stats()["kv_blocks_used"] == 0


def test_dense_and_sparse_layers_follow_the_config(model_dir_factory):
    """Qwen's mlp_only_layers=[1]: layer 1 is dense, 0 and 2 sparse; the shared expert and its gate exist."""
    llm = LLM(str(model_dir_factory("qwen2_moe")), dtype="float32")
    layers = llm.engine.runner.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoE", "MLP", "SparseMoE"]
    assert layers[0].mlp.shared_expert_gate.weight.shape == (1, 64)
    assert layers[0].mlp.experts.w13.shape == (8, 64, 64)  # 8 experts, gate and up rows of 32


@pytest.mark.parametrize("kind,expert_parallel", [("mixtral", False), ("mixtral", True), ("qwen3_moe", False),
                                                  ("qwen3_moe", True)])
def test_moe_tp2_and_ep2_equal_one_process(kind, expert_parallel, model_dir_factory):
    """Two gloo ranks: experts' columns split (TP), or whole experts per rank (EP) combined by an all-reduce."""
    model_dir = model_dir_factory(kind)
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             block_size=4, kv_cache_memory=4 << 20) as llm:
        stack = llm.engine.runner.model.model.layers[0].mlp.experts
        assert stack.w13.shape[0] == (4 if expert_parallel else 8)
        assert stack.w2.shape[2] == (64 if kind == "mixtral" else 32) // (1 if expert_parallel else 2)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts(kind), GREEDY)]
    assert got == reference(kind, model_dir)


def test_expert_parallel_needs_experts_divisible_by_the_ranks(model_dir_factory, tmp_path):
    from asyncllm.toy.checkpoints import build_checkpoint

    model_dir = build_checkpoint("mixtral", tmp_path / "m", num_local_experts=3)
    with pytest.raises(ConfigError, match="3 experts"):
        LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ConfigError, match="enable_expert_parallel must be a bool"):
        LLM(str(model_dir), dtype="float32", enable_expert_parallel="yes")


def test_lora_on_qwen3_moe_equals_peft_merged(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("qwen3_moe")
    merged = strong_peft_adapter(model_dir, ["q_proj", "v_proj", "o_proj"], tmp_path / "adapter", seed=3)
    expected = reference_greedy(model_dir, prompts("qwen3_moe"), NEW_TOKENS, model=merged)
    assert expected != reference("qwen3_moe", model_dir)
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    llm.add_lora("a", str(tmp_path / "adapter"))
    with_adapter = llm.generate(prompts("qwen3_moe"), GREEDY, lora="a")
    assert [o.outputs[0].token_ids for o in with_adapter] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts("qwen3_moe"), GREEDY)] == reference(
        "qwen3_moe", model_dir)


EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


# gpt-oss: experts stored [E, in, out], gate/up interleaved; Llama 4: [E, in, out] without transformers saying so
@pytest.mark.parametrize("kind", MOE_KINDS + ["gpt_oss", "llama4"])
def test_lora_on_the_experts_equals_peft_merged_in_one_mixed_batch(kind, model_dir_factory, tmp_path):
    """PEFT target_parameters on the stacked experts (each expert's own A/B pair), alone and with attention
    LoRA, of two ranks, and the base model, all in one batch: each prompt equal to its PEFT-merged model."""
    model_dir = model_dir_factory(kind)
    experts = strong_peft_adapter(model_dir, [], tmp_path / "experts", seed=5, parameters=EXPERT_PARAMETERS)
    both = strong_peft_adapter(model_dir, ["q_proj", "o_proj"], tmp_path / "both", seed=6,
                               parameters=["experts.down_proj"], rank=8)
    expected = {"experts": reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=experts),
                "both": reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=both), None: reference(kind, model_dir)}
    assert expected["experts"] != expected[None] and expected["both"] != expected[None]
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_loras=2, max_lora_rank=8)
    llm.add_lora("experts", str(tmp_path / "experts"))
    llm.add_lora("both", str(tmp_path / "both"))
    order = [(i, name) for i in range(len(prompts(kind))) for name in ("experts", None, "both")]
    outs = llm.generate([prompts(kind)[i] for i, _ in order], GREEDY, lora=[name for _, name in order])
    assert [o.outputs[0].token_ids for o in outs] == [expected[name][i] for i, name in order]
    llm.close()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_lora_on_the_experts_under_tp2_and_ep2_equals_peft_merged(expert_parallel, model_dir_factory, tmp_path):
    """Each rank takes its share of the whole-model expert LoRA (TP: its columns; EP: its experts)."""
    model_dir = model_dir_factory("qwen3_moe")
    merged = strong_peft_adapter(model_dir, ["v_proj"], tmp_path / "a", seed=7, parameters=EXPERT_PARAMETERS)
    expected = reference_greedy(model_dir, prompts("qwen3_moe"), NEW_TOKENS, model=merged)
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             block_size=4, kv_cache_memory=4 << 20) as llm:
        llm.add_lora("a", str(tmp_path / "a"))
        got = [o.outputs[0].token_ids for o in llm.generate(prompts("qwen3_moe"), GREEDY, lora="a")]
    assert got == expected


def test_lora_on_int8_experts_equals_float32_on_the_rounded_checkpoint(model_dir_factory, tmp_path):
    """quantization="int8" experts take the adapter's delta on top of their rounded weights."""
    from test_model_sources import _rounded_checkpoint

    model_dir = model_dir_factory("qwen3_moe")
    strong_peft_adapter(model_dir, [], tmp_path / "a", seed=8, parameters=EXPERT_PARAMETERS)
    rounded = LLM(str(_rounded_checkpoint(model_dir, tmp_path / "rounded")), dtype="float32")
    int8 = LLM(str(model_dir), dtype="float32", quantization="int8")
    for llm in (rounded, int8):
        llm.add_lora("a", str(tmp_path / "a"))
    runs = [[o.outputs[0].token_ids for o in llm.generate(prompts("qwen3_moe"), GREEDY, lora="a")] for llm in (rounded, int8)]
    assert runs[0] == runs[1]
    assert runs[1] != [o.outputs[0].token_ids for o in int8.generate(prompts("qwen3_moe"), GREEDY)]


def test_bad_expert_adapters_are_refused_by_name(model_dir_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = model_dir_factory("qwen3_moe")
    adapter = tmp_path / "a"
    strong_peft_adapter(model_dir, [], adapter, seed=9, parameters=EXPERT_PARAMETERS)
    llm = LLM(str(model_dir), dtype="float32")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["mlp.gate.weight"]}))
    with pytest.raises(LoRAError, match=r"mlp\.gate\.weight.*experts\.gate_up_proj"):
        llm.add_lora("a", str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("layers.0.mlp.experts.lora_A.weight"))
    save_file({**tensors, key: tensors[key][:, :5].contiguous()}, adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match=r"layer 0 has expert LoRA tensors A \(32, 5\)"):
        llm.add_lora("a", str(adapter))
    save_file({k: v for k, v in tensors.items() if not k.endswith("layers.0.mlp.experts.lora_B.weight")},
              adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="layer 0 experts lack lora_B"):
        llm.add_lora("a", str(adapter))
    save_file({k.replace("layers.0.", "layers.1."): v for k, v in tensors.items()}, adapter / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="layer 1, which has no experts"):  # Qwen3-MoE's toy layer 1 is dense
        llm.add_lora("a", str(adapter))
    dense = LLM(str(model_dir_factory("llama")), dtype="float32")
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": EXPERT_PARAMETERS}))
    with pytest.raises(LoRAError, match="cannot take LoRA on: experts.gate_up_proj, experts.down_proj.*none on this"):
        dense.add_lora("a", str(adapter))


def test_lora_on_experts_is_refused_by_name(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("qwen3_moe")
    adapter = tmp_path / "experts"
    strong_peft_adapter(model_dir, ["q_proj"], adapter, seed=1)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "gate_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    llm = LLM(str(model_dir), dtype="float32")
    with pytest.raises(LoRAError, match="gate_proj"):
        llm.add_lora("experts", str(adapter))


def _config_and_tokenizer_copy(source, target):
    """``target``: a new directory holding every file of checkpoint ``source`` but its weights."""
    target.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (target / f.name).write_bytes(f.read_bytes())
    return target


def test_stacked_expert_tensors_load_like_per_expert_ones(model_dir_factory, tmp_path):
    """The same Mixtral weights saved stacked ([E, H, 2I] gate_up_proj, [E, I, H] down_proj, as Llama 4 and
    gpt-oss checkpoints store experts) give the same tokens; a wrong stack is refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    source = model_dir_factory("mixtral")
    target = _config_and_tokenizer_copy(source, tmp_path / "stacked")
    tensors = load_file(source / "model.safetensors")
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        gate = torch.stack([tensors[f"{p}.{e}.w1.weight"] for e in range(8)])
        up = torch.stack([tensors[f"{p}.{e}.w3.weight"] for e in range(8)])
        down = torch.stack([tensors[f"{p}.{e}.w2.weight"] for e in range(8)])
        out[f"{p}.gate_up_proj"] = torch.cat([gate, up], dim=1).transpose(1, 2).contiguous()
        out[f"{p}.down_proj"] = down.transpose(1, 2).contiguous()
    save_file(out, target / "model.safetensors")
    llm = LLM(str(target), dtype="float32")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts("mixtral"), GREEDY)] == reference("mixtral", source)
    llm.close()
    out["model.layers.0.block_sparse_moe.experts.down_proj"] = out["model.layers.0.block_sparse_moe.experts.down_proj"][:7]
    save_file(out, target / "model.safetensors")
    with pytest.raises(ModelLoadError, match="experts.down_proj.*8 experts"):
        LLM(str(target), dtype="float32")


def test_a_missing_expert_is_named(model_dir_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    source = model_dir_factory("qwen3_moe")
    target = _config_and_tokenizer_copy(source, tmp_path / "missing")
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model.layers.2.mlp.experts.5.up"):
        LLM(str(target), dtype="float32")


def test_int8_experts_equal_float32_on_rounded_weights(model_dir_factory, tmp_path):
    """quantization="int8": the experts are int8 rows too (4x smaller), and the model computes what float32
    computes on the checkpoint rounded to int8 and back."""
    from test_model_sources import _rounded_checkpoint

    model_dir = model_dir_factory("qwen3_moe")
    int8 = LLM(str(model_dir), dtype="float32", quantization="int8")
    stack = int8.engine.runner.model.model.layers[0].mlp.experts
    assert stack.w13 is None and stack.w13_int8.qweight.dtype == torch.int8
    assert stack.w13_int8.qweight.shape == (8, 64, 64) and stack.w13_int8.scales.shape == (8, 64, 1)
    rounded = LLM(str(_rounded_checkpoint(model_dir, tmp_path / "rounded")), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    for got, expected in zip(int8.generate(prompts("qwen3_moe"), params), rounded.generate(prompts("qwen3_moe"), params)):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        assert got.outputs[0].cumulative_logprob == pytest.approx(expected.outputs[0].cumulative_logprob, abs=1e-3)


def test_quantized_expert_tensors_without_a_quantization_config_are_refused_by_name(model_dir_factory, tmp_path):
    """FP8 or GPTQ expert tensors in a checkpoint that does not say it is quantized are not loaded as if they were
    float: the load stops naming the tensor (quantized checkpoints: test_quantized_models.py)."""
    from safetensors.torch import load_file, save_file

    source = model_dir_factory("mixtral")
    for label, change in [("fp8", lambda t, k: {k: t[k].to(torch.float8_e4m3fn)}),
                          ("gptq", lambda t, k: {k.replace(".weight", ".qweight"): t[k].to(torch.int32)})]:
        target = _config_and_tokenizer_copy(source, tmp_path / label)
        tensors = load_file(source / "model.safetensors")
        key = "model.layers.0.block_sparse_moe.experts.1.w1.weight"
        replacement = change(tensors, key)
        del tensors[key]
        tensors.update(replacement)
        save_file(tensors, target / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"experts\.1\.w1.*a quantized expert tensor, but config.json has no"):
            LLM(str(target), dtype="float32")


def test_lora_experts_of_a_rank_no_token_chose_give_zeros():
    """Expert parallel: when every token routes to the other rank's experts, this rank's LoRA expert pass adds
    nothing (it once raised in index_add_ on the empty result)."""
    from types import SimpleNamespace

    from asyncllm.model.moe_lora import experts_with_lora

    def untouched(*_):
        raise AssertionError("no expert of this rank should run")

    stack = SimpleNamespace(first_expert=4, local_experts=4, project_gate_up=untouched, project_down=untouched,
                            activation=untouched, moe=SimpleNamespace(weights_on_input=False))
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])  # experts 0-3 only: the other rank's
    out = experts_with_lora(stack, x, torch.full((5, 2), 0.5), ids, torch.zeros(5, dtype=torch.int64), {})
    assert out.shape == x.shape and torch.equal(out, torch.zeros_like(x))
