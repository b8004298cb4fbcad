"""A CPU step that mixes decodes and prefill chunks, cut in two: the decode rows for the decode stack,
the prefill chunks for the eager model.

The decode stack (kernels/cpu_decode_stack.py) runs one-token rows only. Without the cut, one
prefill chunk in a step sends every decoding row of that step through the eager model, which is
slower per row: measured on SmolLM2-135M bfloat16 at 32 streams, mixed steps of 19 decodes and 163
prompt tokens took 154 ms against about 105 ms for the two parts run apart. The sequences of the two
parts are distinct, so each part writes only its own KV slots and the order of the two passes does
not matter; the final hidden states are put back in the step's flat order for the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .step_io import StepInput


@dataclass
class MixedSplit:
    """The two parts of a mixed step and where their rows go in the step's flat token order."""

    decodes: StepInput
    prefills: StepInput
    decode_rows: np.ndarray   # flat positions (in the whole step) of the decode part's rows, in order
    prefill_rows: np.ndarray  # flat positions of the prefill part's rows, in order


def split_mixed(step: StepInput) -> MixedSplit | None:
    """Cut ``step`` into its one-token sequences and the rest; None when it has not both.

    The step must come from the engine (``table_rows`` set) with its ``table_updates`` already
    applied: the parts carry none. Embedding rows, images and M-RoPE positions are not handled here
    (the caller keeps such steps whole)."""
    counts = np.asarray(step.num_new_tokens, dtype=np.int64)
    single = counts == 1
    if single.all() or not single.any() or step.table_rows is None:
        return None
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    decode_seqs = np.flatnonzero(single)
    prefill_seqs = np.flatnonzero(~single)
    decode_rows = starts[decode_seqs]
    prefill_rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in prefill_seqs])
    tokens = np.asarray(step.token_ids, dtype=np.int64)
    return MixedSplit(_part(step, decode_seqs, tokens[decode_rows]), _part(step, prefill_seqs, tokens[prefill_rows]),
                      decode_rows, prefill_rows)


def _part(step: StepInput, seqs: np.ndarray, tokens: np.ndarray) -> StepInput:
    """The sequences ``seqs`` of ``step`` as a step of their own that returns every row's state."""
    pick = seqs.tolist()
    return replace(
        step, token_ids=tokens.tolist(), start_positions=[step.start_positions[i] for i in pick],
        num_new_tokens=[step.num_new_tokens[i] for i in pick], block_tables=None, logit_rows=list(range(len(tokens))),
        table_rows=[step.table_rows[i] for i in pick], table_updates=[], block_copies=[],
        loras=[step.loras[i] for i in pick] if step.loras else [], pool_rows=[],
        prompt_lens=[step.prompt_lens[i] for i in pick] if step.prompt_lens is not None else None)
