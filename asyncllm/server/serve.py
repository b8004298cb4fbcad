"""``asyncllm serve MODEL``: the OpenAI-style app on its own, under uvicorn (options: asyncllm/cli.py).

Shutdown is uvicorn's: on SIGINT or SIGTERM it stops accepting connections, lets open requests
finish for up to ``GRACEFUL_SHUTDOWN_S`` seconds (open SSE streams get an error event and
``[DONE]`` at once, and their requests are aborted), then returns; the engine is closed after
that and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from .http_limits import HTTPLimits
from .serve_spec import ServeSpec, engine_extras

GRACEFUL_SHUTDOWN_S = 10

logger = logging.getLogger(__name__)


def main(args: argparse.Namespace) -> None:
    """Load the model, register adapters, serve until SIGINT/SIGTERM, then close the engine.
    ``--node-rank K`` runs a tensor-parallel worker node instead; ``--data-parallel-size N``
    serves N replicas through Ray Serve (integrations/ray.py)."""
    import uvicorn

    from ..errors import AsyncLLMError

    if getattr(args, "node_rank", None):
        raise SystemExit(_run_worker_node(args))
    spec = ServeSpec.from_args(args)
    if getattr(args, "data_parallel_size", None) is None and (getattr(args, "ray_address", None)
                                                              or getattr(args, "cpus_per_replica", None)):
        raise SystemExit("asyncllm serve: --ray-address and --cpus-per-replica apply to replicas: "
                         "add --data-parallel-size N")
    if getattr(args, "data_parallel_size", None) is not None:  # even 1: one replica on Ray (a cluster's placement)
        from ..integrations.ray import serve_replicas

        try:
            serve_replicas(spec, args.data_parallel_size, host=args.host, port=args.port,
                           ray_address=args.ray_address, cpus_per_replica=args.cpus_per_replica)
        except AsyncLLMError as exc:
            raise SystemExit(f"asyncllm serve: {exc}") from None
        print("asyncllm serve: stopped", file=sys.stderr)
        return
    try:
        limits = http_limits(args)
        llm, app = spec.build()
    except AsyncLLMError as exc:  # a bad option value: say which, not a traceback
        raise SystemExit(f"asyncllm serve: {exc}") from None
    try:
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **limits.uvicorn_options())
        # uvicorn re-raises the signal that stopped it once it has shut down: make SIGTERM end
        # like SIGINT (KeyboardInterrupt, caught below) so the engine is closed and the exit is clean
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            uvicorn.Server(config).run()
        except KeyboardInterrupt:
            pass
    finally:
        llm.close()
    print("asyncllm serve: stopped", file=sys.stderr)


def http_limits(args: argparse.Namespace) -> HTTPLimits:
    """The HTTP-layer bounds ``asyncllm serve``'s options ask for (ConfigError naming a bad one)."""
    from ..errors import ConfigError

    defaults = HTTPLimits()
    limits = HTTPLimits(max_header_bytes=getattr(args, "max_header_bytes", defaults.max_header_bytes),
                        header_timeout_s=getattr(args, "header_timeout", defaults.header_timeout_s),
                        keep_alive_s=getattr(args, "keep_alive_timeout", defaults.keep_alive_s),
                        max_connections=getattr(args, "max_connections", defaults.max_connections))
    options = {"max_header_bytes": "--max-header-bytes", "header_timeout_s": "--header-timeout",
               "keep_alive_s": "--keep-alive-timeout", "max_connections": "--max-connections"}
    for name, option in options.items():
        value = getattr(limits, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{option}: must be positive, got {value!r}")
    return limits


def _run_worker_node(args) -> int:
    """``--node-rank K`` (K > 0): this machine only runs its tensor-parallel ranks for node 0's
    engine (which sends them its engine arguments); returns the exit status once they end."""
    from ..config import EngineConfig
    from ..distributed.workers import run_worker_node
    from ..errors import AsyncLLMError

    try:
        config = EngineConfig.from_kwargs(args.model, dict(device=args.device, revision=args.revision,
                                                           **engine_extras(args)))
        print(f"asyncllm serve: node {config.node_rank} of {config.nnodes}: running its tensor-parallel ranks "
              "for node 0's engine", file=sys.stderr)
        return run_worker_node(config)
    except AsyncLLMError as exc:
        raise SystemExit(f"asyncllm serve: {exc}") from None
