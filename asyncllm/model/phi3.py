"""Phi-3 (``Phi3ForCausalLM``): the Llama-family decoder with fused checkpoints.

Its layers are the Llama family's (RMSNorm, rope, SiLU-gated MLP, no biases), and its checkpoints
store ``qkv_proj`` (q rows, then k, then v) and ``gate_up_proj`` (gate rows, then up) fused exactly
as the engine keeps them, so the registry entry needs no weight mapping. What this file checks are
the variants the shared decoder does not implement: partial rotary embeddings and the "longrope"
scaling of the 128k-context models are refused with a clear error. A sliding window (Phi-3-mini-4k
has 2,047) caps ``max_model_len`` as for Mistral (engine/stopping.py), which keeps outputs exact.
"""

from __future__ import annotations

from ..errors import ModelLoadError


def check_phi3_config(config) -> None:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    if partial != 1.0:
        raise ModelLoadError(f"Phi-3 with partial_rotary_factor={partial} is not supported (only 1.0)")
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type in ("longrope", "su"):  # its factors switch with the sequence length at run time
        raise ModelLoadError(f"Phi-3 with rope scaling {rope_type!r} is not supported yet "
                             "(the 128k-context 'longrope' models); the 4k-context models load")
