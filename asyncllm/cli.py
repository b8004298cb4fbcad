"""The ``asyncllm`` command: ``asyncllm demo [--model PATH]``, ``asyncllm serve MODEL [...]``."""

from __future__ import annotations

import argparse
import logging
import os


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: embeddable LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="stream several prompts at once and report speed")
    demo.add_argument("--model", help="a local Hugging Face checkpoint (default: the embedded demo model)")
    demo.add_argument("--prompts", type=int, default=6, help="concurrent streams (default 6)")
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API with uvicorn (docs/server.md)")
    serve.add_argument("model", metavar="MODEL", help="a local Hugging Face checkpoint directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                       help="load a PEFT adapter at start, selectable as model=NAME (repeatable)")
    serve.add_argument("--api-key", default=os.environ.get("ASYNCLLM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $ASYNCLLM_API_KEY, else none)")
    serve.add_argument("--model-name", help="the name clients pass as model (default: MODEL's directory name)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    serve.add_argument("--max-model-len", type=int, default=None)
    serve.add_argument("--max-num-seqs", type=int, default=256)
    serve.add_argument("--tool-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                       help="tool-call format (default: the model family's; docs/tools.md)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import main as demo_main

        demo_main(args.model, args.prompts, args.max_tokens)
    elif args.command == "serve":
        from .server.serve import main as serve_main

        serve_main(args)


if __name__ == "__main__":
    main()
