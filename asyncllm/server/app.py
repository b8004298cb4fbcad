"""``create_app``: the OpenAI-style Starlette sub-app over an ``AsyncLLM`` the host owns.

The app has no lifespan of its own (Starlette does not run a mounted app's lifespan): it never
starts or closes the engine, and everything it needs is built here, when it is created.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import AsyncLLMError, ConfigError, InvalidRequestError, LoRAError
from ..frontend.text import check_utf8
from ..frontend.pooling import POOLINGS
from ..frontend.prompts import chat_token_ids
from ..frontend.tokenizing import decode_ids, encode_text
from .anthropic_messages import count_tokens as count_message_tokens, create_message
from .anthropic_messages import error_response as anthropic_error
from .chat import create_chat_completion
from .completions import create_completion
from .embeddings import create_embeddings
from .responses import ResponseStore, create_response, retrieve_response
from .errors import APIError, ClientDisconnected, from_engine_error, http_exception_handler
from .metrics import ServerMetrics
from .reasoning import PARSERS as REASONING_PARSERS
from .protocol import (DetokenizeRequest, LoadLoRARequest, ModelCard, ModelList, TokenizeRequest,
                       UnloadLoRARequest)
from .limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BATCH_INPUTS, DEFAULT_MAX_BODY_BYTES, lora_roots, read_json_body, resolve_adapter_path
from .serving import ServerContext, parse_body

if TYPE_CHECKING:
    from ..async_llm import AsyncLLM

logger = logging.getLogger(__name__)

Handler = Callable[[ServerContext, Request], Awaitable[Response]]


def create_app(llm: "AsyncLLM", model_name: str | None = None, api_key: str | None = None, *,
               allow_lora_loading: bool | Iterable[str | Path] | None = False,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_batch_inputs: int = DEFAULT_MAX_BATCH_INPUTS,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               allowed_origins: Iterable[str] | None = None, reasoning_parser: str | None = None,
               pooling: str | None = None) -> Starlette:
    """An OpenAI-compatible Starlette app serving ``llm``; mount it anywhere or run it as is.

    ``model_name`` is what clients pass as ``model`` (default: :func:`default_model_name`).
    With ``api_key`` set, every route but ``/health`` and ``/metrics`` needs
    ``Authorization: Bearer <api_key>`` (or ``x-api-key: <api_key>``). ``allow_lora_loading`` lists the directories that
    ``/v1/load_lora_adapter`` may load adapters from (off by default: the LoRA routes answer 403).
    POST bodies must be JSON (415 otherwise) of at most ``max_body_bytes`` (413 past it).
    ``max_batch_inputs``: the most prompts (times ``n``) one /v1/completions request and the most
    inputs one /v1/embeddings request may carry (400 past it). ``body_timeout_s``: a POST body must
    arrive within this many seconds of the request's start (408 past it).
    ``allowed_origins``: browser origins allowed to call the app (CORS, Starlette's middleware;
    ``["*"]`` for any); None: no CORS headers, as before. ``reasoning_parser`` ("qwen3" or
    "deepseek_r1"): chat answers carry the model's thinking as ``reasoning_content``, apart from
    ``content``. ``pooling`` ("last" or "mean") for ``/v1/embeddings``; None: the model's default
    (its sentence-transformers config, else "last"). The host creates and closes ``llm``.
    """
    if getattr(llm, "tokenizer", True) is None:
        raise ConfigError("the server needs a tokenizer (chat templates, text prompts and outputs, logprobs): "
                          "this engine was started with skip_tokenizer_init=True")
    name = model_name or default_model_name(llm)
    if not isinstance(max_body_bytes, int) or isinstance(max_body_bytes, bool) or max_body_bytes < 1:
        raise ConfigError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    if not isinstance(max_batch_inputs, int) or isinstance(max_batch_inputs, bool) or max_batch_inputs < 1:
        raise ConfigError(f"max_batch_inputs must be a positive integer, got {max_batch_inputs!r}")
    if isinstance(body_timeout_s, bool) or not isinstance(body_timeout_s, (int, float)) or not body_timeout_s > 0:
        raise ConfigError(f"body_timeout_s must be a positive number of seconds, got {body_timeout_s!r}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
    if pooling is not None and pooling not in POOLINGS:
        raise ConfigError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    ctx = ServerContext(llm=llm, model_name=name, api_key=api_key, metrics=ServerMetrics(llm, name),
                        created=int(time.time()), lora_roots=lora_roots(allow_lora_loading),
                        max_body_bytes=max_body_bytes, max_batch_inputs=max_batch_inputs,
                        body_timeout_s=float(body_timeout_s),
                        reasoning_parser=reasoning_parser, pooling=pooling,
                        responses=ResponseStore())

    def route(path: str, handler: Handler, method: str, *, auth: bool = True,
              errors: Callable[[APIError], Response] | None = None) -> Route:
        return Route(path, _endpoint(ctx, handler, auth, json_body=method == "POST", errors=errors),
                     methods=[method])

    routes = [
        route("/v1/chat/completions", create_chat_completion, "POST"),
        route("/v1/completions", create_completion, "POST"),
        route("/v1/embeddings", create_embeddings, "POST"),
        route("/v1/responses", create_response, "POST"),
        route("/v1/responses/{response_id}", retrieve_response, "GET"),
        route("/v1/messages", create_message, "POST", errors=anthropic_error),  # Anthropic's API, its error shape
        route("/v1/messages/count_tokens", count_message_tokens, "POST", errors=anthropic_error),
        route("/v1/models", list_models, "GET"),
        route("/v1/models/{model:path}", retrieve_model, "GET"),
        route("/v1/load_lora_adapter", load_lora_adapter, "POST"),
        route("/v1/unload_lora_adapter", unload_lora_adapter, "POST"),
        route("/tokenize", tokenize, "POST"),
        route("/detokenize", detokenize, "POST"),
        route("/health", health, "GET", auth=False),
        route("/ping", health, "GET", auth=False),
        route("/version", version, "GET", auth=False),
        route("/metrics", metrics, "GET", auth=False),
        route("/stats", engine_stats, "GET"),
    ]
    middleware = []
    if allowed_origins is not None:
        origins = _origins(allowed_origins)
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                                     allow_headers=["*"], allow_credentials="*" not in origins))
    app = Starlette(routes=routes, middleware=middleware,
                    exception_handlers={HTTPException: _http_exception, Exception: _internal_error})
    app.state.asyncllm = ctx  # for hosts and tests: the engine, model name and metrics registry
    return app


def default_model_name(llm: "AsyncLLM") -> str:
    """A hub id as given (``Qwen/Qwen2.5-0.5B-Instruct``), else the basename of the model path
    (``/models/Qwen2.5-0.5B/`` -> ``Qwen2.5-0.5B``, ``/models/x.Q8_0.gguf`` -> ``x.Q8_0.gguf``)."""
    source = getattr(getattr(llm, "engine", None), "source", None)
    if source is not None and source.hub_id:
        return source.hub_id
    return Path(llm.config.model).resolve().name


def _endpoint(ctx: ServerContext, handler: Handler, auth: bool, json_body: bool,
              errors: Callable[[APIError], Response] | None = None) -> Callable[[Request], Awaitable[Response]]:
    answer = errors or APIError.response  # (the Anthropic routes answer errors in Anthropic's shape)

    async def endpoint(request: Request) -> Response:
        try:
            if auth and ctx.api_key is not None:
                _check_api_key(request, ctx.api_key)
            if json_body:
                await read_json_body(request, ctx.max_body_bytes, ctx.body_timeout_s)
            return await handler(ctx, request)
        except APIError as exc:
            return answer(exc)
        except AsyncLLMError as exc:
            return answer(from_engine_error(exc))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    return endpoint


def _check_api_key(request: Request, api_key: str) -> None:
    # constant-time comparisons: the key must not leak through response timing
    x_api_key = request.headers.get("x-api-key")  # how the anthropic SDK sends it
    if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), api_key.encode()):
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>').",
                       code="invalid_api_key")


def _anthropic_route(request: Request) -> bool:
    """Whether the request is for the Anthropic routes, which answer errors in Anthropic's shape."""
    return request.url.path.rstrip("/").endswith(("/v1/messages", "/v1/messages/count_tokens"))


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 in the shape of the route's API."""
    if _anthropic_route(request):
        status = getattr(exc, "status_code", 500)
        return anthropic_error(APIError(status, f"{request.method} {request.url.path}: "
                                                f"{getattr(exc, 'detail', None) or 'error'}"))
    return await http_exception_handler(request, exc)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug, not bad input: still answered in the API's shape (and logged by the server)."""
    error = APIError(500, f"internal server error: {type(exc).__name__}")
    return anthropic_error(error) if _anthropic_route(request) else error.response()


