"""Loading a vision-language checkpoint's transformers processor (``AutoProcessor``).

Some processors bundle a video processor beside the image one (Qwen2-VL, Qwen2.5-VL), and
transformers' video processors need torchvision: without it the whole processor fails to load,
though the engine takes images only. Then the checkpoint's own processor class is used without
its video side (:func:`image_only`): its images and text are processed exactly as by the full class.
"""

from __future__ import annotations

import json
from pathlib import Path

_CONFIG_FILES = ("processor_config.json", "preprocessor_config.json")


def load_processor(model_dir):
    """The checkpoint's processor (ModelLoadError naming the directory when it cannot be loaded)."""
    from transformers import AutoProcessor

    from ..errors import ModelLoadError

    try:
        return AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # transformers raises many types here
        fallback = _image_only_class(model_dir)
        if fallback is None:
            raise ModelLoadError(f"cannot load the image processor from {model_dir}: {exc}") from exc
        try:
            return fallback.from_pretrained(model_dir, local_files_only=True)
        except Exception as again:
            raise ModelLoadError(f"cannot load the image processor from {model_dir}: {again}") from again


def image_only(processor_class):
    """``processor_class`` without its ``video_processor`` (same name, so that it saves as the original)."""

    class ImageOnly(processor_class):
        @classmethod
        def get_attributes(cls):
            return [name for name in super().get_attributes() if name != "video_processor"]

    ImageOnly.__name__ = ImageOnly.__qualname__ = processor_class.__name__
    return ImageOnly


def _image_only_class(model_dir):
    """The image-only form of the checkpoint's processor class, when its video processor is what cannot load
    (torchvision missing); else None."""
    import transformers
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return None
    for name in _CONFIG_FILES:
        try:
            config = json.loads((Path(model_dir) / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        cls = getattr(transformers, str(config.get("processor_class")), None)
        if cls is not None and "video_processor" in cls.get_attributes():
            return image_only(cls)
    return None
