"""Tiny random-weight Hugging Face checkpoints (Llama, Qwen2, Qwen3, Mistral) built on the spot.

Weights are drawn larger than transformers' default init so next-token distributions are peaked,
like a trained model's: greedy text is varied and float32 parity tests are not decided by near-ties.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

import torch

from .tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, MODEL_VOCAB_SIZE, PAD_TOKEN_ID, build_tokenizer

# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------

KINDS = ("llama", "qwen2", "qwen3", "mistral")
EXTRA_KINDS = ("phi3",)  # built on request (fused-checkpoint families), not part of every suite

# The other families, built on request: kind -> (transformers config class, model class, config arguments).
# Windows and rope limits are small so that the tests' short sequences cross them.
_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0],
             "original_max_position_embeddings": 32}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama_bias": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "llama_dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})),
    "llama_longrope": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, rope_parameters={**_LONGROPE, "partial_rotary_factor": 1.0,
                                                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0, 2.4],
                                                "long_factor": [1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]})),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(
        num_key_value_heads=2, sliding_window=None, rope_parameters=_LONGROPE, tie_word_embeddings=True,
        original_max_position_embeddings=32)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=1, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, tie_word_embeddings=False,
        attn_logit_softcapping=30.0, final_logit_softcapping=40.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=3,
        tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}})),
    # Gemma 3 as llama.cpp lays it out: six layers, every sixth global (its fixed pattern), local rope base 10000
    "gemma3_6": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
        tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0}})),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(
        num_key_value_heads=2, embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.6,
        logits_scaling=2.0)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(
        num_key_value_heads=2, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2, logit_scale=0.5)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(num_key_value_heads=2, attention_bias=True)),
    # mixture-of-experts families (model/moe.py): 8 experts, top-2, on 3 layers so dense and sparse layers mix
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2, num_local_experts=8,
                                                            num_experts_per_tok=2, intermediate_size=64)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, head_dim=16)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
        embedding_multiplier=6.0, attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.0)),
    # DeepSeek (model/deepseek.py): multi-head latent attention, a dense first layer, then 8 routed experts (top-2,
    # group-limited) and a shared one; V3 with a query low-rank projection, sigmoid routing and yarn rope
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                         "beta_slow": 1})),
    # Llama 4 (model/llama4.py): layers 0-2 rope with chunked attention (chunks of 8) and weightless q/k norms, layer
    # 3 NoPE with temperature tuning (floor_scale 4, so short prompts feel it); layers 1 and 3 sparse (4 experts, top-1,
    # a shared expert), 0 and 2 dense with intermediate_size_mlp
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=96,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8,
        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # gpt-oss (model/gpt_oss.py): attention sinks, layers alternating a window of 8 and full attention, 4 experts
    # (top-2) with biases, interleaved gate/up columns and a low swiglu_limit so the clamps bite; yarn rope
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], swiglu_limit=3.0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})),
    # architectures without a native file: they run through transformers' modules (model/transformers_backend.py)
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(num_key_value_heads=2, sliding_window=None)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.5, tie_word_embeddings=False)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_head=4, n_layer=2, n_positions=512, rotary_dim=8)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=64, n_head=4, n_layer=2, n_positions=512,
                                                                      multi_query=True)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(num_key_value_heads=2, sliding_window=8,
                                                            layer_types=["sliding_attention", "full_attention"])),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(num_key_value_heads=2, sliding_window=8)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(num_key_value_heads=2)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(num_key_value_heads=4, partial_rotary_factor=0.5)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(num_key_value_heads=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_head=4, n_layer=2, n_positions=512)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(num_key_value_heads=2, sliding_window=8,
                                                           sliding_window_pattern=2)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(num_key_value_heads=2)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict()),
}
TRANSFORMERS_BACKEND_KINDS = ("starcoder2", "gpt_neox", "gptj", "gpt_bigcode", "phi", "olmo", "gpt2", "exaone4",
                              "nemotron", "persimmon", "opt", "cohere2", "olmo3", "ernie4_5")

# Weight std for all matrices / embeddings, and the extra factor on the final
# norm weight (= logit temperature). Chosen so greedy text is varied and the
# top-1 logit is clearly separated (see _reinit_peaked).
INIT_STD = 0.25
LOGIT_SCALE = 3.0

_COMMON: dict[str, Any] = dict(
    vocab_size=MODEL_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
    dtype="float32",
)


def _config(kind: str, overrides: dict[str, Any]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        cls = LlamaConfig
        kw = dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            # transformers 5: `rope_parameters` (rope_theta lives inside it)
            # replaces the old top-level rope_theta + rope_scaling.
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    elif kind == "qwen2":
        cls = Qwen2Config
        kw = dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    elif kind == "qwen3":
        cls = Qwen3Config
        kw = dict(
            head_dim=32,  # 4 * 32 = 128 != hidden_size 64
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    elif kind == "mistral":
        cls = MistralConfig
        kw = dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif kind == "phi3":
        from transformers import Phi3Config

        cls = Phi3Config
        kw = dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        )
    elif kind in FAMILIES:
        import transformers

        config_class, _, kw = FAMILIES[kind]
        cls = getattr(transformers, config_class)
    else:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {KINDS + EXTRA_KINDS + tuple(FAMILIES)}")
    args = {**_COMMON, **kw, **overrides}
    return cls(**args)


def _model_class(kind: str):
    import transformers

    if kind in FAMILIES:
        return getattr(transformers, FAMILIES[kind][1])
    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "phi3": transformers.Phi3ForCausalLM,
    }[kind]


@torch.no_grad()
def _reinit_peaked(model: torch.nn.Module, seed: int, std: float, logit_scale: float) -> None:
    """Re-initialise with larger weights so next-token logits are peaked.

    Default HF init (std 0.02) gives near-uniform logits and degenerate,
    repetitive greedy text. Here: matrices ~N(0, std), norm weights
    1 + 0.1*randn, biases ~N(0, 0.1); the final norm weight is additionally
    multiplied by ``logit_scale`` (works for tied and untied heads alike), so
    the next-token distribution has a clear winner like a trained model's.
    """
    gen = torch.Generator().manual_seed(seed)
    # Gemma's norms scale by (1 + weight): centre their weights on 0 so the scale is still about 1
    norm_centre = 0.0 if getattr(model.config, "model_type", "").startswith("gemma") else 1.0
    for name, p in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):
            p.copy_(norm_centre + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():  # DeepSeek V3's routing bias is a saved buffer: make it matter
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    final = _final_norm(model)
    if final is None:  # a final norm without weights (OLMo): scale the LM head instead
        model.get_output_embeddings().weight.mul_(logit_scale)
    elif norm_centre == 0.0:
        final.weight.copy_(logit_scale * (1.0 + final.weight) - 1.0)
    else:
        final.weight.mul_(logit_scale)
    if final is not None and getattr(final, "bias", None) is not None:
        final.bias.mul_(logit_scale)


def _final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The norm before the LM head: the last norm module with weights outside the layer stack."""
    found = None
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        if ("norm" in last or last == "ln_f") and not any(part.isdigit() for part in name.split(".")) \
                and getattr(module, "weight", None) is not None:
            found = module
    return found


