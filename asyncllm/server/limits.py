"""What the app accepts before any route runs: JSON bodies of bounded size, adapters from listed places.

Every POST body must be declared JSON (``application/json`` or ``application/*+json``): a browser
page can send a "simple" cross-site POST only as ``text/plain``, form or multipart data, so this
check alone keeps such pages from driving the API with a visitor's access. The body is read in
chunks and refused (413) as soon as it passes the limit, before it is parsed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from starlette.requests import Request

from ..errors import ConfigError
from .errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # 4 MiB: ~1M tokens of text, far beyond any context today


async def read_json_body(request: Request, limit: int) -> bytes:
    """Check the content type and read at most ``limit`` bytes of body (cached for ``request.body()``)."""
    mime = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if mime != "application/json" and not (mime.startswith("application/") and mime.endswith("+json")):
        raise APIError(415, f"the request body must be JSON (Content-Type: application/json), got "
                       f"{mime[:64] or 'no Content-Type'}", code="unsupported_media_type")
    return await read_body(request, limit)


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most ``limit`` bytes of body (413 past it, before reading more); cached for ``request.body()``."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # Starlette's own cache: request.body() and request.json() return it
    return body


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
