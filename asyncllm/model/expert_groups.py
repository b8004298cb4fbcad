"""A step's (token, expert) pairs grouped by expert, each expert run once over all of its tokens.

Shared by the float experts' torch path (model/moe.py's ``grouped_experts``) and the quantized checkpoints'
per-expert modules (model/moe_quantized.py): what differs between them is only how one expert computes.
"""

from __future__ import annotations

import torch


def run_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, first_expert: int, local: int,
                weights_on_input: bool, expert) -> torch.Tensor:
    """The routed experts' weighted sum (model/moe.py's ``grouped_experts``) with each expert's computation
    given: ``expert(e, rows) -> outputs`` for local expert ``e`` and the (token) rows routed to it, in token
    order."""
    tokens, k = ids.shape
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, then by token (transformers' summation order)
    counts = torch.bincount(flat, minlength=first_expert + local)[first_expert:first_expert + local].tolist()
    start = int((flat < first_expert).sum()) if first_expert else 0
    pair_tokens = order // k
    pair_weights = weights.reshape(-1)[order].to(x.dtype)
    rows, row_tokens = [], []
    for e, count in enumerate(counts):
        if count == 0:
            continue
        take = slice(start, start + count)
        start += count
        token_ids = pair_tokens[take]
        state = x.index_select(0, token_ids)
        if weights_on_input:
            state = state * pair_weights[take, None]
        y = expert(e, state)
        rows.append(y if weights_on_input else y * pair_weights[take, None])
        row_tokens.append(token_ids)
    if rows:
        out.index_add_(0, torch.cat(row_tokens), torch.cat(rows))
    return out
