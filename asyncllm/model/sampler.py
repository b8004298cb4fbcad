"""Batched sampling over one step's logits rows.

Every row carries its own SamplingParams. The whole batch is processed with tensor ops; the only
per-row Python work is gathering parameters and drawing noise for rows with their own seed
(so a seeded request gets the same tokens whatever else shares its batch).

On an accelerator the host never waits in here but once: every decision (greedy or sampled rows,
min-p present, top-k/top-p in use) is taken from the rows' parameters on the host, parameters
travel by non-blocking copies (kernels/transfer.py), and the chosen ids, their logprobs and any
top-k come back together in one copy at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import torch

from ..gil import GILHandover
from ..kernels.transfer import to_device, to_host
from ..sampling_params import SamplingParams
from ..kernels.cpu_ops import greedy_kernel_available, greedy_pick
from ..structured import GrammarState, apply_grammar_masks, grammar_bitmask


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    min_tokens_blocked: list[int]  # token ids forbidden while min_tokens is not reached
    grammar: GrammarState | None = None  # structured output: only the tokens it allows may be sampled
    bad_words: list[list[int]] | None = None  # token sequences never completed (SamplingParams.bad_words)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                      # log-probability of each chosen token
    top_logprobs: list[dict[int, float] | None]  # per row: chosen token + top-k, when asked


def sample(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None,
           fused_greedy: bool = False) -> SamplerOutput:
    """Pick one token per row of ``logits`` ([rows, vocab]) following each row's params.

    Log-probabilities are those of the model's raw distribution (before penalties and temperature),
    as vLLM and OpenAI report them. ``fused_greedy`` lets an all-greedy batch on CPU take the C
    kernel (the engine's CPU fast path); the torch code below gives the same tokens.
    """
    picked = _fused_greedy(logits, rows) if fused_greedy else None
    if picked is not None:
        return SamplerOutput(picked[0], picked[1], [None] * len(rows))
    raw = logits.float()
    # The full log-softmax only when some row reports top logprobs; the chosen tokens' logprobs
    # alone need one logsumexp per row (this runs every step, on [rows, vocab]).
    wants_top = any(r.params.logprobs is not None for r in rows)
    raw_logprobs = torch.log_softmax(raw, dim=-1) if wants_top else None
    logits = raw.clone() if any(_modifies_logits(r) for r in rows) else raw
    _apply_logit_bias(logits, rows)
    _apply_bad_words(logits, rows)
    _apply_min_tokens(logits, rows)
    _apply_penalties(logits, rows)
    _apply_grammars(logits, rows)
    chosen = logits.argmax(dim=-1)
    greedy = [r.params.greedy for r in rows]
    if not all(greedy):
        sampled = _sample_random(logits, rows, generator)
        chosen = torch.where(to_device(greedy, logits.device, torch.bool), chosen, sampled) if any(greedy) else sampled
    if raw_logprobs is not None:
        chosen_logprobs = raw_logprobs.gather(1, chosen[:, None]).squeeze(1)
    else:
        chosen_logprobs = raw.gather(1, chosen[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
    # one copy back for the whole step: ids, their logprobs and the top-k, as float64 columns
    # (exact for token ids and for float32 logprobs)
    k_max = max((r.params.logprobs or 0 for r in rows), default=0) if wants_top else 0
    columns = [chosen.double()[:, None], chosen_logprobs.double()[:, None]]
    if k_max:
        top_values, top_ids = raw_logprobs.topk(k_max, dim=-1)
        columns += [top_ids.double(), top_values.double()]
    host = to_host(torch.cat(columns, dim=1))
    token_ids = host[:, 0].astype(np.int64).tolist()
    top = _top_logprobs(host, rows, k_max) if wants_top else [None] * len(rows)
    return SamplerOutput(token_ids, host[:, 1].tolist(), top)


def _fused_greedy(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[float]] | None:
    """The common CPU case in one C pass per row: every row greedy, without top logprobs and without
    logits processors other than a grammar (applied from its bitmask inside the kernel).
    ``None`` where that does not apply; the general path below then runs."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or not greedy_kernel_available():
        return None
    if not all(_greedy_grammar_only(r) for r in rows):
        return None
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if not constrained:
        return greedy_pick(logits)
    bitmask = grammar_bitmask([rows[i].grammar for i in constrained], logits.shape[1])
    mask_rows = [-1] * len(rows)
    for k, i in enumerate(constrained):
        mask_rows[i] = k
    return greedy_pick(logits, bitmask, mask_rows)


def _greedy_grammar_only(row: SamplingRow) -> bool:
    """Greedy, no top logprobs, no logits processor but (maybe) a grammar."""
    p = row.params
    return (p.greedy and p.logprobs is None and not p.logit_bias and not row.min_tokens_blocked
            and not _has_penalty(p) and not row.bad_words)


def _modifies_logits(row: SamplingRow) -> bool:
    """Whether any logits processor below will write to this row (otherwise the raw logits are used as is)."""
    p = row.params
    return (bool(p.logit_bias) or bool(row.min_tokens_blocked) or _has_penalty(p) or row.grammar is not None
            or bool(row.bad_words))


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.params.logit_bias:
            ids = to_device(list(row.params.logit_bias), logits.device)
            bias = to_device(list(row.params.logit_bias.values()), logits.device, torch.float32)
            logits[i].index_add_(0, ids, bias)


def _apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Ban the token that would complete a bad word: a one-token word always, a longer one when the
    output ends with the rest of it."""
    for i, row in enumerate(rows):
        if not row.bad_words:
            continue
        output = row.output_token_ids
        banned = [ids[-1] for ids in row.bad_words
                  if len(ids) == 1 or (len(output) >= len(ids) - 1 and output[len(output) - len(ids) + 1:] == ids[:-1])]
        if banned:
            logits[i].index_fill_(0, to_device(banned, logits.device), float("-inf"))


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        if row.min_tokens_blocked and len(row.output_token_ids) < row.params.min_tokens:
            logits[i].index_fill_(0, to_device(row.min_tokens_blocked, logits.device), float("-inf"))


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, vLLM-style."""
    needs = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
    if not needs:
        return
    vocab = logits.shape[1]
    device = logits.device
    for i in needs:  # rows with penalties are the exception; one small scatter each
        p = rows[i].params
        counts = torch.zeros(vocab, device=device)
        if rows[i].output_token_ids:
            out = to_device(rows[i].output_token_ids, device)
            counts.index_add_(0, out, torch.ones(len(out), device=device))
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if rows[i].prompt_token_ids:
                seen.index_fill_(0, to_device(rows[i].prompt_token_ids, device), True)
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def _apply_grammars(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid what each constrained row's grammar forbids; unconstrained rows are not touched.
    Runs after the other logit processors so that top-k/top-p/min-p choose among allowed tokens."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if constrained:
        apply_grammar_masks(logits, constrained, [rows[i].grammar for i in constrained])


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _sample_random(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None) -> torch.Tensor:
    device = logits.device
    # greedy rows (temperature below the epsilon) are divided by 1: their pick is the argmax anyway
    temperature = to_device([1.0 if r.params.greedy else r.params.temperature for r in rows], device, torch.float32)
    logits = logits / temperature[:, None]
    logits = _apply_top_k_top_p(logits, rows)
    probs = torch.softmax(logits, dim=-1)
    if any(r.params.min_p > 0 for r in rows):  # decided on the host: no device round trip
        min_p = to_device([r.params.min_p for r in rows], device, torch.float32)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p without a CDF search.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.params.greedy:
            noise[i].exponential_(generator=row.generator)
    return (probs / noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    top_k = [r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in rows]
    top_p = [r.params.top_p for r in rows]
    if all(k >= logits.shape[1] for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=device)[None, :]
    drop = ranks >= to_device(top_k, device)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop = mass_before >= to_device(top_p, device, torch.float32)[:, None]
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_logprobs(host: np.ndarray, rows: list[SamplingRow], k_max: int) -> list[dict[int, float] | None]:
    """Per row that asked: its chosen token's logprob, then its top-k (``host``: the sampler's
    columns on the host, ``[chosen, logprob, k_max ids, k_max values]``)."""
    result: list[dict[int, float] | None] = []
    for i, row in enumerate(rows):
        k = row.params.logprobs
        if k is None:
            result.append(None)
            continue
        entry = {int(host[i, 0]): float(host[i, 1])}
        ids, values = host[i, 2:2 + k].astype(np.int64).tolist(), host[i, 2 + k_max:2 + k_max + k].tolist()
        for token, value in zip(ids, values):
            entry.setdefault(token, value)
        result.append(entry)
    return result


# Rows of prompt logits log-softmaxed at once: the float32 copies beside the logits stay this small
# however many positions a step carries (the scheduler bounds those too, engine/scheduler.py).
PROMPT_LOGPROBS_SLICE_BYTES = 8 * 2**20


def prompt_logprobs(raw_logits: torch.Tensor, next_token_ids: list[int], k: int) -> list[dict[int, float]]:
    """For each position, the logprob of the prompt's actual next token plus the top-``k``; worked
    through in slices of ``PROMPT_LOGPROBS_SLICE_BYTES`` of float32 rows (row by row the same values)."""
    if not next_token_ids:
        return []
    step = max(1, PROMPT_LOGPROBS_SLICE_BYTES // (4 * raw_logits.shape[1]))
    targets = to_device(next_token_ids, raw_logits.device)[:, None]
    parts = []
    for lo in range(0, len(next_token_ids), step):
        logprobs = torch.log_softmax(raw_logits[lo:lo + step].float(), dim=-1)
        columns = [logprobs.gather(1, targets[lo:lo + step]).double()]
        if k:
            top_values, top_ids = logprobs.topk(k, dim=-1)
            columns += [top_ids.double(), top_values.double()]
        parts.append(torch.cat(columns, dim=1))  # [rows, 1 + 2k] doubles: small
    host = to_host(torch.cat(parts))  # one copy back
    result = []
    hand_over = GILHandover()  # thousands of dicts built in Python: let the host's loop in now and then
    for i, token in enumerate(next_token_ids):
        hand_over()
        entry = {token: float(host[i, 0])}
        if k:
            for t, v in zip(host[i, 1:1 + k].astype(np.int64).tolist(), host[i, 1 + k:].tolist()):
                entry.setdefault(t, v)
        result.append(entry)
    return result
