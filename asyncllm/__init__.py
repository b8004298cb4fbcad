"""asyncllm: an embeddable LLM inference engine (paged KV cache, continuous batching)."""

from .async_llm import AsyncLLM
from .errors import (AsyncLLMError, EngineDeadError, EngineOverloadedError, InvalidRequestError, LoRAError,
                     RequestFailedError, RequestTimeoutError)
from .frontend.prompts import ChatPrompt
from .llm import LLM
from .lora_request import LoRARequest
from .outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams
from .tools.calls import ToolCall

__all__ = ["AsyncLLM", "LLM", "ChatPrompt", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "LoRARequest", "RequestOutput", "CompletionOutput", "RequestMetrics",
           "ToolCall", "AsyncLLMError", "InvalidRequestError", "EngineDeadError", "LoRAError", "EngineOverloadedError",
           "RequestTimeoutError", "RequestFailedError"]
__version__ = "0.1.0"
