"""Data-parallel replicas on Ray Serve: N engines behind one OpenAI-style endpoint.

``asyncllm serve MODEL --data-parallel-size N`` (or :func:`build_app` for an application of your
own) deploys N engine replicas, each a Ray Serve deployment running an :class:`~asyncllm.AsyncLLM`
and the OpenAI-style app (``server/app.py``) in its own process, and one router in front. Ray does
the placement (replicas land wherever the cluster has the CPUs or GPUs they ask for), the
processes and the transport; this module adds the routing:

- **Prefix-cache affinity** (:class:`PrefixAffinity`): the router remembers, per replica, the
  prompt prefixes it sent there (chained hashes of 64-character blocks, as the KV prefix cache
  chains its blocks) and sends a request to the replica holding the longest matching prefix, so
  that replica's prefix cache serves it, as long as that replica is not busier than the least
  busy one by more than ``max_imbalance`` requests in flight ("while it has room"); otherwise, or
  without a match, to the least busy replica.
- Every response carries an ``x-asyncllm-replica`` header naming the replica that served it; a
  request that sends that header names the replica it wants (``/metrics`` of one replica, tests).
- Streams stay streams: the replica runs the app's ASGI call and yields the response as it is
  sent (SSE events included) through a streaming deployment handle.

``ray[serve]`` is an optional dependency (``pip install 'asyncllm[ray]'``); importing this module
does not import Ray.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any, AsyncIterator, Iterable

from ..errors import ConfigError
from ..server.errors import APIError
from ..server.limits import DEFAULT_MAX_BODY_BYTES, read_body
from ..server.serve_spec import ServeSpec

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-asyncllm-replica"
RAY_MISSING = ("data-parallel serving runs on Ray Serve, which is not installed: pip install 'asyncllm[ray]' "
               "(or: pip install 'ray[serve]')")
BLOCK_CHARS = 64
AFFINITY_MAX_CHARS = 16 * 1024  # the prompt's head decides where it goes: hashing more buys nothing
_INLINE_PARSE_BYTES = 64 * 1024  # larger bodies are parsed in a worker thread


def require_ray():
    """``(ray, ray.serve)``, or ConfigError saying how to install them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray, serve


# ---- routing ------------------------------------------------------------------------------------------
class PrefixAffinity:
    """Which replica a request goes to (see the module doc). Not thread-safe: the router calls it
    from its one event loop."""

    def __init__(self, replicas: Iterable[str], max_imbalance: int = 8, block_chars: int = BLOCK_CHARS,
                 max_blocks: int = 200_000) -> None:
        self.replicas = list(replicas)
        if not self.replicas:
            raise ConfigError("data-parallel routing needs at least one replica")
        self.max_imbalance, self.block_chars, self.max_blocks = max_imbalance, block_chars, max_blocks
        self.in_flight = {name: 0 for name in self.replicas}
        self._blocks: dict[str, OrderedDict] = {name: OrderedDict() for name in self.replicas}
        self._turn = 0

    def block_hashes(self, text: str) -> list[int]:
        """Chained hashes of the whole blocks of the text's first ``AFFINITY_MAX_CHARS`` characters:
        equal lists mean equal prefixes."""
        hashes, previous = [], 0
        text = text[:AFFINITY_MAX_CHARS]
        for start in range(0, len(text) - self.block_chars + 1, self.block_chars):
            previous = hash((previous, text[start:start + self.block_chars]))
            hashes.append(previous)
        return hashes

    def choose(self, text: str) -> str:
        """The replica for a prompt; its blocks are remembered there."""
        hashes = self.block_hashes(text)
        least = min(self.in_flight.values())
        best, best_match = None, 0
        for name in self.replicas:
            if self.in_flight[name] - least > self.max_imbalance:
                continue  # no room: affinity must not pile requests onto one replica
            match = self._matched(name, hashes)
            if match > best_match:
                best, best_match = name, match
        if best is None:
            idle = [name for name in self.replicas if self.in_flight[name] == least]
            best = idle[self._turn % len(idle)]
            self._turn += 1
        self._remember(best, hashes)
        return best

    def _matched(self, name: str, hashes: list[int]) -> int:
        blocks = self._blocks[name]
        count = 0
        for h in hashes:
            if h not in blocks:
                break
            blocks.move_to_end(h)
            count += 1
        return count

    def _remember(self, name: str, hashes: list[int]) -> None:
        blocks = self._blocks[name]
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def started(self, name: str) -> None:
        self.in_flight[name] += 1

    def finished(self, name: str) -> None:
        self.in_flight[name] -= 1


