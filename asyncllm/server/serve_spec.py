"""``ServeSpec``: everything one serving engine is built from, as plain data (``asyncllm serve``'s
options parsed), so the command (server/serve.py) and a Ray Serve replica on another machine
(integrations/ray.py) build the same engine and app."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BATCH_INPUTS

logger = logging.getLogger(__name__)


def parse_loras(specs: list[str]) -> list[tuple[str, str]]:
    """``["name=path", ...]`` as pairs; a malformed spec is a usage error."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"asyncllm serve: --lora expects NAME=PATH, got {spec!r}")
        pairs.append((name, path))
    return pairs


@dataclass
class ServeSpec:
    """Everything one serving engine is built from: the command's options as plain data, so a
    Ray Serve replica on another machine builds the same engine and app (integrations/ray.py)."""

    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    app_kwargs: dict[str, Any] = field(default_factory=dict)
    loras: list[tuple[str, str]] = field(default_factory=list)
    chat_template: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeSpec":
        """The spec of ``asyncllm serve``'s parsed options (usage errors raise SystemExit)."""
        engine = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                      max_num_seqs=args.max_num_seqs, max_n=args.max_n,
                      max_waiting_requests=args.max_waiting_requests, max_restarts=args.max_restarts,
                      kv_cache_memory=args.kv_cache_memory, tool_parser=getattr(args, "tool_parser", None),
                      revision=args.revision, quantization=args.quantization,
                      generation_config=args.generation_config, max_itl_ms=args.max_itl_ms,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      speculative_config=args.speculative_config, **engine_extras(args))
        app = dict(model_name=args.model_name, api_key=args.api_key,
                   allow_lora_loading=args.enable_lora_loading or False, max_body_bytes=args.max_body_bytes,
                   max_batch_inputs=getattr(args, "max_batch_inputs", DEFAULT_MAX_BATCH_INPUTS),
                   body_timeout_s=getattr(args, "body_timeout", DEFAULT_BODY_TIMEOUT_S),
                   allowed_origins=_origins(args.allowed_origins), reasoning_parser=args.reasoning_parser,
                   pooling=args.pooling)
        template = _read_template(args.chat_template) if args.chat_template is not None else None
        return cls(args.model, engine, app, parse_loras(args.lora), template)

    def build(self):
        """Load the engine, register the adapters, make the app: ``(AsyncLLM, Starlette app)``.
        The engine is closed again if a later part fails."""
        from ..async_llm import AsyncLLM
        from .app import create_app

        llm = AsyncLLM(self.model, **self.engine_kwargs)
        try:
            if self.chat_template is not None:
                llm.tokenizer.chat_template = self.chat_template
            for name, path in self.loras:
                llm.engine.loras.load(name, path)
                logger.info("loaded LoRA adapter %s from %s", name, path)
            return llm, create_app(llm, **self.app_kwargs)
        except BaseException:
            llm.close()
            raise


ENGINE_EXTRAS = ("block_size", "kv_cache_dtype", "enable_prefix_caching", "max_loras", "max_lora_rank", "max_cpu_loras",
                 "attention_backend", "model_impl", "enable_cuda_graphs", "tensor_parallel_size",
                 "enable_expert_parallel", "nnodes", "node_rank", "seed", "limit_mm_per_prompt", "max_image_bytes",
                 "max_image_pixels", "allowed_local_media_path", "allowed_media_domains", "media_fetch_timeout",
                 "image_cache_memory", "encoder_token_budget", "mm_processor_kwargs", "arrival_window_ms")


def engine_extras(args) -> dict:
    """The engine arguments given on the command line (the others keep the engine's defaults)."""
    return {name: getattr(args, name) for name in ENGINE_EXTRAS if getattr(args, name, None) is not None}


def _read_template(value: str) -> str:
    """``--chat-template``: a file's contents, or the value itself when it is a template."""
    path = Path(value).expanduser()
    if "{" not in value and path.is_file():
        return path.read_text()
    if "{" not in value:
        raise SystemExit(f"asyncllm serve: --chat-template: {value!r} is neither a file nor a Jinja template")
    return value


def _origins(values: list[str]) -> list[str] | None:
    """``--allowed-origins`` values (repeatable, or comma-separated), or None when not given."""
    origins = [part.strip() for value in values for part in value.split(",") if part.strip()]
    return origins or None
