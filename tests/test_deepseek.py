"""DeepSeek V2 and V3 (model/deepseek.py, model/mla.py): greedy output equal to transformers on tiny checkpoints
(whole and chunked prefill, the CPU and torch attention backends, prefix-cache hits), a paged cache holding one
latent plus rope key per token and layer, routing equal to transformers' routers, and configs refused by key."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from asyncllm import LLM, SamplingParams
from asyncllm.errors import LoRAError, ModelLoadError
from asyncllm.model.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from asyncllm.model.moe import route
from checkpoints import load_reference_model, random_prompts, reference_greedy, strong_peft_adapter

KINDS = ["deepseek_v2", "deepseek_v3"]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
CACHE_DIM = 32 + 8  # kv_lora_rank + qk_rope_head_dim of the toy checkpoints
_references: dict[str, list[list[int]]] = {}


def prompts(kind: str) -> list[list[int]]:
    return random_prompts(kind, [1, 6, 17, 40])


def reference(kind: str, model_dir) -> list[list[int]]:
    if kind not in _references:
        _references[kind] = reference_greedy(model_dir, prompts(kind), NEW_TOKENS)
    return _references[kind]


def _tokens(llm: LLM, prompt_list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompt_list, GREEDY)]


# ---- whole models -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_deepseek_greedy_equals_transformers(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)
    expected = reference(kind, model_dir)
    assert len(set(expected[-1])) > 5
    for engine_kwargs in ({}, {"block_size": 4, "max_num_batched_tokens": 16},  # whole and chunked prefill
                          {"block_size": 4, "attention_backend": "torch"}):
        llm = LLM(str(model_dir), dtype="float32", **engine_kwargs)
        runner = llm.engine.runner
        assert runner.architecture.native and runner.decode_stack is None
        assert [type(layer.mlp).__name__ for layer in runner.model.model.layers] == ["MLP", "SparseMoE", "SparseMoE"]
        assert _tokens(llm, prompts(kind)) == expected, engine_kwargs
        assert llm.stats()["kv_blocks_used"] == 0
        llm.close()


def test_v3_rotate_half_rope_and_one_query_projection(model_dir_factory):
    """rope_interleave=False (the halves rotate), plain rope (no yarn mscale), q_proj instead of the q bottleneck."""
    model_dir = model_dir_factory("deepseek_v3", rope_interleave=False, q_lora_rank=None,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    expected = reference_greedy(model_dir, prompts("deepseek_v3")[1:3], NEW_TOKENS)
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    attention = llm.engine.runner.model.model.layers[0].self_attn
    assert hasattr(attention, "q_proj") and not attention.rotary.interleaved
    assert attention.scale == 24 ** -0.5
    assert _tokens(llm, prompts("deepseek_v3")[1:3]) == expected


def test_cache_holds_the_latent_and_rope_key(model_dir_factory):
    """One tensor per layer, both K and V: [blocks, block_size, 1, kv_lora_rank + rope], holding exactly
    transformers' cached latent (normed) and rotated rope key; the KV budget counts it once: a quarter of the
    bytes per block that full per-head K and V (4 heads x (24 + 16) values) would take."""
    model_dir = model_dir_factory("deepseek_v2")
    budget = 1 << 20
    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=budget)
    runner = llm.engine.runner
    blocks = budget // (3 * 4 * CACHE_DIM * 4)  # layers * block_size * values * float32 bytes
    assert runner.bytes_per_block == 3 * 4 * CACHE_DIM * 4 and runner.num_blocks == blocks
    assert llm.stats()["kv_blocks_total"] == blocks
    assert 3 * 4 * 4 * (24 + 16) * 4 == 4 * runner.bytes_per_block  # full K and V per head, per block
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache is v_cache and k_cache.shape == (blocks, 4, 1, CACHE_DIM)
    prompt = prompts("deepseek_v2")[2]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # the prompt's tokens only are cached
    model = load_reference_model(model_dir)
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prompt]), use_cache=True, cache=cache)
    for layer, (k_cache, _) in enumerate(runner.kv_caches):
        rows = k_cache.view(-1, CACHE_DIM)
        written = rows[rows.abs().sum(-1) > 0]
        assert written.shape[0] == len(prompt)
        expected = torch.cat([cache.layers[layer].keys[0, 0], cache.layers[layer].values[0, 0]], dim=-1)
        distance = (written[None, :, :] - expected[:, None, :]).abs().amax(-1).amin(-1)  # nearest written row
        assert float(distance.max()) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_hits_stay_exact(kind, model_dir_factory):
    model_dir = model_dir_factory(kind)
    base = prompts(kind)[-1]
    second = base[:24] + random_prompts(kind + "-tail", [5])[0]  # 6 cached blocks of 4, then new tokens
    llm = LLM(str(model_dir), dtype="float32", block_size=4)
    assert _tokens(llm, [base]) == reference(kind, model_dir)[-1:]
    (out,) = llm.generate([second], GREEDY)
    assert out.metrics.num_cached_tokens == 24 and llm.stats()["prefix_cache_hits"] >= 1
    assert out.outputs[0].token_ids == reference_greedy(model_dir, [second], NEW_TOKENS)[0]
    assert llm.stats()["kv_blocks_used"] == 0


def test_multi_token_prediction_layers_are_not_loaded(model_dir_factory, tmp_path):
    from safetensors.torch import save_file

    source = model_dir_factory("deepseek_v3")
    target = tmp_path / "mtp"
    shutil.copytree(source, target)
    save_file({"model.layers.3.eh_proj.weight": torch.ones(64, 128),
               "model.layers.3.self_attn.kv_b_proj.weight": torch.ones(128, 32)}, target / "mtp.safetensors")
    llm = LLM(str(target), dtype="float32")
    assert _tokens(llm, prompts("deepseek_v3")[1:2]) == reference("deepseek_v3", source)[1:2]
    llm.close()
    save_file({"model.layers.2.eh_proj.weight": torch.ones(64, 128)}, target / "mtp.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.2.eh_proj.weight"):
        LLM(str(target), dtype="float32")


@pytest.mark.parametrize("name", ["torch", "cpu", "triton"])
def test_backends_attend_over_one_latent_cache(name):
    """Every paged backend runs latent attention as MQA: the one cache tensor given as K and V cache, head_dim
    kv_lora_rank + rope (40: not a power of two), the output's first kv_lora_rank dims kept."""
    from asyncllm.kernels.cpu_attention import CpuAttentionBackend, cpu_kernels_available
    from asyncllm.kernels.torch_attention import TorchAttentionBackend
    from kernel_cases import DEVICE, paged_batch

    if name == "cpu" and (DEVICE.type != "cpu" or not cpu_kernels_available()):
        pytest.skip("the C kernels run on CPU")
    if name == "triton":
        from asyncllm.kernels.triton_attention import AttentionTuning, TritonAttentionBackend

        backend = TritonAttentionBackend(4, 1, AttentionTuning(tile_n=16, prefill_block_m=16, num_sms=4))
    else:
        backend = TorchAttentionBackend() if name == "torch" else CpuAttentionBackend()
    device = DEVICE if name == "triton" else torch.device("cpu")
    specs = [(0, 1), (13, 1), (0, 11), (9, 6), (30, 1)]  # decodes, a prefill, a chunk after cached blocks
    batch = paged_batch(specs, 4, 1, CACHE_DIM, 4, torch.float32, seed=5)
    meta = batch.meta()
    for field in ("slot_mapping", "block_tables", "seq_lens_tensor", "query_start_tensor"):
        setattr(meta, field, getattr(meta, field).to(device))
    cache, query, entry = batch.k_cache.to(device), batch.query.to(device), batch.key.to(device)
    backend.prepare(meta)
    backend.write_kv(entry, entry, cache, cache, meta)
    scale = 24 ** -0.5
    out = backend.forward(query, cache, cache, meta, scale)[..., :32].cpu()
    cache, query = cache.cpu(), query.cpu()
    for i, (cached, new) in enumerate(specs):  # dense attention per sequence over the blocks it was given
        keys = cache[torch.tensor(batch.block_tables[i])].reshape(-1, CACHE_DIM)[:cached + new]
        q = query[meta.query_start[i]:meta.query_start[i + 1]]                # [new, heads, dim]
        scores = torch.einsum("thd,kd->htk", q, keys) * scale
        visible = torch.arange(cached + new)[None, :] <= torch.arange(cached, cached + new)[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        expected = torch.einsum("htk,kd->thd", probs, keys[:, :32])
        torch.testing.assert_close(out[meta.query_start[i]:meta.query_start[i + 1]], expected,
                                   atol=2e-5, rtol=2e-5)


def test_v3_tensor_parallel_splits_heads_and_replicates_the_latent(model_dir_factory):
    """Two gloo ranks: each keeps 2 of the 4 heads (q_b_proj rows, kv_b_proj heads, o_proj columns) and the
    whole latent cache; the tokens are transformers'."""
    model_dir = model_dir_factory("deepseek_v3")
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, block_size=4, kv_cache_memory=1 << 20) as llm:
        runner = llm.engine.runner
        attention = runner.model.model.layers[0].self_attn
        assert attention.kv_b_proj.weight.shape == (2, 32, 32) and attention.q_b_proj.weight.shape == (2 * 24, 32)
        assert runner.kv_caches[0][0].shape[2:] == (1, CACHE_DIM)
        assert _tokens(llm, prompts("deepseek_v3")) == reference("deepseek_v3", model_dir)


