"""Encoding and decoding that stay fair to other threads, and a cheap length bound.

``tokenizer.encode`` of a few megabytes holds the GIL for a quarter of a second at its end (the
tokenizers binding builds its result with the GIL taken), which freezes an event loop even when
the call runs in a worker thread; ``decode`` of two million ids holds it for half a second. The
backend's batch calls (``encode_batch_fast``, ``decode_batch``) release the GIL while they work,
so large inputs go through them: same ids, same text (tests/test_robustness.py checks both).
Small inputs keep the ordinary calls, which are faster for a few tokens.
"""

from __future__ import annotations

import json
import weakref

LARGE_TEXT_CHARS = 16_384   # above this, encode through the GIL-releasing batch call
LARGE_IDS = 16_384          # above this, decode likewise

_max_token_chars: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if backend is not None and hasattr(backend, "encode_batch_fast") else None


IDS_PIECE = 32_768  # ids turned into Python ints per GIL hold (a few ms each)


class TooManyTokens(Exception):
    """The text has more tokens than allowed; ``count`` says how many."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.count = count


def encode_text(tokenizer, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``, releasing the GIL for large texts.

    With ``max_tokens``, a longer result raises TooManyTokens before its ids become Python ints (for
    two million tokens that conversion alone holds the GIL for ~0.2 s); long results are converted in
    pieces, so other threads (the event loop) run in between."""
    backend = _backend(tokenizer)
    if backend is None or len(text) <= LARGE_TEXT_CHARS:
        ids = list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids))
        return ids
    encoding = backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
    if max_tokens is not None and len(encoding) > max_tokens:
        raise TooManyTokens(len(encoding))
    if len(encoding) <= IDS_PIECE:
        return encoding.ids
    encoding.truncate(IDS_PIECE, stride=0)  # the rest moves to ``overflowing``, in pieces of that size
    ids = encoding.ids
    for piece in encoding.overflowing:
        ids.extend(piece.ids)
    return ids


def decode_ids(tokenizer, ids: list[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(ids, ...)``, releasing the GIL for long id lists.

    Tokenizers that clean up spaces after decoding (WordPiece-style) keep the ordinary call, so
    the text is always what ``tokenizer.decode`` gives."""
    backend = _backend(tokenizer)
    if backend is None or len(ids) <= LARGE_IDS or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]


def max_prompt_chars(tokenizer, max_model_len: int) -> int | None:
    """The longest text that could still fit ``max_model_len`` tokens, or None when unknown.

    A token stands for at most as many characters as its vocabulary entry has (byte-level and
    SentencePiece entries spell every byte or character they cover), so a text longer than
    ``max_model_len`` times the longest entry cannot fit and is refused before the (slow) tokenizer
    sees it. A normalizer may shorten the text before that (NFC composes, and we leave a factor of
    2 for it); for normalizers that can drop arbitrary text the bound is not used."""
    try:
        cached = _max_token_chars.get(tokenizer)
    except TypeError:  # not weak-referenceable (a test stand-in): no bound
        return None
    if cached is None:
        cached = _longest_entry(tokenizer)
        _max_token_chars[tokenizer] = cached
    return 2 * cached * max_model_len if cached else None


def _longest_entry(tokenizer) -> int:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return 0
    try:
        normalizer = json.loads(backend.to_str()).get("normalizer")
    except (ValueError, AttributeError):
        return 0
    if not _never_drops_text(normalizer):
        return 0
    return max((len(token) for token in tokenizer.get_vocab()), default=0)


def _never_drops_text(normalizer) -> bool:
    """Normalizers that keep (or grow) the text, up to composition: none, Unicode forms, Prepend,
    and one-character replacements (SentencePiece's space -> "\u2581")."""
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_never_drops_text(n) for n in normalizer.get("normalizers", []))
    if kind in ("NFC", "NFD", "NFKC", "NFKD", "Prepend"):
        return True
    if kind == "Replace":
        pattern = (normalizer.get("pattern") or {}).get("String")
        return isinstance(pattern, str) and len(pattern) == 1 and bool(normalizer.get("content"))
    return False
