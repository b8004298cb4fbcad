"""Fused mixture-of-experts experts on CUDA in Triton: tokens sorted by expert, one grouped GEMM per projection.

A step's (token, expert) pairs are laid out by expert in blocks of ``BLOCK_M`` rows (:func:`align_pairs`, torch
ops on the device with no host sync, so a decode step stays capturable as a CUDA graph): every block holds pairs
of one expert, padded with empty rows. Two kernels then run over those blocks:

- ``_gate_up_kernel``: ``h = act(x[token] @ w13[e].T + b13[e])`` for each block's pairs; gate and up columns are
  accumulated side by side so the gated activation (SiLU, or gpt-oss's clamped form) runs in the epilogue;
  Llama 4's routing weight on the input scales the loaded rows first;
- ``_down_kernel``: ``y = (h @ w2[e].T + b2[e]) * weight`` per pair, the routing weight applied in the epilogue,
  written to the pair's own row (no atomics: the k rows of a token are summed afterwards in a fixed order, so
  results are deterministic).

Each block reads its expert's weight tiles once for all of its rows. Pairs routed to experts another
expert-parallel rank holds are left out (their rows stay zero). The torch oracle is
``model/moe.py:reference_experts``; tests run these kernels in triton's interpreter at small shapes.
"""

from __future__ import annotations

import torch

from .triton_utils import dot_flags, triton_available

