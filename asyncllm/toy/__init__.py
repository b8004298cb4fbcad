"""Random-weight models with locally trained tokenizers: the demo's default model, and the
checkpoints the tests and benchmarks build (nothing is ever downloaded)."""

import argparse

from .checkpoints import KINDS, build_checkpoint, build_demo_model, default_demo_dir
from .tokenizer import build_tokenizer


def model_or_demo(path: str | None) -> str:
    """``path`` if given, else the embedded demo model (built on first use): the examples' default."""
    return path if path is not None else str(build_demo_model())


def example_parser(doc: str, *, server: bool = False) -> argparse.ArgumentParser:
    """The examples' command line: ``--model`` (default: the embedded demo model) and, for the
    server examples, ``--port``. ``doc`` is the example's docstring; its first paragraph describes it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--model", help="local checkpoint (default: the embedded demo model)")
    if server:
        parser.add_argument("--port", type=int, default=8000)
    return parser


def parse_example_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line, with ``args.model`` resolved to a checkpoint directory (see :func:`model_or_demo`)."""
    args = parser.parse_args(argv)
    args.model = model_or_demo(args.model)
    return args


__all__ = ["KINDS", "build_checkpoint", "build_demo_model", "default_demo_dir", "build_tokenizer", "model_or_demo",
           "example_parser", "parse_example_args"]
