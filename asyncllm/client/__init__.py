"""``AsyncLLMClient``: the ``AsyncLLM`` API over HTTP, against ``asyncllm serve`` or any OpenAI-compatible server.

``llm = AsyncLLM(model)`` or ``llm = AsyncLLMClient(url)`` is the only line an application changes
(docs/client.md)."""

from .client import AsyncLLMClient

__all__ = ["AsyncLLMClient"]
