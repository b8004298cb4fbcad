"""The tool-call parser state machine shared by every format.

A parser is made per sequence and fed the sequence's text as it is generated. It returns what
is new: content (text outside tool calls) and tool-call fragments. Content before a call streams
as content; only a tail that could still be the start of a call marker is held back. Whitespace
at the edges of a call (between content and a call, between calls, after the last call) is not
content. Feeding the whole text at once or in any pieces gives the same content and calls.

Formats differ only in how calls are introduced, separated and closed, which subclasses declare:
``start`` (the marker that opens calls), ``list_open`` (an optional ``[`` after it),
``separator`` (between two calls of one block) and ``close`` (after the last call of a block).
"""

from __future__ import annotations

from typing import ClassVar

from .calls import ToolCall, merge_fragments
from .scanner import CallScanner

_CONTENT, _CALL_START, _OBJECT, _AFTER_CALL = "content", "call_start", "object", "after_call"
CALL_START = _CALL_START


class ToolParser:
    """Base class: feed text deltas, get ``(content, fragments)`` back; see the module doc."""

    name: ClassVar[str] = ""
    start: ClassVar[str] = ""
    list_open: ClassVar[str | None] = None
    separator: ClassVar[str | None] = None
    close: ClassVar[str | None] = None
    markers: ClassVar[tuple[str, ...]] = ()   # special-token texts the detokenizer must keep

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []        # fragments merged: the calls so far
        self._buf = ""
        self._state = _CONTENT
        self._in_list = False
        self._scanner: CallScanner | None = None
        self._held_ws = ""                     # trailing whitespace of the content, not yet shown
        self._strip_leading = False            # right after a call: leading whitespace is not content
        self._content: list[str] = []
        self._fragments: list[ToolCall] = []
        self._num_calls = 0

    # ---- public ---------------------------------------------------------------------------------
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Consume a text delta; return the new content and the new tool-call fragments."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The text has ended: resolve what was held back (an unfinished call keeps what it had).

        ``cut``: the text was cut short (``max_tokens``, the context length) rather than ended by
        the model, so a held-back beginning of a call marker, or a call object that does not name
        its function yet, is the start of a call that never finished, not content: it is dropped."""
        self._run(final=not cut)
        # whitespace before a call that was dropped is not content either
        dropped = cut and (bool(self._buf) or self._state != _CONTENT)
        if self._state == _OBJECT and self._scanner is not None:
            if cut and not self._scanner.valid:
                self._scanner = None
            else:
                self._end_call(self._scanner)
        elif self._buf and not cut:
            self._emit_content(self._buf)
        self._buf = ""
        if not self._num_calls and not dropped:
            self._content.append(self._held_ws)
        self._held_ws = ""
        return self._take()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole text at once: ``(content, calls)``."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        return content + rest, self.calls

    # ---- the state machine ------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        handlers = {_CONTENT: self._on_content, _CALL_START: self._on_call_start,
                    _OBJECT: self._on_object, _AFTER_CALL: self._on_after_call}
        while self._buf and handlers[self._state](final):
            pass

    def _on_content(self, final: bool) -> bool:
        at = self._buf.find(self.start)
        if at >= 0:
            self._emit_content(self._buf[:at], before_call=True)
            self._buf = self._buf[at + len(self.start):]
            self._state, self._in_list = _CALL_START, False
            return True
        keep = 0 if final else partial_suffix(self._buf, self.start)
        self._emit_content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_call_start(self, final: bool) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        if self.list_open and not self._in_list and self._buf.startswith(self.list_open):
            self._buf, self._in_list = self._buf[len(self.list_open):], True
            return True
        if self._buf[0] == "{":
            self._scanner = CallScanner(self._num_calls)
            self._state = _OBJECT
            return True
        self._state = _CONTENT  # not a call after all: what follows is content
        return True

    def _on_object(self, final: bool) -> bool:
        scanner = self._scanner
        used = scanner.feed(self._buf)
        self._buf = self._buf[used:]
        self._fragments.extend(scanner.take_fragments())
        if not scanner.done:
            return False
        self._end_call(scanner)
        self._state = _AFTER_CALL
        return True

    def _on_after_call(self, final: bool) -> bool:
        self._buf = self._buf.lstrip()
        if not self._buf:
            return False
        for token, state in ((self.separator, _CALL_START), (self.close, _CONTENT)):
            if not token:
                continue
            if self._buf.startswith(token):
                self._buf = self._buf[len(token):]
                self._state = state
                if state == _CONTENT:
                    self._in_list = False
                return True
            if token.startswith(self._buf):  # could still become the separator or the closer
                if final:  # the text ended inside it: a cut-off closer is not content
                    self._buf = ""
                return False
        self._state = _CONTENT
        return True

    def _end_call(self, scanner: CallScanner) -> None:
        self._scanner = None
        if scanner.valid:
            self._fragments.extend(scanner.take_fragments())
            self._num_calls += 1
            self._strip_leading = True
        else:  # an object that names no function is not a call: it was content
            self._emit_content(scanner.text)

    # ---- output -------------------------------------------------------------------------------
    def _emit_content(self, text: str, before_call: bool = False) -> None:
        if self._strip_leading:
            text = text.lstrip()
            if not text and not before_call:
                return
            self._strip_leading = False
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = "" if before_call else text[len(body):]
        if body:
            self._content.append(body)

    def _take(self) -> tuple[str, list[ToolCall]]:
        content, fragments = "".join(self._content), self._fragments
        self._content, self._fragments = [], []
        merge_fragments(self.calls, fragments)
        return content, fragments


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