def build_checkpoint(
    kind: str,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    *,
    sharded: bool = False,
    max_shard_size: str = "100KB",
    seed: int = 0,
    init_std: float = INIT_STD,
    logit_scale: float = LOGIT_SCALE,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight ``kind`` checkpoint (+ tokenizer) to ``out_dir``.

    ``overrides`` go into the transformers config (e.g. ``num_hidden_layers=3``,
    ``vocab_size=1100``). ``sharded=True`` saves with a small ``max_shard_size``
    so that ``model.safetensors.index.json`` and several shards are written.
    Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(kind, overrides)
    torch.manual_seed(seed)
    model = _model_class(kind)(config)
    model = model.to(torch.float32).eval()
    _reinit_peaked(model, seed=seed, std=init_std, logit_scale=logit_scale)
    with _quiet_progress_bars():
        # transformers 5 always writes safetensors (no safe_serialization arg).
        if sharded:
            model.save_pretrained(out_dir, max_shard_size=max_shard_size)
        else:
            model.save_pretrained(out_dir)

    if tokenizer_dir is not None:
        # Copy the files verbatim (a load + save_pretrained round trip in
        # transformers 5 adds junk such as "is_local" to tokenizer_config.json).
        for f in sorted(Path(tokenizer_dir).iterdir()):
            if f.is_file():
                shutil.copy2(f, out_dir / f.name)
    else:
        build_tokenizer(out_dir)
    return out_dir


@contextlib.contextmanager
def _quiet_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


DEMO_OVERRIDES: dict[str, Any] = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)


def default_demo_dir() -> Path:
    """Where the demo model is cached: ``$ASYNCLLM_CACHE`` or ``~/.cache/asyncllm``."""
    import os

    root = os.environ.get("ASYNCLLM_CACHE") or Path.home() / ".cache" / "asyncllm"
    return Path(root) / "demo-llama"


def build_demo_model(out_dir: Path | None = None) -> Path:
    """The embedded default model: a small random-weight Llama with the local tokenizer, built once.

    Its text is random: it exists to show the engine working, not to say anything."""
    out_dir = Path(out_dir) if out_dir is not None else default_demo_dir()
    marker = out_dir / ".complete"
    if not marker.exists():
        build_checkpoint("llama", out_dir, **DEMO_OVERRIDES)
        marker.write_text("ok\n")
    return out_dir
