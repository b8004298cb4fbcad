"""HTTP answers and stream error events mapped back to the exceptions ``AsyncLLM`` raises."""

from __future__ import annotations

import json
from typing import Any

from ..errors import (AsyncLLMError, EngineDeadError, EngineOverloadedError, InvalidRequestError, LoRAError,
                      RequestFailedError, RequestTimeoutError, ServerError)

# the request parameter a route names, as AsyncLLM's own argument is called
_ARGUMENT = {"messages": "prompt", "input": "prompt", "top_logprobs": "logprobs",
             "max_completion_tokens": "max_tokens", "response_format": "json_schema"}


def error_from_status(status: int, body: bytes, headers: Any, lora: bool) -> AsyncLLMError:
    """The exception for an error answer: 400 InvalidRequestError (``field`` from its ``param``),
    429 EngineOverloadedError (with Retry-After), 503 EngineDeadError, 408 RequestTimeoutError,
    500 RequestFailedError, an unknown model while a LoRA was named LoRAError, else ServerError."""
    error = _error_object(body)
    message = error.get("message") or f"HTTP {status}"
    code, param = error.get("code"), error.get("param")
    if code == "lora_error" or (status == 404 and lora and code == "model_not_found"):
        return LoRAError(message)
    if status in (400, 413, 415, 422):
        return InvalidRequestError(message, field=_ARGUMENT.get(param, param))
    if status == 429:
        return EngineOverloadedError(message, retry_after=retry_after(headers) or 1.0)
    if status == 503:
        return EngineDeadError(message)
    if status == 408:
        return RequestTimeoutError(message)
    if status == 500:
        return RequestFailedError(message)
    return ServerError(f"HTTP {status}: {message}", status)


def error_from_event(error: dict[str, Any]) -> AsyncLLMError:
    """The exception for an error event inside a stream (its status was 200 already)."""
    message = error.get("message") or "the stream failed"
    code = error.get("code")
    if code in ("engine_unavailable", "server_shutdown"):
        return EngineDeadError(message)
    if code == "request_timeout":
        return RequestTimeoutError(message)
    if code == "too_many_requests":
        return EngineOverloadedError(message)
    if code == "lora_error":
        return LoRAError(message)
    if error.get("type") == "invalid_request_error":
        param = error.get("param")
        return InvalidRequestError(message, field=_ARGUMENT.get(param, param))
    return RequestFailedError(message)


def retry_after(headers: Any) -> float | None:
    """Seconds a Retry-After header asks to wait (its seconds form), None without one."""
    value = headers.get("retry-after") if headers is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _error_object(body: bytes) -> dict[str, Any]:
    """OpenAI's ``{"error": {...}}`` (or a bare ``{"message"}``/``{"detail"}``); {} for anything else."""
    try:
        data = json.loads(body)
    except ValueError:
        return {"message": body[:500].decode(errors="replace")} if body else {}
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data["error"]
    if isinstance(data, dict):
        message = data.get("message") or data.get("detail")
        return {"message": message if isinstance(message, str) else json.dumps(data)[:500]}
    return {}
