"""The Triton LoRA kernels (under TRITON_INTERPRET=1) against the torch reference."""

import pytest
import torch

from asyncllm.adapters.slots import LoRASlots
from asyncllm.kernels.ops import triton_ops
from asyncllm.model.llama import DecoderShape

pytest.importorskip("triton")


def _shape() -> DecoderShape:
    return DecoderShape(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, qkv_bias=False, qk_norm=False,
                        tie_word_embeddings=False)


class _Adapter:
    """Just what LoRASlots reads from a LoRAWeights."""

    def __init__(self, adapter_id: int, weights: dict):
        self.adapter_id, self.weights = adapter_id, weights


def _adapter(adapter_id: int, rank: int, targets: list[str], shapes: dict, gen: torch.Generator) -> _Adapter:
    weights = {}
    for layer in range(2):
        for target in targets:
            in_features, out_features = shapes[target]
            weights[(layer, target)] = (torch.randn(rank, in_features, generator=gen),
                                        torch.randn(out_features, rank, generator=gen) * 0.5)
    return _Adapter(adapter_id, weights)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_kernels_equal_reference_on_a_mixed_batch(dtype, tolerance, monkeypatch):
    import asyncllm.kernels.lora_kernels as kernels

    launches = []
    real_launch = kernels._launch
    monkeypatch.setattr(kernels, "_launch", lambda *a, **k: launches.append(1) or real_launch(*a, **k))
    gen = torch.Generator().manual_seed(0)
    slots = LoRASlots(_shape(), max_loras=3, max_rank=8, device=torch.device("cpu"), dtype=dtype)
    adapters = [_adapter(1, 8, ["q_proj", "v_proj", "down_proj"], slots.shapes, gen),
                _adapter(2, 3, ["k_proj", "o_proj", "gate_proj", "up_proj"], slots.shapes, gen),
                _adapter(3, 5, list(slots.shapes), slots.shapes, gen)]
    mapping = slots.activate(adapters, set())
    tokens = 37
    # ragged, interleaved segments (some tokens on the base model), 20 tokens in one segment
    token_adapter = [(i * 7) % 4 for i in range(tokens)]  # 0 = base
    rows: dict[int, list[int]] = {}
    for row, a in enumerate(token_adapter):
        if a:
            rows.setdefault(mapping[a], []).append(row)
    slots.set_groups(rows)
    for fused, width_in in (("qkv_proj", 32), ("o_proj", 32), ("gate_up_proj", 32), ("down_proj", 48)):
        out_width = {"qkv_proj": 64, "o_proj": 32, "gate_up_proj": 96, "down_proj": 32}[fused]
        x = torch.randn(tokens, width_in, generator=gen).to(dtype)
        base = torch.randn(tokens, out_width, generator=gen).to(dtype)
        expected, got = base.clone(), base.clone()
        slots.apply(1, fused, x, expected)  # torch reference (Triton ops not enabled)
        with triton_ops():
            slots.apply(1, fused, x, got)
        assert not torch.equal(expected, base)
        torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
        untouched = [r for r, a in enumerate(token_adapter) if a == 0]
        assert torch.equal(got[untouched], base[untouched])  # base-model tokens get nothing added
    assert len(launches) == 2 * 7  # a shrink and an expand per projection part: the kernels really ran
