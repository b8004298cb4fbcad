"""Which pooling turns a model's hidden states into an embedding by default.

A checkpoint made for embeddings with sentence-transformers says it in ``1_Pooling/config.json``
(``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens``); any other decoder model is embedded by
its last token's hidden state, the usual choice for causal models (their last token has seen the
whole text).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

POOLINGS = ("last", "mean")


def model_pooling(model_dir: Path) -> str:
    """"mean" or "last" as the checkpoint's sentence-transformers pooling config says; "last" without one."""
    path = Path(model_dir) / "1_Pooling" / "config.json"
    if not path.is_file():
        return "last"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return "last"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    return "last"


def embedding_kwargs(truncate_prompt_tokens: int | None = None) -> dict:
    """The sampling keywords of an embedding request: one greedy step's worth, never sampled."""
    kwargs: dict = {"max_tokens": 1, "temperature": 0.0}
    if truncate_prompt_tokens is not None:
        kwargs["truncate_prompt_tokens"] = truncate_prompt_tokens
    return kwargs
