"""An incremental scanner for one tool-call JSON object: ``{"name": ..., "arguments": {...}}``.

It reads the object character by character, tracking only string/escape state and nesting depth,
which is enough to find the object's top-level keys, when the name is complete, where the
arguments' text starts and where the object ends. The arguments are handed out as the exact text
the model wrote (a JSON object's source), so streamed pieces join to the same string a
whole-text parse gives, whatever the split. This reads output; it never constrains generation.
"""

from __future__ import annotations

import json

from .calls import ToolCall, new_call_id

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes/Qwen and Mistral say arguments; Llama 3 parameters


class CallScanner:
    """Feed text starting at the object's ``{``; collect fragments with :meth:`take_fragments`."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.done = False
        self.name: str | None = None
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = True
        self._key: str | None = None
        self._string_start = 0
        self._value_start: int | None = None
        self._args_start: int | None = None   # a container value: streamed as it grows
        self._args_end: int | None = None
        self._args_whole: str | None = None   # a string or primitive value: handed out at its end
        self._sent_header = False
        self._sent_args = 0
        self._fragments: list[ToolCall] = []

    def feed(self, chunk: str) -> int:
        """Consume characters up to the end of the object; return how many were consumed."""
        for i, ch in enumerate(chunk):
            self._step(ch)
            if self.done:
                self._emit()
                return i + 1
        self._emit()
        return len(chunk)

    def take_fragments(self) -> list[ToolCall]:
        fragments, self._fragments = self._fragments, []
        return fragments

    @property
    def valid(self) -> bool:
        """Whether this is a call (it has a name); fragments are only ever emitted for calls."""
        return self.name is not None

    # ---- character level ------------------------------------------------------------------------
    def _step(self, ch: str) -> None:
        pos = len(self.text)
        self.text += ch
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 1:
                    self._end_top_string(pos)
            return
        if ch == '"':
            self._in_string = True
            if self._depth == 1:
                self._string_start = pos
                if not self._expect_key and self._value_start is None:
                    self._value_start = pos
        elif ch in "{[":
            if self._depth == 1 and not self._expect_key and self._value_start is None:
                self._value_start = pos
                if self._key in ARGUMENT_KEYS:
                    self._args_start = pos
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_value(pos + 1)
            elif self._depth <= 0:
                self._end_primitive(pos)
                self.done = True
        elif self._depth == 1:
            self._top_level_char(ch, pos)

    def _top_level_char(self, ch: str, pos: int) -> None:
        if ch == ":":
            self._expect_key, self._value_start = False, None
        elif ch == ",":
            self._end_primitive(pos)
            self._expect_key, self._key = True, None
        elif not ch.isspace() and not self._expect_key and self._value_start is None:
            self._value_start = pos  # a number, true, false or null

    def _end_top_string(self, pos: int) -> None:
        literal = self.text[self._string_start:pos + 1]
        if self._expect_key:
            self._key = _loads(literal)
        else:
            self._end_value(pos + 1)

    def _end_primitive(self, pos: int) -> None:
        if self._value_start is not None:
            self._end_value(pos)

    def _end_value(self, end: int) -> None:
        if self._value_start is None:
            return
        raw = self.text[self._value_start:end].strip()
        if self._key == "name":
            name = _loads(raw)
            self.name = name if isinstance(name, str) and name else None
        elif self._key in ARGUMENT_KEYS:
            if self._args_start is not None:
                self._args_end = end
            else:  # arguments given as a JSON-encoded string (some models do this), or a bare value
                value = _loads(raw)
                self._args_whole = value if isinstance(value, str) else raw
        self._value_start = None

    # ---- fragments --------------------------------------------------------------------------------
    def _emit(self) -> None:
        if self.name is None:
            return  # nothing is known to be a call yet: hold everything back
        if not self._sent_header:
            self._fragments.append(ToolCall(self.index, new_call_id(), self.name, ""))
            self._sent_header = True
        if self._args_start is not None:
            end = self._args_end if self._args_end is not None else len(self.text)
            piece = self.text[self._args_start + self._sent_args:end]
            if piece:
                self._fragments.append(ToolCall(self.index, arguments=piece))
                self._sent_args += len(piece)
        elif self.done:
            self._fragments.append(ToolCall(self.index, arguments=self._args_whole or "{}"))


def _loads(literal: str):
    try:
        return json.loads(literal)
    except ValueError:
        return None