# ---- LoRA -------------------------------------------------------------------------------------------------------

LATENT_TARGETS = {"deepseek_v2": ["q_proj", "kv_a_proj_with_mqa", "o_proj"],
                  "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_lora_on_the_latent_attention_and_the_experts_equals_peft_merged(kind, tp, model_dir_factory, tmp_path):
    """An adapter on every LoRA-able latent projection (before the latent norms) and on the routed experts; under
    TP=2 each rank takes its heads' rows of the query's B and columns of o_proj's A."""
    model_dir = model_dir_factory(kind)
    merged = strong_peft_adapter(model_dir, LATENT_TARGETS[kind], tmp_path / "a", seed=11,
                                 parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    expected = reference_greedy(model_dir, prompts(kind), NEW_TOKENS, model=merged)
    assert expected != reference(kind, model_dir)
    with LLM(str(model_dir), dtype="float32", block_size=4, tensor_parallel_size=tp, kv_cache_memory=1 << 20) as llm:
        llm.add_lora("a", str(tmp_path / "a"))
        outs = llm.generate(prompts(kind) * 2, GREEDY, lora=["a"] * len(prompts(kind)) + [None] * len(prompts(kind)))
    assert [o.outputs[0].token_ids for o in outs] == expected + reference(kind, model_dir)


def test_lora_on_kv_b_proj_is_refused_by_name(model_dir_factory, tmp_path):
    model_dir = model_dir_factory("deepseek_v3")
    strong_peft_adapter(model_dir, ["kv_b_proj"], tmp_path / "a", seed=12)
    with LLM(str(model_dir), dtype="float32") as llm:
        with pytest.raises(LoRAError, match="kv_b_proj.*supported: q_proj, q_a_proj, q_b_proj, kv_a_proj_with_mqa"):
            llm.add_lora("a", str(tmp_path / "a"))


# ---- routing, against transformers' routers -----------------------------------------------------------------

@pytest.mark.parametrize("top_k", [1, 3])
def test_v3_routing_equals_transformers(top_k):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=top_k, n_group=4,
                              topk_group=1, routed_scaling_factor=2.5)
    torch.manual_seed(top_k)
    router = DeepseekV3TopkRouter(config)
    router.weight.data.normal_()
    # mostly negative choices: the experts of dropped groups must still lose to them (-inf, not zero)
    router.e_score_correction_bias.normal_(-1.0, 0.3)
    x = torch.randn(64, 32)
    _, weights, ids = router(x)
    got_weights, got_ids = route(F.linear(x, router.weight), DeepseekV3ForCausalLM.read_moe(config),
                                 router.e_score_correction_bias)
    order, got_order = ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(got_order.values, order.values)
    torch.testing.assert_close(got_weights.gather(1, got_order.indices), weights.gather(1, order.indices))


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_equals_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                              topk_method=method, routed_scaling_factor=1.5)
    torch.manual_seed(0)
    router = DeepseekV2TopkRouter(config)
    router.weight.data.normal_()
    x = torch.randn(64, 32)
    _, weights, ids = router(x)
    got_weights, got_ids = route(F.linear(x, router.weight), DeepseekV2ForCausalLM.read_moe(config))
    order, got_order = ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(got_order.values, order.values)
    torch.testing.assert_close(got_weights.gather(1, got_order.indices), weights.gather(1, order.indices))


# ---- configs refused by key ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,overrides,key", [
    (DeepseekV2ForCausalLM, dict(topk_method="noaux_tc"), "topk_method"),
    (DeepseekV2ForCausalLM, dict(norm_topk_prob=True), "norm_topk_prob"),
    (DeepseekV2ForCausalLM, dict(topk_method="group_limited_greedy", n_group=8, topk_group=1), "topk_group"),
    (DeepseekV2ForCausalLM, dict(moe_layer_freq=2), "moe_layer_freq"),
    (DeepseekV3ForCausalLM, dict(n_group=3), "n_group"),
    (DeepseekV3ForCausalLM, dict(n_group=8), "n_group"),
    (DeepseekV3ForCausalLM, dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "rope_parameters.rope_type"),
])
def test_unsupported_configs_are_refused_by_key(cls, overrides, key):
    import transformers

    config_class = transformers.DeepseekV2Config if cls is DeepseekV2ForCausalLM else transformers.DeepseekV3Config
    config = config_class(hidden_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    for name, value in overrides.items():
        setattr(config, name, value)
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.")):
        cls.check_config(config)
