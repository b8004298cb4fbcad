"""``DecoderShape``: the architecture facts every layer needs, read from a transformers config.

Its own module, free of torch modules, so that the model, the loader and the LoRA loader all import
it without cycles. The first block of fields is what every decoder has (sizes, heads); the second
are the ways the families in ``model/`` differ from Llama, each with Llama's value as its default,
so a family file says only what is different about it (``model/decoder.py`` reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# how a layer wires its norms around attention and MLP (model/decoder.py, DecoderLayer)
LAYOUTS = ("pre", "sandwich", "post", "parallel")
# how a mixture-of-experts router turns its logits into each token's experts and weights (model/moe.py)
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "topk_sigmoid")


@dataclass(frozen=True)
class MoEShape:
    """A sparse mixture-of-experts MLP: its experts, its router and its shared expert (model/moe.py).

    Defaults are Mixtral's: softmax over every expert's logit, the top ``top_k`` kept and renormalised
    to sum to one, SiLU-gated experts, no shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int               # one expert's (the whole model's; a TP rank holds a share)
    router: str = "softmax_topk"         # one of ROUTERS: softmax/sigmoid before or after the top-k choice
    renormalize: bool = True             # the chosen weights divided by their sum (norm_topk_prob)
    router_bias: bool = False            # the router projection has a bias (gpt-oss)
    score_correction_bias: bool = False  # a per-expert bias added for the choice only (DeepSeek V3)
    num_groups: int = 1                  # grouped top-k: experts in groups, the best ``topk_groups`` groups kept
    topk_groups: int = 1
    routed_scaling: float = 1.0          # routed experts' sum times this (DeepSeek routed_scaling_factor)
    weights_on_input: bool = False       # the routing weight scales the expert's input, not its output (Llama 4)
    activation: str = "silu"             # "silu" (SwiGLU) or "swiglu_clamped" (gpt-oss: clamped, alpha, +1)
    expert_bias: bool = False            # biases on the experts' projections (gpt-oss)
    swiglu_alpha: float = 1.702          # gpt-oss's clamped SwiGLU constants
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0    # a shared expert every token goes through (0: none)
    shared_gate: bool = False            # the shared expert's output times sigmoid(a learnt gate) (Qwen2-MoE)
    gate_up_interleaved: bool = False    # stacked checkpoint gate/up columns alternate (gpt-oss) instead of halves


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek V2/V3, model/mla.py): keys and values come from one compressed
    latent per token, which is what the paged cache holds (with the token's rotated rope key)."""

    q_lora_rank: int | None   # the query's low-rank bottleneck (None: one q_proj)
    kv_lora_rank: int         # the latent's width
    qk_nope_head_dim: int     # per head: the query/key dimensions without rope
    qk_rope_head_dim: int     # per head: the rope dimensions (one rope key shared by every head)
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values per token and layer in the cache: the normed latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class DecoderShape:
    """The architecture facts the decoder needs, read from a transformers config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_norm: bool | str  # False; "head" (one norm per head: Qwen3, Gemma 3) or "full" (over all heads: OLMo 2)
    tie_word_embeddings: bool
    architecture: str = "LlamaForCausalLM"  # the registry entry (model/registry.py) it was read for
    # ---- how a family differs from Llama (defaults: Llama) ----
    o_bias: bool = False                 # bias on o_proj (Llama with attention_bias)
    mlp_bias: bool = False               # biases on gate/up/down (Llama with mlp_bias)
    norm: str = "rms"                    # "rms", or "layer" (LayerNorm without bias: Cohere)
    norm_offset: bool = False            # the norm scales by (1 + weight) (Gemma): folded into the weight at load
    layout: str = "pre"                  # one of LAYOUTS
    activation: str = "silu"             # gated MLP activation: "silu", "gelu_tanh", "gelu"
    embedding_scale: float = 1.0         # embeddings times this (Gemma: sqrt(hidden); Granite)
    residual_scale: float = 1.0          # attention and MLP outputs times this before the residual (Granite)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None    # tanh soft-capping of attention scores (Gemma 2)
    attn_sinks: bool = False             # a learnt per-head logit joins each softmax's denominator (gpt-oss)
    final_softcap: float | None = None   # tanh soft-capping of the logits (Gemma 2)
    logit_scale: float = 1.0             # logits times this (Cohere)
    logit_divisor: float = 1.0           # logits divided by this (Granite's logits_scaling)
    layer_windows: tuple = ()            # per layer: sliding-window size or None (global); () = all global
    layer_chunks: tuple = ()             # per layer: attention chunk size or None; a token at position p sees only
                                         # positions floor(p / C) * C .. p (Llama 4's chunked layers); () = none
    rope_layers: tuple = ()              # per layer: False where the layer has no rope (SmolLM3); () = all rope
    moe: MoEShape | None = None          # the sparse MLP of mixture-of-experts models (model/moe.py)
    moe_layers: tuple = ()               # per layer: True where the MLP is sparse; () = every layer when moe is set
    mla: MLAShape | None = None          # latent attention (DeepSeek): num_kv_heads is 1, head_dim its cache_dim
    vision: Any = None                   # a vision-language model's VisionSpec (model/llava.py); None: text only

    @classmethod
    def from_hf_config(cls, config) -> "DecoderShape":
        """The shape of ``config``, as its family reads it (model/registry.py)."""
        from .registry import architecture_for

        return architecture_for(config).model_class().read_shape(config)

    @classmethod
    def llama_fields(cls, config, architecture: str) -> "DecoderShape":
        """The fields every Llama-like config has, read the way Llama reads them."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", 1e-6),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=False,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            architecture=architecture,
        )

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def chunk(self, layer: int) -> int | None:
        return self.layer_chunks[layer] if self.layer_chunks else None

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is the sparse mixture of experts (else the dense ``intermediate_size``)."""
        if self.moe is None:
            return False
        return bool(self.moe_layers[layer]) if self.moe_layers else True

    def has_rope(self, layer: int) -> bool:
        return bool(self.rope_layers[layer]) if self.rope_layers else True

    @property
    def llama_math(self) -> bool:
        """Exactly Llama's computation (biases on q/k/v allowed): what the C decode stack implements."""
        plain = DecoderShape(**{f.name: getattr(self, f.name) for f in fields(self)
                                if f.name in _SIZE_FIELDS})
        return (not self.qk_norm and self.moe is None and self.mla is None
                and all(getattr(self, f) == getattr(plain, f) for f in _FEATURE_FIELDS)
                and not any(w is not None for w in self.layer_windows))


_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "qkv_bias", "qk_norm", "tie_word_embeddings", "architecture")
_FEATURE_FIELDS = ("o_bias", "mlp_bias", "norm", "norm_offset", "layout", "activation", "embedding_scale",
                   "residual_scale", "attention_scale", "attn_softcap", "final_softcap", "logit_scale", "logit_divisor",
                   "rope_layers", "layer_chunks", "attn_sinks")
