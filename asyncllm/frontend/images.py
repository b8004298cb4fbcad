"""Reading one image of a prompt from wherever the request says it is, within the operator's limits.

An image may be a PIL image, raw bytes, a ``data:`` URL, a local file (only under
``allowed_local_media_path``) or an http(s) URL (only of a host in ``allowed_media_domains``, fetched
with httpx under ``media_fetch_timeout`` and ``max_image_bytes``). Its size in pixels is checked from
the file's header before anything is decoded, so a 20k x 20k PNG costs a few hundred bytes of reading
before its 400. Every refusal is an InvalidRequestError naming the request part (``field``).

This runs in the front's worker threads (AsyncLLM's input pool), never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ..errors import InvalidRequestError


@dataclass(frozen=True)
class ImagePolicy:
    """The operator's limits on a prompt's images (EngineConfig's media fields; docs/multimodal.md)."""

    max_images: int = 8
    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    local_roots: tuple[str, ...] | None = None  # real paths of the allowed directories
    domains: tuple[str, ...] | None = None
    fetch_timeout: float = 10.0

    @classmethod
    def from_config(cls, config) -> "ImagePolicy":
        domains, roots = config.allowed_media_domains, config.allowed_local_media_path
        if roots is not None:
            roots = tuple(os.path.realpath(r) for r in ([roots] if isinstance(roots, (str, os.PathLike)) else roots))
        return cls(config.max_images_per_prompt, config.max_image_bytes, config.max_image_pixels,
                   roots, tuple(domains) if domains is not None else None,
                   float(config.media_fetch_timeout))


def load_image(source: Any, policy: ImagePolicy, field: str):
    """The PIL image ``source`` stands for, decoded and checked; InvalidRequestError naming ``field``."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.size, policy, field)
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_image(bytes(source), policy, field)
    if isinstance(source, Path):
        source = str(source)
    if not isinstance(source, str) or not source:
        raise InvalidRequestError(f"{field}: expected an image URL, a data: URL, a file path, bytes or a PIL image",
                                  field=field)
    if source.startswith("data:"):
        return decode_image(_data_url_bytes(source, policy, field), policy, field)
    scheme = urlparse(source).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, policy, field), policy, field)
    if scheme == "file" or scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        return decode_image(_read_local(source, policy, field), policy, field)
    raise InvalidRequestError(f"{field}: unsupported image URL scheme {scheme!r} (data:, http(s): or a file)",
                              field=field)


def decode_image(data: bytes, policy: ImagePolicy, field: str):
    """Bytes of an image file -> a decoded PIL image; its pixel count is checked from the header first."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise InvalidRequestError(f"{field}: the image is {len(data)} bytes, more than max_image_bytes "
                                  f"{policy.max_bytes}", field=field)
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError as exc:  # PIL's own bound (far above ours) refuses at the header
        raise InvalidRequestError(f"{field}: the image has more pixels than max_image_pixels {policy.max_pixels} "
                                  f"({exc})", field=field) from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequestError(f"{field}: not an image this server can decode ({exc})", field=field) from None
    _check_pixels(image.size, policy, field)
    try:
        image.load()
    except Image.DecompressionBombError as exc:
        raise InvalidRequestError(f"{field}: {exc}", field=field) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated or corrupt data
        raise InvalidRequestError(f"{field}: the image cannot be decoded ({exc})", field=field) from None
    return image


def _check_pixels(size: tuple[int, int], policy: ImagePolicy, field: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise InvalidRequestError(f"{field}: the image has no pixels ({width} x {height})", field=field)
    if width * height > policy.max_pixels:
        raise InvalidRequestError(f"{field}: the image is {width} x {height} pixels, more than max_image_pixels "
                                  f"{policy.max_pixels}", field=field)


def _data_url_bytes(url: str, policy: ImagePolicy, field: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise InvalidRequestError(f"{field}: a data: URL must be base64 (data:image/png;base64,...)", field=field)
    if len(payload) * 3 // 4 > policy.max_bytes + 3:  # refused before it is decoded
        raise InvalidRequestError(f"{field}: the image is about {len(payload) * 3 // 4} bytes, more than "
                                  f"max_image_bytes {policy.max_bytes}", field=field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{field}: the data: URL is not valid base64", field=field) from None


def _read_local(source: str, policy: ImagePolicy, field: str) -> bytes:
    if policy.local_roots is None:
        raise InvalidRequestError(f"{field}: local image files are not allowed on this server "
                                  "(allowed_local_media_path is not set)", field=field)
    path = unquote(urlparse(source).path) if source.startswith("file:") else source
    real = os.path.realpath(path)
    if not any(os.path.commonpath([real, root]) == root for root in policy.local_roots):
        raise InvalidRequestError(f"{field}: the file is outside allowed_local_media_path", field=field)
    try:
        size = os.path.getsize(real)
        if size > policy.max_bytes:
            raise InvalidRequestError(f"{field}: the file is {size} bytes, more than max_image_bytes "
                                      f"{policy.max_bytes}", field=field)
        with open(real, "rb") as f:
            return f.read(policy.max_bytes + 1)
    except OSError as exc:
        raise InvalidRequestError(f"{field}: cannot read the image file ({exc.strerror})", field=field) from None


def _fetch(url: str, policy: ImagePolicy, field: str) -> bytes:
    host = (urlparse(url).hostname or "").lower()
    if policy.domains is None:
        raise InvalidRequestError(f"{field}: fetching image URLs is off on this server (allowed_media_domains "
                                  "is not set); send the image as a data: URL", field=field)
    if "*" not in policy.domains and host not in {d.lower() for d in policy.domains}:
        raise InvalidRequestError(f"{field}: images from host {host!r} are not allowed (allowed_media_domains)",
                                  field=field)
    import httpx

    deadline = time.monotonic() + policy.fetch_timeout  # in all: httpx's timeout bounds each read
    try:
        with httpx.Client(timeout=policy.fetch_timeout, follow_redirects=False) as client:
            with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(f"{field}: fetching the image answered HTTP {response.status_code}",
                                              field=field)
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    if time.monotonic() > deadline:
                        raise InvalidRequestError(f"{field}: fetching the image took more than media_fetch_timeout "
                                                  f"{policy.fetch_timeout} s", field=field)
                    if len(data) > policy.max_bytes:
                        raise InvalidRequestError(f"{field}: the image is more than max_image_bytes "
                                                  f"{policy.max_bytes}", field=field)
                return bytes(data)
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"{field}: cannot fetch the image ({type(exc).__name__})", field=field) from None