# ---- small routes ------------------------------------------------------------------------------

def _cards(ctx: ServerContext) -> list[ModelCard]:
    # ``root`` is the model's name, never a host path (vLLM shows the checkpoint directory there)
    base = ModelCard(id=ctx.model_name, created=ctx.created, root=ctx.model_name,
                     max_model_len=ctx.llm.max_model_len)
    adapters = [ModelCard(id=name, created=ctx.created, root=name, parent=ctx.model_name,
                          max_model_len=ctx.llm.max_model_len) for name in ctx.llm.list_loras()]
    return [base, *adapters]


async def list_models(ctx: ServerContext, request: Request) -> Response:
    """The base model and every loaded LoRA adapter (each selectable as ``model``)."""
    return JSONResponse(ModelList(data=_cards(ctx)).model_dump(mode="json"))


async def retrieve_model(ctx: ServerContext, request: Request) -> Response:
    wanted = request.path_params["model"]
    for card in _cards(ctx):
        if card.id == wanted:
            return JSONResponse(card.model_dump(mode="json"))
    raise APIError(404, f"The model `{wanted}` does not exist.", param="model", code="model_not_found")


async def load_lora_adapter(ctx: ServerContext, request: Request) -> Response:
    """Load a PEFT adapter from inside the allowed directories; errors never describe the filesystem."""
    _check_lora_routes(ctx)
    body = await parse_body(request, LoadLoRARequest)
    path = resolve_adapter_path(body.lora_path, ctx.lora_roots)
    if path is None:
        raise APIError(400, f"LoRA adapter `{body.lora_name}`: lora_path must name an adapter directory inside "
                       "the directories this server loads adapters from", param="lora_path")
    try:
        await ctx.llm.add_lora(body.lora_name, str(path))
    except LoRAError as exc:
        logger.warning("loading LoRA adapter %r failed: %s", body.lora_name, exc)
        raise APIError(400, f"LoRA adapter `{body.lora_name}` cannot be loaded: {_without_paths(str(exc), path)}",
                       param="lora_path") from None
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "status": "loaded"})


