"""Turning a prompt (text, token ids or chat messages) into validated token ids."""

from __future__ import annotations

from typing import Any, Union

from ..errors import InvalidRequestError, short_repr
from ..tools.prompting import prepare_messages
from .messages import check_utf8, validate_messages
from .tokenizing import TooManyTokens, encode_text, max_prompt_chars

Prompt = Union[str, list[int], list[dict[str, Any]]]


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int, tools: list | None = None,
                    tool_parser: str = "hermes", max_model_len: int | None = None) -> tuple[str | None, list[int]]:
    """Return ``(prompt_text_or_None, token_ids)``; raise InvalidRequestError on bad input.

    With ``max_model_len``, a text too long to fit is refused before it is tokenized."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        try:
            check_utf8(prompt, "prompt")
        except ValueError as exc:
            raise InvalidRequestError(str(exc), field="prompt") from None
        _check_text_length(prompt, tokenizer, max_model_len, "prompt")
        return prompt, _encode(tokenizer, prompt, True, max_model_len)
    if isinstance(prompt, (list, tuple)) and prompt and any(isinstance(m, dict) for m in prompt):
        text = render_chat(list(prompt), tokenizer, tools, tool_parser)
        _check_text_length(text, tokenizer, max_model_len, "messages")
        return text, _encode(tokenizer, text, False, max_model_len)
    if isinstance(prompt, (list, tuple)) and prompt:
        ids = list(prompt)
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"prompt: token id {short_repr(token, 40)} is not an integer in [0, {vocab_size})", field="prompt")
        return None, ids
    raise InvalidRequestError(
        "prompt: expected a non-empty string, list of token ids or list of chat messages", field="prompt")


def _encode(tokenizer, text: str, add_special_tokens: bool, max_model_len: int | None) -> list[int]:
    try:
        return encode_text(tokenizer, text, add_special_tokens, max_tokens=max_model_len)
    except TooManyTokens as exc:  # the same error check_prompt_length gives, without building the list
        check_prompt_length(exc.count, max_model_len)  # raises: the count exceeds it
        raise


def _check_text_length(text: str, tokenizer, max_model_len: int | None, field: str) -> None:
    limit = max_prompt_chars(tokenizer, max_model_len) if max_model_len else None
    if limit is not None and len(text) > limit:
        raise InvalidRequestError(
            f"{field}: {len(text)} characters cannot fit in max_model_len {max_model_len} tokens "
            f"(this tokenizer covers at most {limit // (2 * max_model_len)} characters per token)", field=field)


def render_chat(messages: list[dict[str, Any]], tokenizer, tools: list | None = None,
                tool_parser: str = "hermes") -> str:
    """Apply the tokenizer's chat template, ready for the assistant's reply.

    Tools (and earlier tool calls) reach the prompt even when the template ignores them: they are
    then written into the messages in ``tool_parser``'s format (see asyncllm/tools/prompting.py)."""
    messages = validate_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages: this model's tokenizer has no chat template", field="messages")
    messages, tools = prepare_messages(messages, tools, tokenizer, tool_parser)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # jinja raises many kinds of errors for malformed messages
        raise InvalidRequestError(f"messages: cannot render the chat template: {exc}", field="messages") from exc


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            f"prompt: {num_tokens} tokens, but max_model_len is {max_model_len} "
            "(the prompt plus at least one generated token must fit)", field="prompt")
