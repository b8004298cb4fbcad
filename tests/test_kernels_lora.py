"""The Triton LoRA kernels (under TRITON_INTERPRET=1) against the torch reference."""

import pytest
import torch

from asyncllm.adapters.slots import LoRASlots
from asyncllm.kernels.ops import triton_ops
from kernel_cases import lora_adapter as _adapter
from kernel_cases import lora_test_shape as _shape

pytest.importorskip("triton")


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
