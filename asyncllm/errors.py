"""Errors raised by asyncllm. Every public failure is an ``AsyncLLMError``."""

from __future__ import annotations


def short_repr(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages must not echo megabytes back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class AsyncLLMError(Exception):
    """Base class of every error asyncllm raises on purpose."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """Bad input from the caller (HTTP 400). ``field`` names the offending parameter."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineDeadError(AsyncLLMError):
    """The engine loop died; every open stream receives this error."""


class LoRAError(AsyncLLMError):
    """A LoRA adapter cannot be loaded or used (HTTP 400/404)."""


class ModelLoadError(AsyncLLMError):
    """A checkpoint cannot be loaded (missing files, unsupported architecture...)."""


class ConfigError(AsyncLLMError, ValueError):
    """An engine argument is invalid or the machine cannot satisfy it."""


class EngineOverloadedError(AsyncLLMError):
    """Too many requests are waiting (``max_waiting_requests``); retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(AsyncLLMError, TimeoutError):
    """The request ran past its ``timeout=``; it was aborted and its KV blocks freed."""


class RequestFailedError(AsyncLLMError):
    """Processing this one request's output failed (a bug, not bad input); other requests go on."""


class ServerError(AsyncLLMError):
    """``AsyncLLMClient``: the server refused the request for a reason the engine itself never gives
    (401 without the right API key, 403, an unknown route...). ``status``: the HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
