"""What the app accepts before any route runs: JSON bodies of bounded size, adapters from listed places.

Every POST body must be declared JSON (``application/json`` or ``application/*+json``): a browser
page can send a "simple" cross-site POST only as ``text/plain``, form or multipart data, so this
check alone keeps such pages from driving the API with a visitor's access. The body is read in
chunks and refused (413) as soon as it passes the limit, before it is parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import anyio
from starlette.requests import Request

from ..errors import ConfigError
from .errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: ~1M tokens of text, far beyond any context today
# Prompts of one batched /v1/completions request (times n) and inputs of one /v1/embeddings request.
# Each is an engine request, so the bound keeps one body from filling the waiting queue (a 429 for
# everyone) with tens of thousands of one-token prompts; at 1,024 the host's loop never stalls more than
# ~15 ms for one such batch, at 2,048 it did for ~250 ms (docs/benchmarks.md, W-HOSTILE).
DEFAULT_MAX_BATCH_INPUTS = 1024
# A body must arrive within this many seconds of its headers (408 past it): a client trickling a
# body byte by byte would otherwise hold its request, and its slot in the server, forever.
DEFAULT_BODY_TIMEOUT_S = 60.0
# Bodies at least this large are validated in a worker thread, not on the event loop.
LARGE_BODY_BYTES = 64 * 1024


async def read_json_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """Check the content type and read at most ``limit`` bytes of body (cached for ``request.body()``)."""
    mime = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                       f"{mime[:64] or 'no Content-Type'}", code="unsupported_media_type")
    return await read_body(request, limit, timeout_s)


async def read_body(request: Request, limit: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> bytes:
    """Read at most ``limit`` bytes of body (413 past it, before reading more) within ``timeout_s``
    seconds (408 past it); cached for ``request.body()``."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    chunks, size = [], 0
    with anyio.move_on_after(timeout_s) as scope:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    if scope.cancelled_caught:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout")
    body = b"".join(chunks)
    request._body = body  # Starlette's own cache: request.body() and request.json() return it
    return body


# What one body may hold, counted before it is parsed. Parsing and validating build a Python object per
# JSON value while holding the GIL (a worker thread does not help): 4 MiB of ``[[7],[7],...]`` is 500,000
# lists and half a second in which no other thread, the host's event loop included, runs. These bounds
# keep that under ~50 ms and are far above real requests (2,048 messages or prompts, 250k token ids).
MAX_BODY_CONTAINERS = 16_384   # JSON arrays and objects
MAX_BODY_VALUES = 262_144      # values in arrays and objects (their separating commas, plus one)


def check_body_structure(body: bytes) -> None:
    """A 400 when ``body`` holds more JSON arrays/objects or values than the bounds above.

    Brackets and commas are counted outside strings; the scan jumps from quote to quote with
    ``bytes.find`` and returns to Python at each, so in a worker thread it never holds the GIL long."""
    containers = values = 0
    pos, size = 0, len(body)
    while pos < size:
        quote = body.find(b'"', pos)
        end = size if quote < 0 else quote
        containers += body.count(b"[", pos, end) + body.count(b"{", pos, end)
        values += body.count(b",", pos, end)
        if quote < 0:
            break
        pos = _string_end(body, quote)
        if pos < 0:
            break  # unterminated: the JSON parser reports it
    if containers > MAX_BODY_CONTAINERS:
        raise APIError(400, f"the request body holds {containers} JSON arrays and objects, more than the "
                       f"{MAX_BODY_CONTAINERS} one request may hold")
    if values + 1 > MAX_BODY_VALUES:
        raise APIError(400, f"the request body holds {values + 1} JSON values in arrays and objects, more than "
                       f"the {MAX_BODY_VALUES} one request may hold")


def _string_end(body: bytes, quote: int) -> int:
    """The position after the string that opens at ``quote`` (-1 if it never closes)."""
    start = quote + 1
    while True:
        close = body.find(b'"', start)
        if close < 0:
            return -1
        backslash = close - 1
        while backslash > quote and body[backslash] == 0x5C:
            backslash -= 1
        if (close - 1 - backslash) % 2 == 0:  # an even run of backslashes: the quote is not escaped
            return close + 1
        start = close + 1


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes)",
                    code="request_too_large")


def lora_roots(allow: bool | Iterable[str | Path] | None) -> tuple[Path, ...]:
    """``allow_lora_loading`` as resolved directories; () when loading over HTTP is off."""
    if allow is None or allow is False:
        return ()
    if allow is True:
        raise ConfigError("allow_lora_loading: list the directories adapters may be loaded from "
                          "(e.g. allow_lora_loading=['/srv/adapters']); True alone would open the whole filesystem")
    if isinstance(allow, (str, Path)):
        allow = [allow]
    roots = tuple(Path(root).expanduser().resolve() for root in allow)
    for root in roots:
        if not root.is_dir():
            raise ConfigError(f"allow_lora_loading: {root} is not a directory")
    return roots


def resolve_adapter_path(requested: str, roots: tuple[Path, ...]) -> Path | None:
    """The adapter directory ``requested`` names (absolute, or relative to an allowed directory), if
    it lies inside one of ``roots`` once symbolic links and ``..`` are resolved; None otherwise
    (whether or not it exists, so that the answer reveals nothing about the host)."""
    if not requested or "\x00" in requested:
        return None
    path = Path(requested)
    candidates = [path] if path.is_absolute() else [root / path for root in roots]
    for candidate in candidates:
        try:
            real = candidate.resolve()
        except (OSError, RuntimeError):  # a symlink loop
            continue
        if any(real == root or root in real.parents for root in roots):
            return real
    return None
