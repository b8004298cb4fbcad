"""Tiny random-weight vision-language checkpoints (LLaVA with a CLIP or a SigLIP tower), with a processor.

Each directory holds what a hub checkpoint holds: config.json, model.safetensors, the tokenizer (the
local toy tokenizer plus the ``<image>`` token), the image processor's config and a chat template
that renders image parts, so ``AutoProcessor`` and transformers' ``generate`` read it as they read a
real one. Images are 28 x 28 pixels in patches of 7: 16 patches, 16 image tokens per image.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoints import INIT_STD, LOGIT_SCALE, _COMMON, _quiet_progress_bars
from .tokenizer import build_tokenizer

IMAGE_TOKEN = "<image>"
VISION_KINDS = ("llava", "llava_siglip")
IMAGE_SIZE, PATCH_SIZE = 28, 7
# renders {"type": "image"} parts as the placeholder, text parts as their text
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vision_checkpoint(kind: str, out_dir: Path, seed: int = 0, **text_overrides) -> Path:
    """Write a tiny random-weight ``kind`` (one of VISION_KINDS) checkpoint with its processor to ``out_dir``."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, SiglipVisionConfig)

    if kind not in VISION_KINDS:
        raise ValueError(f"unknown vision checkpoint kind {kind!r}; expected one of {VISION_KINDS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = {**_COMMON, "vocab_size": image_token_id + 16, "num_key_value_heads": 2, "tie_word_embeddings": False,
            **text_overrides}
    text.pop("dtype")
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    siglip = kind == "llava_siglip"
    vision = SiglipVisionConfig(**tower) if siglip else CLIPVisionConfig(projection_dim=32, **tower)
    config = LlavaConfig(text_config=LlamaConfig(**text), vision_config=vision, image_token_id=image_token_id,
                         projector_hidden_act="gelu", vision_feature_layer=-1 if siglip else -2,
                         vision_feature_select_strategy="full" if siglip else "default", dtype="float32")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
    _peaked(model, seed)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=tokenizer, patch_size=PATCH_SIZE, image_token=IMAGE_TOKEN,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=0 if siglip else 1, chat_template=VISION_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    _no_unknown_token(out_dir)
    return out_dir


@torch.no_grad()
def _peaked(model, seed: int) -> None:
    """Weights drawn as the text checkpoints' are (asyncllm/toy/checkpoints.py): peaked next-token logits."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "layer_norm" in name or "layrnorm.weight" in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias") or name.endswith("class_embedding"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
    model.model.language_model.norm.weight.mul_(LOGIT_SCALE)


def _no_unknown_token(out_dir: Path) -> None:
    """As the text toy tokenizer: no unk token (transformers would add one past the vocabulary)."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    cfg["unk_token"] = None
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
