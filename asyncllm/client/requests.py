"""A prompt and its SamplingParams as the body of an OpenAI-style request (completions or chat)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from ..errors import InvalidRequestError, short_repr
from ..frontend.prompts import ChatPrompt, is_chat
from ..sampling_params import SamplingParams

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

_DEFAULTS = SamplingParams()
# SamplingParams fields whose request field has the same name and meaning on both routes
_SAME_NAME = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
              "min_tokens", "skip_special_tokens", "best_of", "use_beam_search", "length_penalty", "early_stopping",
              "bad_words", "truncate_prompt_tokens", "prompt_logprobs")
# the structured-output fields, as the server's ``structured_outputs`` names them
_STRUCTURED = {"regex": "regex", "choice": "choice", "grammar": "grammar"}
_HANDLED = set(_SAME_NAME) | set(_STRUCTURED) | {"max_tokens", "logprobs", "logit_bias", "json_schema"}
assert _HANDLED == {f.name for f in fields(SamplingParams)}, "a SamplingParams field the client does not send"


def route_for(prompt: Any, tools: list | None) -> str:
    """The route that serves this prompt: chat messages go to chat completions, text and token ids to
    completions (InvalidRequestError for anything else, as AsyncLLM raises)."""
    if is_chat(prompt):
        return CHAT
    if tools is not None:
        raise InvalidRequestError("tools: only allowed with a chat (list of messages) prompt", field="tools")
    if isinstance(prompt, str) or (isinstance(prompt, (list, tuple)) and prompt
                                    and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return COMPLETIONS
    raise InvalidRequestError(f"prompt: expected a string, token ids or chat messages, got {short_repr(prompt)}",
                              field="prompt")


def request_body(route: str, prompt: Any, params: SamplingParams, *, model: str | None, tools: list | None,
                 tool_choice: Any, parallel_tool_calls: bool | None, priority: int) -> dict[str, Any]:
    """The JSON body: only what differs from the defaults (a plain OpenAI server sees plain requests),
    ``max_tokens`` always (the routes' defaults differ from SamplingParams'), streamed, with token ids."""
    body: dict[str, Any] = {"stream": True, "return_token_ids": True}
    if model is not None:
        body["model"] = model
    if route == CHAT:
        chat = prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(list(prompt))
        body["messages"] = chat.messages
        if not chat.add_generation_prompt:
            body["add_generation_prompt"] = False
        if chat.continue_final_message:
            body["continue_final_message"] = True
        if chat.chat_template_kwargs:
            body["chat_template_kwargs"] = chat.chat_template_kwargs
        for name, value in (("tools", tools), ("tool_choice", tool_choice), ("parallel_tool_calls", parallel_tool_calls)):
            if value is not None:
                body[name] = value
    else:
        body["prompt"] = prompt if isinstance(prompt, str) else list(prompt)
    body["max_tokens"] = params.max_tokens
    for name in _SAME_NAME:
        value = getattr(params, name)
        if value != getattr(_DEFAULTS, name):
            body[name] = value
    if params.logprobs is not None:
        if route == CHAT:
            body["logprobs"], body["top_logprobs"] = True, params.logprobs
        else:
            body["logprobs"] = params.logprobs
    if params.logprobs is not None or params.prompt_logprobs is not None:
        body["return_tokens_as_token_ids"] = True  # "token_id:N": logprobs keyed by id, as AsyncLLM's are
    if params.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
    body.update(_structured(params))
    if priority:
        body["priority"] = priority
    return body


def _structured(params: SamplingParams) -> dict[str, Any]:
    """A JSON schema as OpenAI's ``response_format`` (what any server takes); the other constraints in
    ``structured_outputs`` (this server's and vLLM's name)."""
    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return {"structured_outputs": {"json": params.json_schema}}  # the server names the error
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}}
    for name, key in _STRUCTURED.items():
        if getattr(params, name) is not None:
            return {"structured_outputs": {key: getattr(params, name)}}
    return {}
