"""Reasoning parsers: a reasoning model's thinking (``<think>...</think>``) apart from its answer.

``qwen3``: thinking is what the output puts between ``<think>`` at its start and ``</think>``; an
output that does not open with ``<think>`` (thinking switched off, ``enable_thinking: false``) is all
answer. ``deepseek_r1``: the chat template already opened the thinking in the prompt, so the output
is thinking up to ``</think>`` (an output without ``</think>`` is all thinking, cut short), and the
answer after it.

A splitter is fed the text of one choice as it streams and returns what is new on each side; a tag
split across deltas is held back until it is complete. Feeding a text whole or in any pieces gives
the same two parts.
"""

from __future__ import annotations

from ..tools.parser_base import partial_suffix

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningSplitter:
    """Splits one choice's text into reasoning and content (see the module docstring)."""

    def __init__(self, kind: str) -> None:
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {kind!r}")
        self.kind = kind
        self._buf = ""
        # qwen3: undecided until the output shows whether it opens with <think>
        self._state = "reasoning" if kind == "deepseek_r1" else "start"

    def feed(self, text: str) -> tuple[str, str]:
        """(new reasoning, new content) after ``text``."""
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held back when the text has ended."""
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(OPEN):
                    self._buf, self._state = stripped[len(OPEN):], "reasoning"
                    continue
                if not final and OPEN.startswith(stripped):
                    return reasoning, content  # still possibly the opening tag
                self._state = "content"
                continue
            if self._state == "reasoning":
                at = self._buf.find(CLOSE)
                if at >= 0:
                    reasoning += self._buf[:at]
                    self._buf, self._state = self._buf[at + len(CLOSE):].lstrip("\n"), "after"
                    continue
                keep = 0 if final else partial_suffix(self._buf, CLOSE)
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return reasoning, content
            if self._state == "after":  # newlines right after </think> are not content
                self._buf = self._buf.lstrip("\n")
                if not self._buf and not final:
                    return reasoning, content
                self._state = "content"
                continue
            content += self._buf
            self._buf = ""
            return reasoning, content


def split_reasoning(kind: str, text: str) -> tuple[str, str]:
    """A whole text's (reasoning, content)."""
    splitter = ReasoningSplitter(kind)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning, content + more_content
