"""Stop strings as an end condition on token sequences (beam search ends hypotheses on them).

Sampling requests match stop strings on the streamed text (detokenizer.py). Beam search must decide,
for every candidate of every step, whether it ends, before any text is shown; it follows transformers'
``StopStringCriteria``: a token sequence ends on a stop string when the string occurs in its text and
that occurrence reaches into the last token (an occurrence wholly inside earlier tokens would have
ended the sequence earlier).
"""

from __future__ import annotations


class StopStringEnds:
    """``ends(token_ids)``: the stop string the sequence's last token completes, or None."""

    def __init__(self, tokenizer, stop_strings: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stop_strings)
        # a character takes at most 4 bytes and a token at least one: this many tokens hold any stop string
        self.window = 4 * max(len(s) for s in self.stops) + 1

    def __call__(self, token_ids: list[int]) -> str | None:
        tail = token_ids[-self.window - 1:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        before = len(self.tokenizer.decode(tail[:-1], skip_special_tokens=False))
        for stop in self.stops:
            # an occurrence that ends after the text before the last token
            if stop in text[max(0, before - len(stop) + 1):]:
                return stop
        return None
