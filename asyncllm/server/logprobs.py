"""Engine logprobs (one ``{token_id: logprob}`` dict per token) in OpenAI's two formats."""

from __future__ import annotations

import json
import math
import threading
import weakref
from typing import Any, Optional

from ..gil import GILHandover
from .raw_json import RawJSON

from .protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

# JSON has no -inf; vLLM reports fully masked tokens with this floor too
_FLOOR = -9999.0


def _clamp(value: float) -> float:
    return max(value, _FLOOR)


def token_text(tokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as text (special tokens included), as OpenAI shows it in logprobs; ``as_id``
    (vLLM's ``return_tokens_as_token_ids``): ``"token_id:<id>"``, unambiguous where pieces of a
    character decode to nothing readable."""
    if as_id:
        return f"token_id:{token_id}"
    return _decoded(tokenizer, token_id)


# Each tokenizer's token texts, decoded once: a prompt's logprobs decode ~20 tokens per position,
# mostly the same few hundred. Held weakly, so a closed engine's tokenizer is not kept alive.
_TEXTS: "weakref.WeakKeyDictionary[Any, dict[int, str]]" = weakref.WeakKeyDictionary()
_TEXTS_LOCK = threading.Lock()


def _decoded(tokenizer, token_id: int) -> str:
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        with _TEXTS_LOCK:
            texts = _TEXTS.setdefault(tokenizer, {})
    text = texts.get(token_id)
    if text is None:
        text = texts[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
    return text


def _top(entries: dict[int, float], k: int) -> list[tuple[int, float]]:
    # the dict holds the top k plus the chosen token; a chosen token outside the top k ranks last
    return sorted(entries.items(), key=lambda item: item[1], reverse=True)[:k]


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], top_k: int,
                  as_ids: bool = False) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat completion (or chunk)."""
    content = []
    for token_id, entries in zip(token_ids, logprobs):
        chosen = _top_logprob(tokenizer, token_id, entries.get(token_id, _FLOOR), as_ids)
        top = [_top_logprob(tokenizer, tid, lp, as_ids) for tid, lp in _top(entries, top_k)]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


def prompt_logprobs_json(tokenizer, entries: list[dict[int, float] | None] | None,
                         as_ids: bool = False) -> RawJSON | None:
    """vLLM's ``prompt_logprobs``: per prompt token null (the first) or ``{token id: {"logprob",
    "decoded_token"}}`` for the actual token and the top-k, as JSON text.

    Written as text, not built as dicts: a 2,000-token prompt's 20 logprobs each are 84,000 dicts, and
    allocating that many containers sets off the collector's full passes over the host's whole heap
    (measured: 300 ms with the loop blocked, 75 ms without the collector)."""
    if entries is None:
        return None
    pieces: list[str] = []
    hand_over = GILHandover()  # thousands of positions: let the host's loop in
    for entry in entries:
        if entry is None:
            pieces.append("null")
        else:
            pieces.append("{" + ",".join(f'"{tid}":{{"logprob":{_json_float(lp)},"decoded_token":'
                                         f'{_json_text_of(tokenizer, tid, as_ids)}}}' for tid, lp in entry.items()) + "}")
        hand_over()
    return RawJSON("[" + ",".join(pieces) + "]")


def _json_float(value: float) -> str:
    value = _clamp(value)
    return repr(float(value)) if math.isfinite(value) else repr(_FLOOR)


def _json_text_of(tokenizer, token_id: int, as_id: bool) -> str:
    return json.dumps(token_text(tokenizer, token_id, as_id), ensure_ascii=False)


def _top_logprob(tokenizer, token_id: int, logprob: float, as_id: bool = False) -> TopLogprob:
    text = token_text(tokenizer, token_id, as_id)
    return TopLogprob(token=text, logprob=_clamp(logprob), bytes=list(text.encode()))


class CompletionLogprobsBuilder:
    """Legacy completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)
    for one choice, kept across stream chunks so text offsets continue."""

    def __init__(self, tokenizer, top_k: int, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.as_ids = as_ids
        self.offset = 0  # characters of the choice's text so far

    def build(self, token_ids: list[int], logprobs: list[Optional[dict[int, float]]]) -> CompletionLogprobs:
        """Logprobs of these tokens; an entry of None (a prompt's first token) has no logprob."""
        out = CompletionLogprobs()
        for token_id, entries in zip(token_ids, logprobs):
            text = token_text(self.tokenizer, token_id, self.as_ids)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(token_text(self.tokenizer, token_id) if self.as_ids else text)  # offsets in the text
            if entries is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_clamp(entries.get(token_id, _FLOOR)))
            out.top_logprobs.append({token_text(self.tokenizer, tid, self.as_ids): _clamp(lp)
                                     for tid, lp in _top(entries, self.top_k)})
        return out
