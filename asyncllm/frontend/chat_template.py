"""Rendering a tokenizer's chat template with bounded time and output size.

The operator owns the template, but it runs on client data (messages, tools, chat_template_kwargs)
in the input worker threads that every request shares: one rendering that loops for hours or
builds a gigabyte string would stall them all. So templates render here rather than through
``tokenizer.apply_chat_template``, with the same result (tests/test_chat_template_sandbox.py
compares both on many conversations and templates) and three bounds:

* time: ``RENDER_DEADLINE_S`` per render, enforced by a line tracer on the template's own code in
  the rendering thread (asyncllm/frontend/render_deadline.py);
* size: no value the template builds, and not the rendered text, may exceed ``max_chars``
  characters (asyncllm/frontend/template_sandbox.py refuses the operations before they run);
* loops: ``RANGE_ITEMS`` range() items per render, all loops together.

Past a bound the render stops with an InvalidRequestError on ``messages`` (HTTP 400) naming the
bound, and the thread is free for the next request.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any, Mapping

from ..errors import InvalidRequestError
from .render_deadline import deadline
from .template_sandbox import (DEFAULT_MAX_CHARS, DEFAULT_RANGE_ITEMS, TEMPLATE_FILENAME, TemplateLimitError,
                               render_budget)

RENDER_DEADLINE_S = 2.0  # seconds per render (read at each render: tests and operators may change it)
RANGE_ITEMS = DEFAULT_RANGE_ITEMS
# transformers marks the final message with this to find where its text ends in the rendered chat;
# the same marker keeps templates that look at the text (its length, its end) rendering the same.
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_TAG "


def template_source(tokenizer, tools: list | None = None) -> str:
    """The template apply_chat_template would use: with several named ones, ``tool_use`` when there
    are tools and it exists, else ``default`` (transformers' own choice where the tokenizer has it)."""
    choose = getattr(tokenizer, "get_chat_template", None)
    if choose is not None:
        return choose(None, tools)
    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, dict):
        name = "tool_use" if tools is not None and "tool_use" in templates else "default"
        if name not in templates:
            raise ValueError(f"the tokenizer has several chat templates ({', '.join(sorted(templates))}) "
                             "and none named 'default'")
        return templates[name]
    if not templates:
        raise ValueError("the tokenizer has no chat template")
    return templates


@lru_cache(maxsize=1)
def _environment():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from .template_sandbox import ChatTemplateEnvironment

    # transformers builds its environment inside its compile function: a template of its own gives it.
    return ChatTemplateEnvironment(_compile_jinja_template("").environment)


@lru_cache(maxsize=32)
def compile_template(source: str):
    """The template compiled in the bounded sandbox (once per template text)."""
    env = _environment()
    code = env.compile(source, filename=TEMPLATE_FILENAME)  # the deadline traces code from this file only
    return env.template_class.from_code(env, code, env.make_globals(None), None)


@lru_cache(maxsize=1)
def _helpers() -> tuple:
    """transformers' preparation of a chat for its template, where this version has it.

    Older versions lack some: they passed the data on as it was, so that is what the fallbacks do
    (on a copy: the continued message is edited)."""
    from transformers.utils import chat_template_utils as utils

    same = copy.deepcopy
    return (getattr(utils, "_normalize_chat_messages", same), getattr(utils, "_plain_template_data", same),
            getattr(utils, "_alias_reasoning_fields", lambda chat: chat), getattr(utils, "_REASONING_FIELDS", ()),
            utils.get_json_schema)


