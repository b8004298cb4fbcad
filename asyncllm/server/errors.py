"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import math
import re
from typing import Callable

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..frontend.messages import readable_loc
from ..errors import (AsyncLLMError, EngineDeadError, EngineOverloadedError, InvalidRequestError, LoRAError,
                      RequestFailedError, RequestTimeoutError)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_exceeded",
          503: "server_error"}


class APIError(Exception):
    """An error the server answers with; raised anywhere inside a route."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """The JSON body, also sent as an SSE event when a stream fails midway."""
        error_type = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers or {})
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


def from_validation_error(exc: ValidationError) -> APIError:
    """A malformed body (bad JSON, wrong type, missing field) as a 400 naming the parameter."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    loc = first.get("loc", ())
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    if first.get("type") == "non_finite_number":  # (a nested model reports its path from its own field)
        inner = first["ctx"]["path"]
        path = ".".join([*(str(part) for part in loc), inner] if loc else [inner])
        return APIError(400, f"{path}: NaN and Infinity are not valid JSON numbers", param=path.split(".")[0].split("[")[0])
    if not loc:
        return APIError(400, f"the request body must be a JSON object: {first['msg']}")
    message = first["msg"]
    if len(errors) > 1 and all(e["loc"][:1] == loc[:1] for e in errors):
        # a union field (stop, prompt, content...) fails once per alternative: name the common path, unless
        # one alternative got well inside the value (an image part without its url): that is the one meant
        common = _common_prefix([e["loc"] for e in errors])
        deepest = max(errors, key=lambda e: len(e["loc"]))
        if len(readable_loc(deepest["loc"])) >= len(readable_loc(common)) + 2:
            loc, message = tuple(readable_loc(deepest["loc"])), deepest["msg"]
        else:
            loc, message = common, "none of the accepted types matches this value"
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return APIError(400, f"{path}: {message}", param=str(loc[0]))


def _common_prefix(locs: list[tuple]) -> tuple:
    prefix = locs[0]
    for loc in locs[1:]:
        size = 0
        while size < min(len(prefix), len(loc)) and prefix[size] == loc[size]:
            size += 1
        prefix = prefix[:size]
    return prefix


def from_engine_error(exc: AsyncLLMError, param_for: Callable[[str | None], str | None] | None = None) -> APIError:
    """Map asyncllm's errors to HTTP: bad input 400, unusable adapter 400, dead engine 503."""
    if isinstance(exc, InvalidRequestError):
        param = param_for(exc.field) if param_for else exc.field
        message = str(exc)
        if param and exc.field and param != exc.field and message.startswith(f"{exc.field}:"):
            message = f"{param}:{message[len(exc.field) + 1:]}"  # name what the client actually sent
        return APIError(400, message, param=param)
    if isinstance(exc, LoRAError):  # (a registered adapter re-read from disk after its eviction, say)
        return APIError(400, without_host_paths(str(exc)), param="model", code="lora_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not available: {exc}", code="engine_unavailable")
    if isinstance(exc, EngineOverloadedError):
        retry = max(1, math.ceil(exc.retry_after))
        return APIError(429, str(exc), code="too_many_requests", headers={"Retry-After": str(retry)})
    if isinstance(exc, RequestTimeoutError):
        return APIError(408, str(exc), code="request_timeout")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), code="internal_error")
    return APIError(400, str(exc))


# an absolute path, quoted or not: POSIX (/srv/a/b) or Windows (C:\\srv\\a)
_HOST_PATH = re.compile(r"""'(?:/|[A-Za-z]:\\)[^']*'|(?<![\w/.])(?:/|[A-Za-z]:\\)[^\s'":,;]+""")


def without_host_paths(message: str) -> str:
    """``message`` with every absolute path replaced: where files live on the host is not the client's business."""
    return _HOST_PATH.sub("<adapter directory>", message)


async def http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404/405 (unknown route, wrong method) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    return APIError(status, f"{request.method} {request.url.path}: {detail}").response()
