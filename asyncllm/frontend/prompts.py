"""Turning a prompt (text, token ids or chat messages) into validated token ids."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from ..errors import InvalidRequestError, short_repr
from ..tools.prompting import prepare_messages
from .chat_template import render_chat_template
from .text import check_utf8
from .tokenizing import TooManyTokens, encode_text, max_prompt_chars

# Arguments of apply_chat_template, which chat_template_kwargs may not set: ChatPrompt sets some itself,
# and the others change what is rendered or how (``chat_template`` would let a client replace the
# operator's template with its own Jinja code). Every named parameter of this transformers' version
# is reserved too, so a new one is closed by default.
_RESERVED_TEMPLATE_KEYS = {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                           "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                           "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
                           "processor_kwargs", "sanitize_control_tokens"}


def _template_call_parameters() -> set[str]:
    import inspect

    try:
        from transformers import PreTrainedTokenizerBase

        parameters = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return set()
    return {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}


_RESERVED_TEMPLATE_KEYS |= _template_call_parameters()


@dataclass
class ChatPrompt:
    """Chat messages with the template's options (a prompt like a plain list of messages).

    ``add_generation_prompt``: open the assistant's turn (the default); ``continue_final_message``:
    leave the last message open so that the model continues its text (e.g. a partial assistant
    answer), instead; ``chat_template_kwargs``: extra variables of the template (such as Qwen3's
    ``enable_thinking``)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """InvalidRequestError naming the bad option."""
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name}: expected a boolean", field=name)
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("continue_final_message: cannot be combined with add_generation_prompt "
                                      "(set add_generation_prompt to false)", field="continue_final_message")
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            self.chat_template_kwargs = {}
        elif not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise InvalidRequestError("chat_template_kwargs: expected an object of template variables",
                                      field="chat_template_kwargs")
        elif reserved := sorted(set(kwargs) & _RESERVED_TEMPLATE_KEYS):
            raise InvalidRequestError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                                      field="chat_template_kwargs")


# a dict is a multimodal prompt: {"prompt": text, "images": [...]} (frontend/multimodal.py)
Prompt = Union[str, list[int], list[dict[str, Any]], ChatPrompt, dict[str, Any]]


def is_chat(prompt: Any) -> bool:
    """A list of chat messages, or a ChatPrompt."""
    return isinstance(prompt, ChatPrompt) or (
        isinstance(prompt, (list, tuple)) and bool(prompt) and any(isinstance(m, dict) for m in prompt))


def tokenize_prompt(prompt: Prompt, tokenizer, vocab_size: int, tools: list | None = None,
                    tool_parser: str = "hermes", max_model_len: int | None = None,
                    multimodal=None) -> tuple[str | None, list[int], list]:
    """Return ``(prompt_text_or_None, token_ids, images)``; raise InvalidRequestError on bad input.

    With ``max_model_len``, a text too long to fit is refused before it is tokenized. ``multimodal``: a
    vision-language model's MultiModalProcessor (frontend/multimodal.py); ``images``: the prompt's
    ImageInputs (none without images)."""
    if isinstance(prompt, dict):
        from .multimodal import is_multimodal_prompt, prompt_images
    if isinstance(prompt, dict) and is_multimodal_prompt(prompt):
        text, sources = prompt_images(prompt)
        check_utf8_field(text, "prompt")
        _check_text_length(text, tokenizer, max_model_len, "prompt")
        if not sources and multimodal is None:  # {"prompt": ..., "images": []} to a text model: just the text
            return text, _encode(tokenizer, text, True, max_model_len), []
        return (text, *_with_images(multimodal, text, sources, True))
    if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:  # vLLM's TokensPrompt
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not ids:
            raise InvalidRequestError("prompt_token_ids: must be a non-empty list of token ids",
                                      field="prompt_token_ids")
        return None, _checked_token_ids(ids, vocab_size, "prompt_token_ids"), []
    if isinstance(prompt, dict):
        raise InvalidRequestError("prompt: a mapping must hold 'prompt' (and 'images' or 'multi_modal_data') "
                                  "or only 'prompt_token_ids'", field="prompt")
    if is_chat(prompt) and multimodal is not None:
        chat = prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(list(prompt))
        chat.check()
        sources: list = []
        text = render_chat(list(chat.messages), tokenizer, tools, tool_parser, chat,
                           max_chars=_render_limit(tokenizer, max_model_len), images=sources)
        _check_text_length(text, tokenizer, max_model_len, "messages")
        if sources:
            return (text, *_with_images(multimodal, text, sources, False))
        ids = _encode(tokenizer, text, False, max_model_len)
        if not ids:
            raise InvalidRequestError("messages: the chat template rendered an empty prompt", field="messages")
        return text, ids, []
    return (*_tokenize_text_prompt(prompt, tokenizer, vocab_size, tools, tool_parser, max_model_len), [])


