"""``DecoderShape``: the architecture facts every layer needs, read from a transformers config.

Its own module, free of torch modules, so that the model, the loader and the LoRA loader all import
it without cycles.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import architecture_names


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
    qk_norm: bool
    tie_word_embeddings: bool
    architecture: str = "LlamaForCausalLM"  # the registry entry (model/registry.py) it was read for

    @classmethod
    def from_hf_config(cls, config) -> "DecoderShape":
        model_type = getattr(config, "model_type", "")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            architecture=(architecture_names(config) or ["LlamaForCausalLM"])[0],
        )
