"""Random-weight models with locally trained tokenizers: the demo's default model, and the
checkpoints the tests and benchmarks build (nothing is ever downloaded)."""

from .checkpoints import KINDS, build_checkpoint, build_demo_model, default_demo_dir
from .tokenizer import build_tokenizer


def model_or_demo(path: str | None) -> str:
    """``path`` if given, else the embedded demo model (built on first use): the examples' default."""
    return path if path is not None else str(build_demo_model())


__all__ = ["KINDS", "build_checkpoint", "build_demo_model", "default_demo_dir", "build_tokenizer", "model_or_demo"]