async def unload_lora_adapter(ctx: ServerContext, request: Request) -> Response:
    _check_lora_routes(ctx)
    body = await parse_body(request, UnloadLoRARequest)
    if body.lora_name not in ctx.llm.list_loras():
        raise APIError(404, f"LoRA adapter `{body.lora_name}` is not loaded.", param="lora_name",
                       code="lora_not_found")
    await ctx.llm.remove_lora(body.lora_name)
    return JSONResponse({"object": "lora_adapter", "id": body.lora_name, "status": "unloaded"})


def _check_lora_routes(ctx: ServerContext) -> None:
    if not ctx.lora_roots:
        raise APIError(403, "loading and unloading LoRA adapters over HTTP is disabled on this server "
                       "(create_app(..., allow_lora_loading=[dirs]) or asyncllm serve --enable-lora-loading DIR)",
                       code="lora_loading_disabled")


def _without_paths(message: str, path: Path) -> str:
    """The loader's reason with the adapter's location removed; a reason that still names some
    other file becomes a generic one (what exists on the host is not the client's business)."""
    message = message.replace(f"{str(path)!r}", "the adapter").replace(str(path), "the adapter")
    if "/" in message or "\\" in message:
        return "not a PEFT LoRA adapter (safetensors) this model can use"
    return message


async def tokenize(ctx: ServerContext, request: Request) -> Response:
    """Token ids of a text prompt, or of chat messages rendered with the chat template (in the engine's
    input worker threads, so a large input does not stall other requests)."""
    body = await parse_body(request, TokenizeRequest)
    ctx.resolve_model(body.model)
    tokenizer = ctx.llm.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "exactly one of 'prompt' and 'messages' is required", param="prompt")

    def run() -> bytes:  # the answer's JSON too is built off the loop: it grows with the input
        if body.messages is not None:
            ids = chat_token_ids([m.to_template_dict() for m in body.messages], tokenizer, body.tools,
                                 getattr(ctx.llm, "tool_parser", "hermes"),
                                 getattr(getattr(ctx.llm, "inputs", None), "multimodal", None))
        else:
            try:
                check_utf8(body.prompt, "prompt")
            except ValueError as exc:
                raise InvalidRequestError(str(exc), field="prompt") from None
            ids = encode_text(tokenizer, body.prompt, add_special_tokens=body.add_special_tokens)
        return json.dumps({"count": len(ids), "max_model_len": ctx.llm.max_model_len, "tokens": ids},
                          separators=(",", ":")).encode()

    return Response(await ctx.llm.offload(run), media_type="application/json")


async def detokenize(ctx: ServerContext, request: Request) -> Response:
    body = await parse_body(request, DetokenizeRequest)
    ctx.resolve_model(body.model)
    size = len(ctx.llm.tokenizer)
    for token in body.tokens:
        if not 0 <= token < size:
            raise InvalidRequestError(f"tokens: token id {token} is outside the vocabulary (size {size})",
                                      field="tokens")
    return JSONResponse({"prompt": await ctx.llm.offload(decode_ids, ctx.llm.tokenizer, body.tokens)})


async def health(ctx: ServerContext, request: Request) -> Response:
    """200 while the engine runs; 503 once it died or was closed."""
    await ctx.llm.check_health()
    return Response(status_code=200)


async def version(ctx: ServerContext, request: Request) -> Response:
    """``{"version": ...}``: the asyncllm package's version."""
    from .. import __version__

    return JSONResponse({"version": __version__})


def _origins(allowed: Iterable[str]) -> list[str]:
    """Validated CORS origins: "*" or scheme://host[:port] each (ConfigError naming a bad one)."""
    if isinstance(allowed, str):
        allowed = [allowed]
    origins = list(allowed)
    for origin in origins:
        if not isinstance(origin, str) or not (origin == "*" or "://" in origin) or origin.endswith("/"):
            raise ConfigError(f"allowed_origins: {origin!r} is not an origin such as 'https://app.example.com' or '*'")
    return origins


async def engine_stats(ctx: ServerContext, request: Request) -> Response:
    """``llm.stats()`` as JSON: the engine's counters as of its last step (what AsyncLLMClient.stats reads)."""
    return JSONResponse(ctx.llm.stats())


async def metrics(ctx: ServerContext, request: Request) -> Response:
    content, content_type = ctx.metrics.render()
    return Response(content, headers={"Content-Type": content_type})
