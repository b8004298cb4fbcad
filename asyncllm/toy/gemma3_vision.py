"""A tiny random-weight Gemma 3 vision-language checkpoint (SigLIP tower, pooled projector), with its processor.

Images are 28 x 28 pixels in patches of 7 (a 4 x 4 grid) pooled to 4 soft tokens; the text model has two
sliding-window layers (window 8, so an image's block crosses it) and a global one. The processor expands
``<start_of_image>`` into ``\\n\\n<start_of_image>`` + 4 soft tokens + ``<end_of_image>\\n\\n`` as Gemma 3's does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoints import INIT_STD, LOGIT_SCALE, _COMMON, _quiet_progress_bars
from .tokenizer import build_tokenizer
from .vision import VISION_CHAT_TEMPLATE, _no_unknown_token

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TOKENS_PER_IMAGE = 4
GEMMA3_CHAT_TEMPLATE = VISION_CHAT_TEMPLATE.replace("<image>", BOI)


def build_gemma3_vision_checkpoint(out_dir: Path, seed: int = 0, **text_overrides) -> Path:
    """Write the checkpoint and its processor to ``out_dir``; returns it."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig,
                              SiglipVisionConfig)

    try:  # the PIL image processor: torchvision is not installed here
        from transformers import Gemma3ImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: one class
        from transformers import Gemma3ImageProcessor as ImageProcessor

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", BOI, EOI, SOFT]})
    tokenizer._set_model_specific_special_tokens({"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT})
    boi, eoi, soft = tokenizer.convert_tokens_to_ids([BOI, EOI, SOFT])
    text = {**_COMMON, "vocab_size": soft + 16, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
            "sliding_window": 8, "num_hidden_layers": 3, "tie_word_embeddings": False,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
            **text_overrides}
    text.pop("dtype")
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=28, patch_size=7)
    config = Gemma3Config(text_config=Gemma3TextConfig(**text), vision_config=vision,
                          mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=boi, eoi_token_index=eoi,
                          image_token_index=soft, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    _peaked(model, seed)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    processor = Gemma3Processor(image_processor=ImageProcessor(size={"height": 28, "width": 28}), tokenizer=tokenizer,
                                image_seq_length=TOKENS_PER_IMAGE, chat_template=GEMMA3_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    _no_unknown_token(out_dir)
    return out_dir


@torch.no_grad()
def _peaked(model, seed: int) -> None:
    """As the text checkpoints draw theirs: Gemma's (1 + w) norms centred on 0, the tower's LayerNorms on 1."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        tower = "vision_tower" in name
        if tower and ("layer_norm" in name or "layernorm" in name) and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("norm.weight"):  # the language model's and the soft embedding norm: Gemma's
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
    final = model.model.language_model.norm.weight
    final.copy_(LOGIT_SCALE * (1.0 + final) - 1.0)
