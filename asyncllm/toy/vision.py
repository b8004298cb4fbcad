"""Tiny random-weight vision-language checkpoints (LLaVA with a CLIP or a SigLIP tower, LLaVA-NeXT; Qwen2-VL
and Qwen2.5-VL), with a processor.

Each directory holds what a hub checkpoint holds: config.json, model.safetensors, the tokenizer (the
local toy tokenizer plus the image tokens), the image processor's config and a chat template that
renders image parts, so ``AutoProcessor`` and transformers' ``generate`` read it as they read a real
one. LLaVA: images are 28 x 28 pixels in patches of 7: 16 patches, 16 image tokens per image. LLaVA-NeXT:
the same base view plus tiles at 28 x 56, 56 x 28 or 56 x 56 (LLAVA_NEXT_PINPOINTS), cropped to the image's
aspect ratio, a newline row each: a count per image that depends on its size.
Qwen2-VL / Qwen2.5-VL: dynamic resolution, patches of 14 merged 2 x 2 into one token, so a 56 x 56
image is 4 tokens and a 112 x 84 one 12; the 2.5 tower's attention windows are 56 pixels (2 x 2
tokens), so its larger images span several windows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .checkpoints import INIT_STD, LOGIT_SCALE, _COMMON, _quiet_progress_bars
from .tokenizer import build_tokenizer

IMAGE_TOKEN = "<image>"
VISION_KINDS = ("llava", "llava_siglip", "llava_next", "qwen2_vl", "qwen2_5_vl")
# LLaVA-NeXT's toy tiles an image at one of these [height, width] resolutions (base view: 28 x 28)
LLAVA_NEXT_PINPOINTS = [[28, 56], [56, 28], [56, 56]]
QWEN_VL_KINDS = ("qwen2_vl", "qwen2_5_vl")
IMAGE_SIZE, PATCH_SIZE = 28, 7
# renders {"type": "image"} parts as the placeholder, text parts as their text
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_vision_checkpoint(kind: str, out_dir: Path, seed: int = 0, tower_overrides: dict | None = None,
                            **text_overrides) -> Path:
    """Write a tiny random-weight ``kind`` (one of VISION_KINDS) checkpoint with its processor to ``out_dir``;
    ``tower_overrides`` (LLaVA kinds): vision-config sizes instead of the tiny ones (benchmarks)."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, SiglipVisionConfig)

    if kind not in VISION_KINDS:
        raise ValueError(f"unknown vision checkpoint kind {kind!r}; expected one of {VISION_KINDS}")
    if kind in QWEN_VL_KINDS:
        return _build_qwen_vl(kind, Path(out_dir), seed, **text_overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text = {**_COMMON, "vocab_size": image_token_id + 16, "num_key_value_heads": 2, "tie_word_embeddings": False,
            **text_overrides}
    text.pop("dtype")
    tower = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    image_size=IMAGE_SIZE, patch_size=PATCH_SIZE), **(tower_overrides or {})}
    image_size, patch_size = tower["image_size"], tower["patch_size"]
    siglip, nxt = kind == "llava_siglip", kind == "llava_next"
    vision = SiglipVisionConfig(**tower) if siglip else CLIPVisionConfig(projection_dim=32, **tower)
    options = dict(text_config=LlamaConfig(**text), vision_config=vision, image_token_id=image_token_id,
                   projector_hidden_act="gelu", vision_feature_layer=-1 if siglip else -2,
                   vision_feature_select_strategy="full" if siglip else "default", dtype="float32")
    if nxt:
        from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor

        config = LlavaNextConfig(image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, **options)
        model_class, processor_class = LlavaNextForConditionalGeneration, LlavaNextProcessor
    else:
        config, model_class, processor_class = LlavaConfig(**options), LlavaForConditionalGeneration, LlavaProcessor
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    _peaked(model, seed)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    sizes = dict(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    processor = processor_class(
        image_processor=_llava_next_image_processor(**sizes) if nxt else CLIPImageProcessor(**sizes),
        tokenizer=tokenizer, patch_size=patch_size, image_token=IMAGE_TOKEN,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=0 if siglip else 1, chat_template=VISION_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)
    _no_unknown_token(out_dir)
    return out_dir


def _llava_next_image_processor(**sizes):
    try:  # the PIL image processor: torchvision is not installed here
        from transformers import LlavaNextImageProcessorPil as ImageProcessor
    except ImportError:  # older transformers: one class
        from transformers import LlavaNextImageProcessor as ImageProcessor
    return ImageProcessor(image_grid_pinpoints=LLAVA_NEXT_PINPOINTS, **sizes)


QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen2-VL's layout of an image part: the pad token between the vision markers (the processor repeats the pad)
QWEN_VL_CHAT_TEMPLATE = VISION_CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
QWEN_PATCH, QWEN_WINDOW = 14, 56


def _build_qwen_vl(kind: str, out_dir: Path, seed: int, **text_overrides) -> Path:
    """A Qwen2-VL or Qwen2.5-VL checkpoint: the Qwen2 decoder with M-RoPE (sections 2/3/3 of its 8
    rotary frequencies), a 2-block (2.5: 3-block, the middle one full attention) vision tower."""
    from transformers import (Qwen2VLImageProcessorPil, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLProcessor)

    from transformers.utils import is_torchvision_available

    from ..frontend.processor_loading import image_only

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *QWEN_TOKENS]})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    text = {**_COMMON, "vocab_size": max(ids.values()) + 16, "num_key_value_heads": 2, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
            **text_overrides}
    text.pop("dtype")
    hidden = text["hidden_size"]
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=hidden, mlp_ratio=2, num_heads=4, patch_size=QWEN_PATCH)
        config, model_cls, processor_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=hidden,
                      patch_size=QWEN_PATCH, window_size=QWEN_WINDOW, fullatt_block_indexes=[1])
        config, model_cls, processor_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    config = config(text_config=text, vision_config=vision, dtype="float32", **tokens)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _qwen_weights(model, seed)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    # at most 224 x 224 pixels (256 patches): test images stay a few tokens
    pixels = dict(min_pixels=56 * 56, max_pixels=224 * 224, patch_size=QWEN_PATCH)
    parts = dict(image_processor=Qwen2VLImageProcessorPil(**pixels), tokenizer=tokenizer,
                 chat_template=QWEN_VL_CHAT_TEMPLATE)
    if is_torchvision_available():
        from transformers import Qwen2VLVideoProcessor

        processor = processor_cls(video_processor=Qwen2VLVideoProcessor(**pixels), **parts)
    else:  # transformers' video processors need torchvision: the processor without one (frontend/processor_loading.py)
        processor = image_only(processor_cls)(**parts)
    processor.save_pretrained(out_dir)
    _no_unknown_token(out_dir)
    return out_dir


@torch.no_grad()
def _qwen_weights(model, seed: int) -> None:
    """As ``_peaked``, for Qwen's names; the patch convolution (1176 inputs) drawn small enough that the
    tower's first norm sees values of order one."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name or "ln_q" in name:
            p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "patch_embed" in name:
            p.copy_(0.03 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(INIT_STD * torch.randn(p.shape, generator=gen))
    model.model.language_model.norm.weight.mul_(LOGIT_SCALE)


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