def _with_images(multimodal, text: str, sources: list, add_special_tokens: bool) -> tuple[list[int], list]:
    if multimodal is None:
        raise InvalidRequestError(f"{sources[0][1] if sources else 'prompt'}: this model takes no images",
                                  field=(sources[0][1] if sources else "prompt").split("[")[0].split(".")[0])
    images = multimodal.load_images(sources)
    return multimodal.expand(text, images, add_special_tokens, [field for _, field in sources])


def check_utf8_field(text: str, field: str) -> None:
    try:
        check_utf8(text, field)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), field=field) from None


def _tokenize_text_prompt(prompt: Prompt, tokenizer, vocab_size: int, tools: list | None, tool_parser: str,
                          max_model_len: int | None) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty", field="prompt")
        try:
            check_utf8(prompt, "prompt")
        except ValueError as exc:
            raise InvalidRequestError(str(exc), field="prompt") from None
        _check_text_length(prompt, tokenizer, max_model_len, "prompt")
        return prompt, _encode(tokenizer, prompt, True, max_model_len)
    if is_chat(prompt):
        chat = prompt if isinstance(prompt, ChatPrompt) else ChatPrompt(list(prompt))
        chat.check()
        text = render_chat(list(chat.messages), tokenizer, tools, tool_parser, chat,
                           max_chars=_render_limit(tokenizer, max_model_len))
        _check_text_length(text, tokenizer, max_model_len, "messages")
        ids = _encode(tokenizer, text, False, max_model_len)
        if not ids:  # nothing to run: the engine would wait forever for a first token
            raise InvalidRequestError("messages: the chat template rendered an empty prompt", field="messages")
        return text, ids
    if isinstance(prompt, (list, tuple)) and prompt:
        return None, _checked_token_ids(prompt, vocab_size, "prompt")
    raise InvalidRequestError(
        "prompt: expected a non-empty string, list of token ids or list of chat messages", field="prompt")


def _checked_token_ids(ids, vocab_size: int, field: str) -> list[int]:
    ids = list(ids)
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"{field}: token id {short_repr(token, 40)} is not an integer in [0, {vocab_size})", field=field)
    return ids


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


MIN_RENDER_CHARS = 1 << 16


def _render_limit(tokenizer, max_model_len: int | None) -> int | None:
    """The size bound of a chat's rendering: what could still fit the model. Never below
    MIN_RENDER_CHARS, so that the template's working values have room and a chat a little too long
    gets _check_text_length's answer, which names max_model_len."""
    limit = max_prompt_chars(tokenizer, max_model_len) if max_model_len else None
    return None if limit is None else max(limit, MIN_RENDER_CHARS)


def render_chat(messages: list[dict[str, Any]], tokenizer, tools: list | None = None,
                tool_parser: str = "hermes", options: ChatPrompt | None = None, max_chars: int | None = None,
                images: list | None = None) -> str:
    """Apply the tokenizer's chat template, ready for the assistant's reply.

    Tools (and earlier tool calls) reach the prompt even when the template ignores them: they are
    then written into the messages in ``tool_parser``'s format (see asyncllm/tools/prompting.py).
    The template renders in a sandbox with bounded time and size (asyncllm/frontend/chat_template.py):
    ``max_chars`` bounds its output (default DEFAULT_MAX_CHARS there); past a bound, a 400."""
    from .messages import validate_messages  # pydantic: imported on the first chat prompt, not with asyncllm

    from .multimodal import take_image_sources

    messages, sources = take_image_sources(validate_messages(messages))
    if sources and images is None:  # a text-only model, or a route that takes no images
        raise InvalidRequestError(f"{sources[0][1]}: this model takes no images", field="messages")
    if images is not None:
        images.extend(sources)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("messages: this model's tokenizer has no chat template", field="messages")
    messages, tools = prepare_messages(messages, tools, tokenizer, tool_parser)
    options = options or ChatPrompt(messages)
    try:
        return render_chat_template(tokenizer, messages, tools, add_generation_prompt=options.add_generation_prompt,
                                    continue_final_message=options.continue_final_message,
                                    template_kwargs=options.chat_template_kwargs, max_chars=max_chars)
    except InvalidRequestError:  # a bound passed: the message says which
        raise
    except Exception as exc:  # jinja raises many kinds of errors for malformed messages
        raise InvalidRequestError(f"messages: cannot render the chat template: {exc}", field="messages") from exc


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            f"prompt: {num_tokens} tokens, but max_model_len is {max_model_len} "
            "(the prompt plus at least one generated token must fit)", field="prompt")


def chat_token_ids(messages: list[dict[str, Any]], tokenizer, tools: list | None, tool_parser: str,
                   multimodal=None) -> list[int]:
    """The ids a chat renders to, as /tokenize and Anthropic's count_tokens report them (a vision-language
    model's images expanded into their placeholders)."""
    if multimodal is not None:
        return tokenize_prompt(ChatPrompt(messages), tokenizer, 0, tools, tool_parser, None, multimodal)[1]
    text = render_chat(messages, tokenizer, tools, tool_parser)
    return encode_text(tokenizer, text, add_special_tokens=False)
