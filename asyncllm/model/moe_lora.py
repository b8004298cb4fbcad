"""The routed experts of one layer with LoRA on the experts' own weights (PEFT ``target_parameters``).

An adapter that targets ``experts.gate_up_proj`` / ``experts.down_proj`` holds, per expert ``e``, a pair
``A_e`` [rank, in] and ``B_e`` [out, rank]; a token routed to ``e`` under that adapter sees
``W_e + B_e A_e`` there. The gate/up delta lands before the activation, so it cannot be added to the
layer's output afterwards: the experts run as two grouped phases over the step's (token, expert) pairs,
sorted by expert as :func:`model.moe.grouped_experts` sorts them, each phase's base products per expert
and then every adapted pair's ``B (A v)`` at once (gathered per pair: a few small batched products).
Steps without such an adapter keep the layer's fast kernels; this path is the torch one on every device.

Under tensor parallelism the slots hold whole-model tensors and each rank takes its share here: its
gate/up columns of ``B``, its intermediate columns of the down projection's ``A`` (the partial products
are summed by the layer's all-reduce); under expert parallelism a rank runs only its own experts' pairs.
"""

from __future__ import annotations

import torch


def experts_with_lora(stack, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, row_slots: torch.Tensor,
                      adapters: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """This rank's part of the routed experts' weighted sum for ``x`` [T, H], with every pair's LoRA delta.

    ``stack``: the layer's :class:`model.moe.ExpertStack`; ``weights``/``ids`` [T, k]: the routing;
    ``row_slots``: each token row's LoRA slot (-1 or past its end: the base model); ``adapters``: per expert
    target, the slots' stacks A [slots, E, R, in] and B [slots, E, out, R] (B pre-scaled)."""
    tokens, k = ids.shape
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    first, local = stack.first_expert, stack.local_experts
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    order = order[(flat[order] >= first) & (flat[order] < first + local)]  # this rank's experts' pairs
    pair_experts, pair_tokens = flat[order], order // k
    if pair_tokens.numel() == 0:  # expert parallel: no token chose this rank's experts this step
        return out
    pair_weights = weights.reshape(-1)[order].to(x.dtype)
    slots = torch.full((tokens,), -1, dtype=torch.int64, device=x.device)
    known = min(tokens, row_slots.numel())
    slots[:known] = row_slots[:known]
    pair_slots = slots[pair_tokens]
    counts = torch.bincount(pair_experts - first, minlength=local).tolist()

    state = x.index_select(0, pair_tokens)
    if stack.moe.weights_on_input:
        state = state * pair_weights[:, None]
    gate_up = _per_expert(state, counts, stack.project_gate_up)
    if "experts.gate_up_proj" in adapters:
        _add_delta(gate_up, state, pair_slots, pair_experts, *adapters["experts.gate_up_proj"],
                   out_rows=_gate_up_rows(stack, x.device))
    hidden = stack.activation(gate_up)
    y = _per_expert(hidden, counts, stack.project_down)
    if "experts.down_proj" in adapters:
        _add_delta(y, hidden, pair_slots, pair_experts, *adapters["experts.down_proj"], in_columns=_down_columns(stack))
    if not stack.moe.weights_on_input:
        y = y * pair_weights[:, None]
    out.index_add_(0, pair_tokens, y)
    return out


def _per_expert(rows: torch.Tensor, counts: list[int], product) -> torch.Tensor:
    """``product(e, rows of expert e)`` for each local expert's consecutive run of rows, concatenated."""
    parts, start = [], 0
    for e, count in enumerate(counts):
        if count:
            parts.append(product(e, rows[start:start + count]))
            start += count
    return torch.cat(parts) if parts else rows.new_zeros((0, 0))


def _add_delta(target: torch.Tensor, inputs: torch.Tensor, pair_slots: torch.Tensor, pair_experts: torch.Tensor,
               a_stack: torch.Tensor, b_stack: torch.Tensor, out_rows: torch.Tensor | None = None,
               in_columns: slice | None = None) -> None:
    """``target[p] += B[slot_p, e_p] (A[slot_p, e_p] inputs[p])`` for every pair under an adapter."""
    adapted = ((pair_slots >= 0) & (pair_slots < a_stack.shape[0])).nonzero().squeeze(1)
    if adapted.numel() == 0:
        return
    slot, expert = pair_slots[adapted], pair_experts[adapted]
    a = a_stack[slot, expert]                      # [P, R, in]
    if in_columns is not None:
        a = a[:, :, in_columns]
    b = b_stack[slot, expert]                      # [P, out, R]
    if out_rows is not None:
        b = b.index_select(1, out_rows)
    z = torch.bmm(a, inputs.index_select(0, adapted).to(a.dtype).unsqueeze(-1))
    delta = torch.bmm(b, z).squeeze(-1)
    target.index_add_(0, adapted, delta.to(target.dtype))


def _gate_up_rows(stack, device: torch.device) -> torch.Tensor | None:
    """Under tensor parallelism: this rank's rows of the whole gate/up output (its gate, then its up share)."""
    whole, start, columns = stack.moe.intermediate_size, stack.column_start, stack.columns
    if columns == whole:
        return None
    rows = getattr(stack, "_lora_gate_up_rows", None)
    if rows is None or rows.device != device:
        rows = torch.cat([torch.arange(start, start + columns), torch.arange(whole + start, whole + start + columns)])
        rows = stack._lora_gate_up_rows = rows.to(device)
    return rows


def _down_columns(stack) -> slice | None:
    """Under tensor parallelism: this rank's intermediate columns of the down projection's input."""
    if stack.columns == stack.moe.intermediate_size:
        return None
    return slice(stack.column_start, stack.column_start + stack.columns)
