"""Random-weight models with locally trained tokenizers: the demo's default model, and the
checkpoints the tests and benchmarks build (nothing is ever downloaded)."""

from .checkpoints import KINDS, build_checkpoint, build_demo_model, default_demo_dir
from .tokenizer import build_tokenizer

__all__ = ["KINDS", "build_checkpoint", "build_demo_model", "default_demo_dir", "build_tokenizer"]
