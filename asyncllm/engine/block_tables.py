"""Which row of the model runner's persistent block-table buffer each running sequence uses, and
what changed in its table since the runner last saw it.

The runner keeps every running sequence's block table in one buffer ([max_num_seqs, blocks per
sequence]) across steps; each step carries only the changes (a table grows by a block now and
then; copy-on-write replaces its last block; a preempted sequence comes back with a new table), so
the per-step record stays small however long the contexts are, and one copy moves the step's rows
to the device.
"""

from __future__ import annotations

from .request import Sequence, SequenceStatus

TableUpdate = tuple[int, int, list[int]]  # (row, first block index written, the blocks from there on)


class BlockTableRows:
    """Row assignment and change tracking for ``capacity`` (= ``max_num_seqs``) running sequences."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._rows: dict[Sequence, int] = {}
        self._sent: dict[Sequence, list[int]] = {}  # the table as the runner has it
        self._lists: dict[Sequence, list[int]] = {}  # the list object it was read from

    def describe(self, seqs: list[Sequence]) -> tuple[list[int], list[TableUpdate]]:
        """Rows of ``seqs`` (running, in batch order) and the updates that bring the runner's rows
        up to date. Rows of sequences no longer running are released first."""
        for seq in [s for s in self._rows if s.status is not SequenceStatus.RUNNING]:
            self._free.append(self._rows.pop(seq))
            del self._sent[seq], self._lists[seq]
        rows, updates = [], []
        for seq in seqs:
            row = self._rows.get(seq)
            if row is None:
                row = self._rows[seq] = self._free.pop()
                self._sent[seq] = []
            table, sent = seq.block_table, self._sent[seq]
            # While a sequence runs its table only grows, or has its last block replaced (copy-on-
            # write); a preempted one is released above and comes back with a new row. A table
            # replaced whole (a beam re-forked onto another beam's blocks) is a new list object.
            if table is not self._lists.get(seq) or len(table) != len(sent) or table[-1:] != sent[-1:]:
                start = len(sent) if table[:len(sent)] == sent else next(
                    (i for i, (a, b) in enumerate(zip(table, sent)) if a != b), len(table))
                if start < len(table):
                    updates.append((row, start, table[start:]))
                self._sent[seq] = list(table)
                self._lists[seq] = table
            rows.append(row)
        return rows, updates