BLOCK_M = 16

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up_kernel(x_ptr, w13_ptr, b13_ptr, pair_map_ptr, block_expert_ptr, pair_weight_ptr, h_ptr,
                        H, I, top_k, stride_x, stride_we, stride_wn, stride_be, stride_h, alpha, limit,
                        HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ON_INPUT: tl.constexpr,
                        IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:  # a block past the step's last expert
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_map_ptr + rows)
        row_ok = pair >= 0
        token = tl.where(row_ok, pair // top_k, 0)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        w_base = w13_ptr + expert.to(tl.int64) * stride_we
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if ON_INPUT:
            scale = tl.load(pair_weight_ptr + tl.where(row_ok, pair, 0), mask=row_ok, other=0.0)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            xt = tl.load(x_ptr + token[:, None].to(tl.int64) * stride_x + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            mask = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)
            w_up = tl.load(w_base + (cols[None, :] + I) * stride_wn + ks[:, None], mask=mask, other=0.0)
            if UPCAST:  # the interpreter computes no bfloat16 (triton_utils.dot_flags)
                xt, w_gate, w_up = xt.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            if ON_INPUT:  # Llama 4: the routing weight scales the expert's input (rounded to the model's dtype)
                xt = (xt.to(tl.float32) * scale[:, None]).to(xt.dtype)
            if IEEE_DOT:  # float32 models: no TF32 rounding, so the kernel matches the float32 oracle
                acc_gate += tl.dot(xt, w_gate, input_precision="ieee")
                acc_up += tl.dot(xt, w_up, input_precision="ieee")
            else:
                acc_gate += tl.dot(xt, w_gate)
                acc_up += tl.dot(xt, w_up)
        if HAS_BIAS:
            b_base = b13_ptr + expert.to(tl.int64) * stride_be
            acc_gate += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(b_base + I + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION == 0:  # SiLU-gated
            h = acc_gate * tl.sigmoid(acc_gate) * acc_up
        else:  # gpt-oss: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha * gate)
            gate = tl.minimum(acc_gate, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            h = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w2_ptr, b2_ptr, pair_map_ptr, block_expert_ptr, pair_weight_ptr, out_ptr,
                     H, I, stride_h, stride_we, stride_wn, stride_be, stride_out,
                     HAS_BIAS: tl.constexpr, ON_INPUT: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        expert = tl.load(block_expert_ptr + pid_m)
        if expert < 0:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_map_ptr + rows)
        row_ok = pair >= 0
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        w_base = w2_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < I
            ht = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if UPCAST:
                ht, w = ht.to(tl.float32), w.to(tl.float32)
            if IEEE_DOT:
                acc += tl.dot(ht, w, input_precision="ieee")
            else:
                acc += tl.dot(ht, w)
        if HAS_BIAS:
            acc += tl.load(b2_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if not ON_INPUT:  # the routing weight, applied in the epilogue
            weight = tl.load(pair_weight_ptr + tl.where(row_ok, pair, 0), mask=row_ok, other=0.0)
            acc = acc * weight[:, None]
        out_rows = tl.where(row_ok, pair, 0).to(tl.int64)
        tl.store(out_ptr + out_rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def align_pairs(ids: torch.Tensor, first_expert: int, local_experts: int, block_m: int = BLOCK_M
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_map, block_expert) for ``ids`` [T, k]: ``pair_map`` [blocks * block_m] holds, block by block, the
    flat (token * k + j) index of each pair routed to the block's expert, -1 in padding rows; ``block_expert``
    [blocks] the block's local expert, -1 past the last one. ``blocks`` is an upper bound fixed by the shapes
    (pairs / block_m + experts), so nothing here waits for the device."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    local = flat - first_expert
    key = torch.where((local >= 0) & (local < local_experts), local, torch.full_like(local, local_experts))
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(local_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:local_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    sorted_start = torch.cumsum(counts, 0) - counts
    blocks = -(-pairs // block_m) + local_experts
    sorted_key = key[order]
    is_local = sorted_key < local_experts
    safe_key = torch.where(is_local, sorted_key, torch.zeros_like(sorted_key))
    rank = torch.arange(pairs, device=ids.device) - sorted_start[safe_key]
    dump = blocks * block_m  # one extra slot takes the other ranks' pairs
    dest = torch.where(is_local, padded_start[safe_key] + rank, torch.full_like(rank, dump))
    pair_map = torch.full((dump + 1,), -1, dtype=torch.int64, device=ids.device)
    pair_map.scatter_(0, dest, order)
    starts = torch.arange(blocks, device=ids.device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < local_experts, block_expert, torch.full_like(block_expert, -1))
    return pair_map[:dump].contiguous(), block_expert.to(torch.int32)


def _block_n(size: int) -> int:
    return max(16, min(64, triton.next_power_of_2(size)))


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  first_expert: int = 0, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: int = 0, alpha: float = 1.702, limit: float = 7.0,
                  weights_on_input: bool = False) -> torch.Tensor:
    """The routed experts' weighted sum ``[T, H]`` (``model/moe.py:grouped_experts``'s contract): ``w13``
    [E_local, 2I, H], ``w2`` [E_local, H, I], ``activation`` 0 (SiLU-gated) or 1 (gpt-oss clamped)."""
    tokens, top_k = ids.shape
    hidden, inter = x.shape[1], w2.shape[2]
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pair_map, block_expert = align_pairs(ids, first_expert, w13.shape[0])
    blocks = block_expert.numel()
    pair_weights = weights.reshape(-1).float().contiguous()
    h = torch.empty(blocks * BLOCK_M, inter, device=x.device, dtype=x.dtype)
    out_pairs = torch.zeros(tokens * top_k, hidden, device=x.device, dtype=torch.float32)
    has_bias = b13 is not None
    b13_arg = b13.contiguous() if has_bias else w13
    b2_arg = b2.contiguous() if b2 is not None else w2
    block_k = 32
    flags = dot_flags(x.dtype)
    n_inter, n_hidden = _block_n(inter), _block_n(hidden)
    _gate_up_kernel[(blocks, triton.cdiv(inter, n_inter))](
        x, w13, b13_arg, pair_map, block_expert, pair_weights, h, hidden, inter, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), b13_arg.stride(0), h.stride(0), float(alpha), float(limit),
        HAS_BIAS=has_bias, ACTIVATION=activation, ON_INPUT=weights_on_input, **flags,
        BLOCK_M=BLOCK_M, BLOCK_N=n_inter, BLOCK_K=block_k)
    _down_kernel[(blocks, triton.cdiv(hidden, n_hidden))](
        h, w2, b2_arg, pair_map, block_expert, pair_weights, out_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), b2_arg.stride(0), out_pairs.stride(0),
        HAS_BIAS=b2 is not None, ON_INPUT=weights_on_input, **flags, BLOCK_M=BLOCK_M, BLOCK_N=n_hidden, BLOCK_K=block_k)
    return out_pairs.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


_ACTIVATIONS = {"silu": 0, "swiglu_clamped": 1}


def triton_available_for(stack) -> bool:
    """Whether the Triton kernels run this expert stack (model/moe.py ExpertStack): any float dtype and shape,
    the two activations."""
    return triton_available() and stack.moe.activation in _ACTIVATIONS and stack.w13.dtype.is_floating_point


def triton_fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, stack) -> torch.Tensor:
    """:func:`fused_experts` over an ExpertStack's weights."""
    moe = stack.moe
    return fused_experts(x, weights, ids, stack.w13, stack.w2, stack.first_expert, stack.b13, stack.b2,
                         _ACTIVATIONS[moe.activation], moe.swiglu_alpha, moe.swiglu_limit, moe.weights_on_input)
