"""Validates a prompt and its sampling parameters into an EngineRequest."""

from __future__ import annotations

import itertools
import time
from typing import Any

from ..engine.request import EngineRequest
from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams
from .prompts import Prompt, check_prompt_length, tokenize_prompt

_counter = itertools.count()


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                sampling_kwargs: dict[str, Any] | None = None, tools: list | None = None,
                cache_salt: Any = None, lora: Any = None) -> tuple[str | None, EngineRequest]:
        """Tokenize and validate; raises InvalidRequestError naming the bad field."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError("params: expected a SamplingParams", field="params")
        # always a private copy: validation normalises fields and the caller may reuse its object
        params = SamplingParams.from_kwargs(params, sampling_kwargs or {})
        params.validate(self.vocab_size)
        text, ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size, tools)
        check_prompt_length(len(ids), self.max_model_len)
        room = self.max_model_len - len(ids)
        max_tokens = min(params.max_tokens or room, room)
        if request_id is None:
            request_id = f"req-{next(_counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id: expected a non-empty string", field="request_id")
        request = EngineRequest(request_id, ids, params, max_tokens, time.monotonic(), cache_salt, lora)
        return text, request
