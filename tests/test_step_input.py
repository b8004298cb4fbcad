"""The model runner works from a plain step record (model/step_io.py), never the engine's
Sequence objects: a record survives pickling (as it would crossing to another process) and gives
the same logits, equal to transformers' next-token logits."""

from __future__ import annotations

import pickle

import torch

from asyncllm import LLM
from asyncllm.model.step_io import StepInput
from checkpoints import load_reference_model


def test_runner_from_a_plain_record(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, attention_backend="torch")
    runner = llm.engine.runner
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    step = StepInput(token_ids=[t for p in prompts for t in p], start_positions=[0, 0], num_new_tokens=[6, 3],
                     block_tables=[[0, 1], [2]], logit_rows=[5, 8])
    copy = pickle.loads(pickle.dumps(step))
    logits = runner.execute(step).logits
    assert torch.equal(logits, runner.execute(copy).logits)  # the KV it writes is the same: same result
    reference = load_reference_model(model_dirs["llama"])
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            expected = reference(torch.tensor([prompt])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, rtol=1e-4, atol=1e-4)
    # a decode step continues from the KV the prefill wrote
    decode = StepInput(token_ids=[int(logits[0].argmax())], start_positions=[6], num_new_tokens=[1],
                       block_tables=[[0, 1]], logit_rows=[0])
    with torch.no_grad():
        expected = reference(torch.tensor([prompts[0] + decode.token_ids])).logits[0, -1]
    torch.testing.assert_close(runner.execute(decode).logits[0], expected, rtol=1e-4, atol=1e-4)


class _Seq:  # what BlockTableRows reads of a sequence
    def __init__(self, table):
        from asyncllm.engine.request import SequenceStatus

        self.block_table, self.status = table, SequenceStatus.RUNNING


def test_block_table_rows_send_only_changes():
    from asyncllm.engine.block_tables import BlockTableRows
    from asyncllm.engine.request import SequenceStatus

    rows = BlockTableRows(capacity=2)
    a, b = _Seq([3, 4]), _Seq([7])
    assert rows.describe([a, b]) == ([0, 1], [(0, 0, [3, 4]), (1, 0, [7])])  # new rows: whole tables
    assert rows.describe([a, b]) == ([0, 1], [])                             # nothing changed
    a.block_table.append(9)
    assert rows.describe([a, b]) == ([0, 1], [(0, 2, [9])])                  # grown: the new block only
    a.block_table[-1] = 12                                                   # copy-on-write of the last block
    assert rows.describe([a]) == ([0], [(0, 2, [12])])
    b.status = SequenceStatus.FINISHED                                       # its row is released ...
    c = _Seq([5, 6])
    assert rows.describe([a, c]) == ([0, 1], [(1, 0, [5, 6])])               # ... and reused from block 0
    a.block_table[:] = [20]                                                  # recomputed after preemption
    assert rows.describe([a, c]) == ([0, 1], [(0, 0, [20])])
