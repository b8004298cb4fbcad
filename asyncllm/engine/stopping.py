"""When a sequence is done (EOS, stop token, length), and the longest sequence the engine allows."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config import EngineConfig
from ..errors import ConfigError
from ..model.rotary import rope_parameters, rope_type_of
from ..sampling_params import SamplingParams
from .request import Sequence

logger = logging.getLogger(__name__)


def resolve_max_model_len(config: EngineConfig, hf_config) -> int:
    """``max_model_len``, defaulting to the model's. Sliding windows do not cap it: attention applies
    them (model/decoder.py)."""
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    params = rope_parameters(hf_config)
    if rope_type_of(params) == "dynamic":  # dynamic NTK rope exists to stretch the context by its factor
        limit = int(limit * float(params.get("factor", 1.0)))
    value = config.max_model_len or limit
    if value > limit:
        raise ConfigError(f"max_model_len={value} exceeds the model's max_position_embeddings ({limit})")
    return value


def _token_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple)) else {int(value)}


class StopChecker:
    """Decides, after each new token, whether a sequence finishes and why."""

    def __init__(self, root: Path, hf_config, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.eos_token_ids = _token_set(getattr(hf_config, "eos_token_id", None))
        path = root / "generation_config.json"
        if path.is_file():  # read as JSON: transformers' GenerationConfig refuses files with odd sampling values
            try:
                self.eos_token_ids |= _token_set(json.loads(path.read_text()).get("eos_token_id"))
            except (OSError, ValueError, TypeError) as e:
                logger.warning("ignoring the eos_token_id of %s: %s", path, e)

    def min_tokens_blocked(self, params: SamplingParams) -> list[int]:
        """Tokens that would end the sequence, forbidden until ``min_tokens`` are generated."""
        blocked = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            blocked |= self.eos_token_ids
        return sorted(blocked)

    def check(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """(finish_reason, stop_reason) after ``token`` was appended, or (None, None)."""
        params = seq.params
        if seq.num_output_tokens > params.min_tokens:  # the sampler blocked these tokens until now
            if params.stop_token_ids and token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
        if seq.num_output_tokens >= seq.request.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", None
        return None, None
