"""Checks on prompt text that every front shares (kept free of pydantic: imported at package import)."""

from __future__ import annotations


def check_utf8(text: str, field: str) -> None:
    """A string the tokenizer can take: no lone surrogates (``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} is not valid Unicode text (character {exc.start}: a lone surrogate)") from None
