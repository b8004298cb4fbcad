"""Sampling defaults a checkpoint ships in ``generation_config.json`` (``temperature``, ``top_p``, ...).

As vLLM does, they apply to requests that leave those parameters unset: a request given as keyword
arguments or as HTTP fields uses the checkpoint's value for every field it does not name. A
``SamplingParams`` object passed explicitly is used as it is. ``generation_config="none"`` (engine
argument, ``serve --generation-config none``) turns the defaults off.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json name -> SamplingParams name
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(root: Path) -> dict[str, Any]:
    """The SamplingParams defaults ``root/generation_config.json`` sets ({} when none).

    ``do_sample: false`` means greedy, as transformers reads it: temperature 0."""
    path = root / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    defaults = {ours: data[theirs] for theirs, ours in _FIELDS.items()
                if isinstance(data.get(theirs), (int, float)) and not isinstance(data.get(theirs), bool)}
    if data.get("do_sample") is False:
        defaults["temperature"] = 0.0
        for name in ("top_p", "top_k", "min_p"):
            defaults.pop(name, None)
    for name, value in list(defaults.items()):  # a bad file must not make every request fail
        try:
            SamplingParams(**{name: value}).validate()
        except (InvalidRequestError, TypeError) as e:
            logger.warning("ignoring %s=%r from %s: %s", name, value, path, e)
            del defaults[name]
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    return defaults
