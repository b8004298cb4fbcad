"""The ``asyncllm`` command: ``asyncllm demo [--model PATH]``."""

from __future__ import annotations

import argparse
import logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: embeddable LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="stream several prompts at once and report speed")
    demo.add_argument("--model", help="a local Hugging Face checkpoint (default: the embedded demo model)")
    demo.add_argument("--prompts", type=int, default=6, help="concurrent streams (default 6)")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(args.model, args.prompts, args.max_tokens)


if __name__ == "__main__":
    main()
