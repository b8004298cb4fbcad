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
    else:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {KINDS + EXTRA_KINDS}")
    args = {**_COMMON, **kw, **overrides}
    return cls(**args)


def _model_class(kind: str):
    import transformers

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
    for name, p in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    model.model.norm.weight.mul_(logit_scale)


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