def render_chat_template(tokenizer, messages: list[dict[str, Any]], tools: list | None = None,
                         documents: list[dict[str, str]] | None = None, *, add_generation_prompt: bool = False,
                         continue_final_message: bool | str = False, template_kwargs: Mapping[str, Any] | None = None,
                         max_chars: int | None = None, deadline_s: float | None = None) -> str:
    """``tokenizer.apply_chat_template(messages, tools, documents, tokenize=False, ...)``, bounded.

    ``max_chars`` bounds the rendered text and every value the template builds (default
    DEFAULT_MAX_CHARS); ``deadline_s`` the time (default RENDER_DEADLINE_S). Past either bound:
    InvalidRequestError on ``messages``; other errors of the template or the chat are raised as
    transformers raises them (ValueError, jinja's TemplateError...)."""
    source = template_source(tokenizer, tools)
    template = compile_template(source)
    if not messages:
        raise ValueError("cannot render an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    normalize, plain, alias_reasoning, reasoning_fields, json_schema = _helpers()
    if tools is not None:
        tools = [tool if isinstance(tool, dict) else json_schema(tool) for tool in tools]
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise TypeError("documents must be dicts with 'title' and 'text' keys")
    chat = plain(normalize(messages))
    if not all(isinstance(message, dict) for message in chat):
        raise TypeError("chat messages must be dicts")
    chat = alias_reasoning(chat)
    variables = plain({**getattr(tokenizer, "special_tokens_map", {}), **(template_kwargs or {})})
    continued = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        continued = _mark_final_message(chat, field, source, reasoning_fields)
    rendered = _render(template, dict(variables, messages=chat, tools=plain(tools), documents=plain(documents),
                                      add_generation_prompt=add_generation_prompt),
                       DEFAULT_MAX_CHARS if max_chars is None else max_chars,
                       RENDER_DEADLINE_S if deadline_s is None else deadline_s)
    return rendered if continued is None else _cut_at_mark(rendered, continued)


def _render(template, variables: dict[str, Any], max_chars: int, deadline_s: float) -> str:
    """The template's text, built piece by piece and stopped at the first bound it passes."""
    pieces, total = [], 0
    try:
        with render_budget(max_chars, RANGE_ITEMS) as budget, \
                deadline(deadline_s, TEMPLATE_FILENAME, lambda: TemplateLimitError(f"time limit of {deadline_s:g} s")):
            stream = template.generate(**variables)
            try:
                for piece in stream:
                    total += len(piece)
                    budget.refuse_over(total)
                    pieces.append(piece)
            finally:
                stream.close()  # a render stopped early leaves no suspended frame behind
    except TemplateLimitError as exc:
        raise InvalidRequestError(f"messages: the chat template went past its {exc}", field="messages") from None
    return "".join(pieces)


def _mark_final_message(chat: list[dict], field: str, source: str, reasoning_fields: tuple) -> Any:
    """Append the continue mark to the final message's text (every copy of it the template may read);
    return that text as it was."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f"continue_final_message: the final message has no {field!r} to continue")
    fields = [name for name in reasoning_fields if chat[-1].get(name) == final] if field in reasoning_fields \
        else [field]
    if not any(name in source for name in fields):
        raise ValueError(f"continue_final_message: the chat template does not read the final message's {field!r}")
    if isinstance(final, (list, tuple)):  # content parts: the last text part is the one continued
        part = next((part for part in reversed(final) if "text" in part), None)
        if part is None:
            raise ValueError("continue_final_message: the final message has no text to continue")
        text, part["text"] = part["text"], part["text"] + _CONTINUE_MARK
        return text
    for name in fields:
        chat[-1][name] = chat[-1][name] + _CONTINUE_MARK
    return final


def _cut_at_mark(rendered: str, final_text: str) -> str:
    """The rendered chat up to where the final message's text ends."""
    mark = _CONTINUE_MARK.strip()
    if final_text.strip() not in rendered or mark not in rendered:
        raise ValueError("continue_final_message: the chat template drops part of the final message, "
                         "so it cannot be continued")
    at = rendered.rindex(mark)
    # A template that strips the message's trailing space leaves the mark without its own: then the
    # text before it may end in spaces the message did not have, which go too.
    return rendered[:at] if rendered.startswith(_CONTINUE_MARK, at) else rendered[:at].rstrip()
