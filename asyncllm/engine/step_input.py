"""Building one step's ``StepInput`` (model/step_io.py) from the scheduler's batch."""

from __future__ import annotations

from ..model.mrope import step_rope_positions
from ..model.step_io import ImageRows, StepInput
from .block_tables import BlockTableRows
from .scheduler import ScheduledBatch


def step_input_of(batch: ScheduledBatch, logit_rows: list[int], tables: BlockTableRows,
                  pool_rows: list[int] = ()) -> StepInput:
    """The record of one scheduled batch; block tables travel as changes to the runner's rows."""
    token_ids: list[int] = []
    starts = []
    images: list[ImageRows] = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        if seq.request.images and start < seq.num_prompt_tokens:
            images.extend(_image_rows(seq.request.images, start, n, len(token_ids)))
        chunk = seq.token_ids[start:start + n]
        token_ids.extend(chunk)
        if len(chunk) < n:  # a speculative step: the last token, then the drafts to verify
            token_ids.extend(seq.draft_tokens[:n - len(chunk)])
        starts.append(start)
    rows, updates = tables.describe(batch.seqs)
    mrope = [seq.request.mrope for seq in batch.seqs]
    rope_positions = (step_rope_positions(mrope, starts, list(batch.num_new_tokens))
                      if any(m is not None for m in mrope) else None)
    return StepInput(token_ids=token_ids, start_positions=starts, num_new_tokens=list(batch.num_new_tokens),
                     block_tables=None, logit_rows=list(logit_rows), table_rows=rows, table_updates=updates,
                     block_copies=list(batch.block_copies), loras=[seq.request.lora for seq in batch.seqs],
                     loras_in_use=set(batch.loras_in_use), pool_rows=list(pool_rows),
                     prompt_lens=[len(seq.request.prompt_token_ids) for seq in batch.seqs], images=images,
                     rope_positions=rope_positions, encode_ahead=list(batch.encode_ahead),
                     encode_ahead_rows=batch.encode_ahead_rows)


def _image_rows(images: list, start: int, n: int, first_row: int) -> list[ImageRows]:
    """The parts of ``images`` that fall in prompt positions ``start .. start + n`` (flat row ``first_row`` on)."""
    rows = []
    for image in images:
        begin, end = max(start, image.offset), min(start + n, image.offset + image.length)
        if begin < end:
            rows.append(ImageRows(first_row + begin - start, image, begin - image.offset, end - begin))
    return rows
