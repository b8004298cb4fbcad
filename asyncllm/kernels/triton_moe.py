"""Fused mixture-of-experts experts on CUDA in Triton (being written: until then every stack runs the
grouped torch path of model/moe.py)."""

from __future__ import annotations


def triton_available_for(stack) -> bool:
    """Whether the Triton kernel runs this expert stack (its activation, biases and dtype)."""
    return False


def triton_fused_experts(x, weights, ids, stack):
    raise NotImplementedError
