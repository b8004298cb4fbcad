"""Incremental detokenization and stop-string matching, one instance per sequence.

Text is produced token by token without re-decoding the whole output, and never splits a
multi-byte character (``tokenizers.decoders.DecodeStream`` buffers incomplete UTF-8).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    """Appends the text of each new token; ``prompt_ids`` give the decoder its left context."""

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        prompt_ids = _clean_context(tokenizer, prompt_ids)
        self._tokenizer = tokenizer
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(ids=prompt_ids, skip_special_tokens=skip_special_tokens)
        else:  # slow tokenizer: decode a short window and diff (vLLM's prefix/read offsets)
            self._ids = list(prompt_ids)
            self._prefix, self._read = 0, len(self._ids)
            self._skip = skip_special_tokens

    def step(self, token_id: int) -> str:
        """The text that ``token_id`` completes ("" while a character is still incomplete)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]


def _clean_context(tokenizer, prompt_ids: list[int], size: int = 8) -> list[int]:
    """The prompt's last tokens, as left context for the decoder (leading spaces of SentencePiece
    tokens depend on it), or none if they end inside a multi-byte character: the output's text
    must not begin with the rest of a character that belongs to the prompt."""
    tail = list(prompt_ids[-size:])
    if tail and tokenizer.decode(tail).endswith("\ufffd"):
        return []
    return tail


class StopStringMatcher:
    """Finds the first stop string in growing text, looking only at matches that end in the new text.

    The stop strings are kept in one set per length, so each new character costs one lookup per
    distinct length, however many stop strings a request sends (a ``text.find`` per string and
    token would cost 300,000 scans per token for a 300,000-string list, on the event loop)."""

    def __init__(self, stops: list[str], include_in_output: bool) -> None:
        self.stops = stops
        self.include = include_in_output
        self.hold_back = max((len(s) for s in stops), default=1) - 1
        self._by_length: dict[int, dict[str, int]] = {}  # length -> {stop: its place in the list}
        for order, stop in enumerate(stops):
            self._by_length.setdefault(len(stop), {}).setdefault(stop, order)
        self._lengths = sorted(self._by_length)

    def find(self, text: str, new_chars: int) -> tuple[str, int] | None:
        """``(stop, end_of_kept_text)`` for the earliest-starting stop string that now occurs in
        ``text`` (an occurrence ending before the new characters was found earlier), else None;
        of two starting at the same place, the one listed first."""
        if not self.stops:
            return None
        best: tuple[int, int, str] | None = None  # (start, place in the list, stop)
        for end in range(max(1, len(text) - new_chars + 1), len(text) + 1):
            for length in self._lengths:
                at = end - length
                if at < 0:
                    break
                if best is not None and at > best[0]:
                    continue
                candidate = text[at:end]
                order = self._by_length[length].get(candidate)
                if order is not None and (best is None or (at, order) < best[:2]):
                    best = (at, order, candidate)
        if best is None:
            return None
        at, _, stop = best
        return stop, at + len(stop) if self.include else at


class _NoText:
    """The detokenizer of an engine without a tokenizer (``skip_tokenizer_init``): no text."""

    @staticmethod
    def step(token_id: int) -> str:
        return ""


NO_TEXT = _NoText()