def prompt_text(body: bytes) -> str:
    """The prompt of an OpenAI-style request body, as text for affinity (instructions, messages,
    prompt or input, in that order); "" when the body is not a JSON object."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    return "".join(_flatten(data.get(key)) for key in ("instructions", "messages", "prompt", "input"))


async def _prompt_text_off_loop(body: bytes) -> str:
    """:func:`prompt_text`, in a worker thread for a large body (parsing it would hold the router's loop)."""
    if len(body) <= _INLINE_PARSE_BYTES:
        return prompt_text(body)
    return await asyncio.to_thread(prompt_text, body)


def _flatten(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return ""
    if isinstance(value, int):
        return f"{value},"
    if isinstance(value, list):
        return "".join(_flatten(item) for item in value)
    if isinstance(value, dict):
        return "".join(f"<{key}>" + _flatten(value.get(key)) for key in ("role", "content", "text") if key in value)
    return ""


# ---- one replica ----------------------------------------------------------------------------------------
async def call_asgi(app, method: str, path: str, query: str, headers: list[tuple[str, str]],
                    body: bytes) -> AsyncIterator[tuple]:
    """Run one HTTP request through an ASGI app in this process; yield ``("start", status,
    headers)`` and then ``("body", bytes)`` pieces as the app sends them. Closing the generator
    early reads as a client disconnect to the app (an open stream is aborted)."""
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
             "root_path": "", "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("asyncllm-replica", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned
                break
            if message["type"] == "http.response.start":
                yield ("start", message["status"],
                       [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield ("body", bytes(message["body"]))
                if not message.get("more_body", False):
                    break
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 5.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the request is over either way
                task.cancel()
        elif not task.cancelled() and task.exception() is not None:
            logger.error("replica app failed", exc_info=task.exception())


class EngineReplica:
    """One data-parallel replica (a Ray Serve deployment of one process): an engine and its app."""

    def __init__(self, spec: ServeSpec, name: str) -> None:
        self.name = name
        self.llm, self.app = spec.build()
        logger.info("replica %s serves %s", name, spec.model)

    async def handle(self, method: str, path: str, query: str, headers: list[tuple[str, str]],
                     body: bytes) -> AsyncIterator[tuple]:
        """One HTTP request, streamed back (see :func:`call_asgi`)."""
        async for event in call_asgi(self.app, method, path, query, headers, body):
            yield event

    async def check_health(self) -> None:
        """Ray Serve's health probe: a dead engine (e.g. a lost tensor-parallel worker) gets the
        replica replaced."""
        await self.llm.check_health()

    def __del__(self) -> None:  # Ray Serve calls it when the replica shuts down
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()


class Router:
    """The HTTP entry (one light process): picks a replica per request and streams its answer.
    Bodies past ``max_body_bytes`` (the replicas' own limit) are refused before they are read whole."""

    def __init__(self, *replicas, names: list[str], max_imbalance: int = 8,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.handles = dict(zip(names, replicas))
        self.affinity = PrefixAffinity(names, max_imbalance)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, request):
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            body = await read_body(request, self.max_body_bytes)
            pinned = request.headers.get(REPLICA_HEADER)
            if pinned is not None and pinned not in self.handles:
                raise APIError(400, f"{REPLICA_HEADER}: no replica named {pinned[:64]!r}; replicas: "
                               f"{', '.join(self.handles)}", param=REPLICA_HEADER)
        except APIError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        name = pinned or self.affinity.choose(await _prompt_text_off_loop(body))
        self.affinity.started(name)
        try:
            events = self.handles[name].options(stream=True).handle.remote(
                request.method, request.url.path, request.url.query, list(request.headers.items()), body)
            _, status, headers = await events.__anext__()
        except Exception as exc:  # noqa: BLE001 - the replica is gone or failed: say so, OpenAI-style
            self.affinity.finished(name)
            logger.exception("replica %s failed", name)
            return JSONResponse(APIError(503, f"replica {name} failed: {exc}").body(), status_code=503,
                                headers={REPLICA_HEADER: name})

        async def body_pieces():
            try:
                async for _, piece in events:
                    yield piece
            finally:
                self.affinity.finished(name)

        response = StreamingResponse(body_pieces(), status_code=status)
        response.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers
                                if k.lower() != "content-length"] + [(REPLICA_HEADER.encode(), name.encode())]
        return response


# ---- building and running ---------------------------------------------------------------------------------
def replica_names(count: int) -> list[str]:
    return [f"engine-{i}" for i in range(count)]


def build_app(model: str | ServeSpec, data_parallel_size: int = 2, *, engine_kwargs: dict | None = None,
              app_kwargs: dict | None = None, cpus_per_replica: float = 1, gpus_per_replica: float = 0,
              max_imbalance: int = 8):
    """A Ray Serve application of ``data_parallel_size`` engine replicas behind a prefix-affinity
    router; run it with ``ray.serve.run(app, route_prefix="/")``. ``model`` is a model (with
    ``engine_kwargs`` for :class:`~asyncllm.AsyncLLM` and ``app_kwargs`` for ``create_app``) or a
    ``ServeSpec``. Each replica asks Ray for ``cpus_per_replica`` CPUs and ``gpus_per_replica``
    GPUs (give a replica running tensor parallelism on CUDA as many GPUs as ranks)."""
    _, serve = require_ray()
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ConfigError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
    spec = model if isinstance(model, ServeSpec) else ServeSpec(str(model))
    if engine_kwargs:
        spec = replace(spec, engine_kwargs={**spec.engine_kwargs, **engine_kwargs})
    if app_kwargs:
        spec = replace(spec, app_kwargs={**spec.app_kwargs, **app_kwargs})
    names = replica_names(data_parallel_size)
    options = {"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica}
    replicas = [serve.deployment(EngineReplica, name=f"asyncllm-{name}", num_replicas=1,
                                 ray_actor_options=options,
                                 max_ongoing_requests=max(100, spec.engine_kwargs.get("max_num_seqs") or 256))
                .bind(spec, name) for name in names]
    router = serve.deployment(Router, name="asyncllm-router", num_replicas=1,
                              ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000)
    return router.bind(*replicas, names=names, max_imbalance=max_imbalance,
                       max_body_bytes=spec.app_kwargs.get("max_body_bytes") or DEFAULT_MAX_BODY_BYTES)


def _replica_resources(spec: ServeSpec, replicas: int, local: bool, cpus: float | None) -> tuple[float, float]:
    """CPUs and GPUs one replica asks Ray for: the given CPUs, or on a local instance an equal share
    of this machine's cores (1 on a cluster); a GPU per tensor-parallel rank on CUDA. Ray sets a
    replica's OMP_NUM_THREADS to its CPUs, so they are also its torch threads."""
    import torch

    if cpus is None:
        cpus = float(max(1, (os.cpu_count() or 1) // replicas)) if local else 1.0
    if cpus <= 0:
        raise ConfigError(f"cpus_per_replica must be positive, got {cpus!r}")
    device = str(spec.engine_kwargs.get("device") or "auto")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    ranks = spec.engine_kwargs.get("tensor_parallel_size") or 1
    return cpus, float(ranks) if cuda else 0.0


def serve_replicas(spec: ServeSpec, data_parallel_size: int, *, host: str = "127.0.0.1", port: int = 8000,
                   ray_address: str | None = None, cpus_per_replica: float | None = None) -> None:
    """``asyncllm serve --data-parallel-size N``: start (or join) Ray, deploy the replicas and the
    router on ``host:port``, serve until SIGINT/SIGTERM, then shut the application down."""
    ray, serve = require_ray()
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ConfigError(f"data_parallel_size must be a positive integer, got {data_parallel_size!r}")
    cpus, gpus = _replica_resources(spec, data_parallel_size, local=not ray_address, cpus=cpus_per_replica)
    started_here = not ray.is_initialized()
    if started_here:
        if ray_address:
            ray.init(address=ray_address)
        else:  # a local instance with room for every replica, whatever this machine's core count
            ray.init(num_cpus=max(os.cpu_count() or 1, int(cpus * data_parallel_size)), include_dashboard=False)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(spec, data_parallel_size, cpus_per_replica=cpus, gpus_per_replica=gpus),
                  name="asyncllm", route_prefix="/")
        print(f"asyncllm serve: {data_parallel_size} replicas ({', '.join(replica_names(data_parallel_size))}) "
              f"on http://{host}:{port}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            if started_here:
                ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
