"""Write a Hugging Face checkpoint (Llama, Mistral, Phi-3, Gemma 2) as a GGUF file, for tests (``gguf``'s writer).

The tests' random-weight checkpoints have no GGUF twin on any hub, so this writes one the way
llama.cpp's converter lays it out: llama.cpp's tensor names (Phi-3's fused ``attn_qkv``/``ffn_up``, Gemma 2's
four norms stored as ``1 + w``), q/k rows permuted per head for the ``llama`` architecture, the
tokenizer as a ``gpt2`` BPE vocabulary with its merges, and projection weights in F32 or Q8_0.
transformers reads the result (``from_pretrained(dir, gguf_file=...)``), which makes it the oracle
for the engine's own GGUF loading. Only what the tests need: Llama/Mistral-style models, float32;
llama3 rope scaling is written as llama.cpp writes it, a ``rope_freqs`` tensor of per-frequency divisors
(which transformers' GGUF reader ignores: the oracle for rope is the original checkpoint).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

_LAYER_TENSORS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                  "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# model_type -> (llama.cpp architecture, per-layer names that differ from Llama's, norms stored as 1 + w)
_ARCHITECTURES = {
    "llama": ("llama", {}, False), "mistral": ("llama", {}, False), "granite": ("granite", {}, False),
    "smollm3": ("smollm3", {}, False), "cohere": ("command-r", {}, False), "gemma": ("gemma", {}, True),
    "olmo2": ("olmo2", {"post_attention_layernorm": "post_attention_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}, False),
    "glm4": ("glm4", {"post_self_attn_layernorm": "post_attention_norm", "post_attention_layernorm": "ffn_norm",
                      "post_mlp_layernorm": "post_ffw_norm", "mlp.gate_up_proj": "ffn_up"}, False),
    "phi3": ("phi3", {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}, False),
    "gemma3_text": ("gemma3", {"post_attention_layernorm": "post_attention_norm",
                               "pre_feedforward_layernorm": "ffn_norm",
                               "post_feedforward_layernorm": "post_ffw_norm"}, True),
    "gemma2": ("gemma2", {"post_attention_layernorm": "post_attention_norm",
                          "pre_feedforward_layernorm": "ffn_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"}, True),
}


_PERMUTED = ("llama", "granite", "smollm3")  # architectures llama.cpp converts as Llama: q/k rows interleaved


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def export_gguf(model_dir: Path, out_file: Path, qtype: str = "F32", tokenizer_pre: str = "qwen2") -> Path:
    """Write ``model_dir`` (a Llama-family safetensors checkpoint) as ``out_file``; ``qtype`` is the
    projections' type ("F32" or "Q8_0"; norms stay F32, the embedding follows ``qtype``);
    ``tokenizer_pre`` names the pre-tokenizer (llama.cpp's name: the toy tokenizer splits like
    Qwen2, SmolLM2's is "smollm")."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    model_dir, out_file = Path(model_dir), Path(out_file)
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if config.model_type not in _ARCHITECTURES:
        raise ValueError(f"no GGUF export for model_type {config.model_type!r} (have: {', '.join(_ARCHITECTURES)})")
    arch, _, _ = _ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(out_file), arch)
    writer.add_name(model_dir.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the global layers' rope, as the converter
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    if arch != "command-r":  # Cohere's norm is a LayerNorm: its epsilon has the other key (below)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    writer.add_rope_dimension_count(int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0)))
    if arch in ("gemma", "gemma2", "gemma3"):  # what llama.cpp's converter writes for Gemma
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(config.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if arch == "gemma3" and getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(float(config.final_logit_softcapping))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(int(config.sliding_window))
    if arch == "command-r":
        writer.add_logit_scale(float(config.logit_scale))
        writer.add_layer_norm_eps(float(config.layer_norm_eps))
    if arch == "granite":  # the converter's names for Granite's multipliers
        writer.add_attention_scale(float(config.attention_multiplier))
        writer.add_embedding_scale(float(config.embedding_multiplier))
        writer.add_residual_scale(float(config.residual_multiplier))
        writer.add_logit_scale(float(config.logits_scaling))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, tokenizer, config.vocab_size, tokenizer_pre)

    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    factors = llama3_rope_factors(config)
    if factors is not None:  # as llama.cpp's converter stores llama3 scaling: a tensor, no metadata
        writer.add_tensor("rope_freqs.weight", factors)
    if params.get("rope_type") == "longrope":  # Phi-3 128k / Phi-4-mini: two factor tensors and the original length
        writer.add_rope_scaling_orig_ctx_len(int(config.original_max_position_embeddings))
        writer.add_tensor("rope_factors_long.weight", np.asarray(params["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(params["short_factor"], dtype=np.float32))
    kind = gguf.GGMLQuantizationType[qtype]
    for name, tensor in tensors.items():
        gguf_name, array = _gguf_tensor(name, tensor, config)
        if gguf_name is None:
            continue
        if array.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


def llama3_rope_factors(config) -> np.ndarray | None:
    """Per rotary frequency, the divisor llama3 scaling applies (float32), or None for other rope types:
    unchanged above the high-frequency wavelength, ``factor`` past the low-frequency one, and a
    smooth blend between."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if params.get("rope_type", params.get("type")) != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelengths = 2 * np.pi / freqs
    blend = (original / wavelengths - low) / (high - low)
    divisors = np.where(wavelengths < original / high, 1.0,
                        np.where(wavelengths > original / low, factor, 1.0 / ((1 - blend) / factor + blend)))
    return divisors.astype(np.float32)


def _gguf_tensor(name: str, tensor: torch.Tensor, config) -> tuple[str | None, np.ndarray]:
    arch, renamed, norm_plus_one = _ARCHITECTURES[config.model_type]
    array = tensor.float().numpy()
    if norm_plus_one and name.endswith("norm.weight"):  # llama.cpp stores Gemma's (1 + w) norms folded
        array = array + 1.0
    if name == "model.embed_tokens.weight":
        return "token_embd.weight", array
    if name == "model.norm.weight":
        return "output_norm.weight", array
    if name == "lm_head.weight":
        return (None if config.tie_word_embeddings else "output.weight"), array
    parts = name.split(".")  # model.layers.N.<module path>.weight
    layer, module = parts[2], ".".join(parts[3:-1])
    names = {**_LAYER_TENSORS, **renamed}
    if module not in names:
        return None, array
    if arch in _PERMUTED and module == "self_attn.q_proj":
        array = permute_rows(array, config.num_attention_heads)
    elif arch in _PERMUTED and module == "self_attn.k_proj":
        array = permute_rows(array, config.num_key_value_heads)
    return f"blk.{layer}.{names[module]}.{parts[-1]}", np.ascontiguousarray(array)


def _add_tokenizer(writer, tokenizer, vocab_size: int, pre: str) -> None:
    """A byte-level BPE vocabulary as llama.cpp writes one: tokens, types, merges, special ids."""
    import gguf

    data = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    tokens = [""] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, index in {**vocab, **special}.items():
        tokens[index] = text
        types[index] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    for index in range(vocab_size):
        if not tokens[index]:
            tokens[index] = f"[PAD{index}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, token in ((writer.add_bos_token_id, tokenizer.bos_token), (writer.add_eos_token_id, tokenizer.eos_token),
                          (writer.add_pad_token_id, tokenizer.pad_token)):
        if token is not None:
            setter(tokenizer.convert_tokens_to_ids(token))
    writer.add_add_bos_token(False)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def gguf_to_hf_dir(gguf_file: Path, out_dir: Path) -> Path:
    """The reverse: a float32 safetensors checkpoint directory from a GGUF file (config, tokenizer and
    chat template from the converted metadata, weights dequantized and in Hugging Face's row order),
    through the engine's own GGUF reading. Tests use it to get SmolLM2 as a Hugging Face directory."""
    import shutil

    from safetensors.torch import save_file

    from ..model.gguf_weights import iter_gguf_tensors
    from ..model.registry import architecture_names
    from ..model.source import GGUF_INFO, gguf_tensor_table, resolve_model_source

    source = resolve_model_source(gguf_file)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in source.root.iterdir():
        if file.is_file() and file.name != GGUF_INFO:
            shutil.copy(file, out_dir / file.name)
    config = json.loads((out_dir / "config.json").read_text())
    config.setdefault("architectures", None)
    if not config["architectures"]:
        from transformers import AutoConfig

        config["architectures"] = architecture_names(AutoConfig.from_pretrained(source.root))
    config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    heads = config["num_attention_heads"]
    tensors = {name: value for name, value in iter_gguf_tensors(
        source.gguf_file, gguf_tensor_table(source), heads, config.get("num_key_value_heads") or heads, False)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
