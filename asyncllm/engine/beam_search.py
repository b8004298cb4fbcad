"""Beam search over the paged KV cache: one ``BeamGroup`` per request with ``use_beam_search``.

The request's ``best_of`` sequences are the beams. They run as ordinary decodes; when every live
beam has the log-probabilities of its next token, the group takes one beam step:

1. every beam's log-probabilities plus its cumulative score, flattened over (beam, token); the best
   ``K = max(2, 1 + number of end tokens) * width`` candidates, best first;
2. candidates that end (an end token, a stop string reaching into the candidate's token, or the
   last allowed token) and rank among the first ``width``
   become finished hypotheses, scored ``sum of logprobs / generated_length ** length_penalty``;
   the ``width`` best finished ones are kept;
3. the ``width`` best candidates that do not end become the next beams. A beam continued by several
   candidates is forked: the extra children take the sequence objects of beams no candidate
   continued, share the parent's KV blocks (copy-on-write of the partial last block, as n > 1 does)
   and differ from it by their last token only;
4. the search stops when no running beam can beat the worst kept hypothesis (``early_stopping``
   False: judged at the current length; "never": at the longest length when the penalty rewards
   length), when every kept slot is finished (``early_stopping=True``), or when every candidate ends.

This is the rule transformers' ``generate(num_beams=k, do_sample=False)`` follows, so the top beam
equals its output token for token (tests/test_beam_search.py). The first step ranks only the
prompt's own continuations (all beams start equal), as transformers' initial scores of -1e9 for
beams 1..k-1 do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .request import Sequence, SequenceStatus


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens (the end token included), their log-probabilities."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    score: float  # length-normalised
    finish_reason: str
    stop_reason: int | str | None


@dataclass
class Beam:
    """A running beam: its sequence, cumulative log-probability and per-token history."""

    seq: Sequence
    score: float
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None


class BeamGroup:
    """The beams of one request and the hypotheses they finished."""

    def __init__(self, seqs: list[Sequence], max_new_tokens: int, end_tokens: set[int],
                 stop_token_ids: set[int]) -> None:
        params = seqs[0].params
        self.width = len(seqs)
        self.length_penalty = params.length_penalty
        self.early_stopping = params.early_stopping
        self.max_new_tokens = max_new_tokens
        self.end_tokens = end_tokens | stop_token_ids
        self.stop_token_ids = stop_token_ids
        self.stop_strings = seqs[0].request.beam_stop  # token ids -> the stop string they end with, or None
        self.num_candidates = max(2, 1 + len(self.end_tokens)) * self.width
        self.top_k = params.logprobs  # per-token top logprobs reported, or None
        self.beams = [Beam(seqs[0], 0.0, top_logprobs=[] if self.top_k is not None else None)]
        self.spares = list(seqs[1:])   # forked onto the leader at its prefill; assigned at the first step
        self.finished: list[Hypothesis] = []
        self.num_generated = 0
        self.improvable = True         # transformers' early-stop heuristic, sticky once False
        self._was_full = False         # every slot was finished when this step began
        self._rows: dict[Sequence, torch.Tensor] = {}
        self._awaited: set[Sequence] = {seqs[0]}  # beams whose row this step still needs

    @property
    def sequences(self) -> list[Sequence]:
        return [beam.seq for beam in self.beams] + self.spares

    def awaits(self, seq: Sequence) -> bool:
        """Whether the next beam step still needs ``seq``'s row (else it is idle: scheduler.py)."""
        return seq in self._awaited

    def offer(self, seq: Sequence, logprobs: torch.Tensor) -> bool:
        """Record a beam's next-token log-probabilities; True once every beam has its row. A row
        the step does not wait for (a spare's) is dropped."""
        if seq in self._awaited:
            self._rows[seq] = logprobs
            self._awaited.discard(seq)
        return not self._awaited

    def step(self, kv) -> bool:
        """Take one beam step (every beam has offered its row); True when the search is over."""
        rows = torch.stack([self._rows[beam.seq] for beam in self.beams])
        self._rows = {}
        scores = torch.tensor([beam.score for beam in self.beams], device=rows.device)
        flat = (rows + scores[:, None]).reshape(-1)
        values, indices = torch.topk(flat, min(self.num_candidates, flat.numel()))
        vocab = rows.shape[1]
        parents, tokens = (indices // vocab).tolist(), (indices % vocab).tolist()
        values = values.tolist()
        last = self.num_generated + 1 >= self.max_new_tokens
        chosen: list[tuple[Beam, int, float, float]] = []
        self._was_full = len(self.finished) == self.width
        all_end = True
        for rank, (parent, token, score) in enumerate(zip(parents, tokens, values)):
            beam = self.beams[parent]
            token_logprob = float(rows[parent, token])
            stop = self.stop_strings(beam.seq.token_ids + [token]) if self.stop_strings is not None else None
            ends = last or token in self.end_tokens or stop is not None
            all_end = all_end and ends
            if ends:
                if rank < self.width:
                    self._add_hypothesis(beam, token, score, token_logprob, rows[parent], stop)
            elif len(chosen) < self.width:
                chosen.append((beam, token, score, token_logprob))
        self.num_generated += 1
        if all_end or not chosen:
            return True
        self._continue(chosen, rows, kv)
        self._awaited = {beam.seq for beam in self.beams}
        return self._done()

    def _add_hypothesis(self, beam: Beam, token: int, score: float, token_logprob: float,
                        row: torch.Tensor, stop: str | None) -> None:
        if self.early_stopping is True and self._was_full:
            return  # transformers stops adding once every slot was finished
        generated = self.num_generated + 1
        normalised = score / (generated ** self.length_penalty)
        if len(self.finished) == self.width and normalised <= self.finished[-1].score:
            return
        ended = token in self.end_tokens or stop is not None
        reason = "stop" if ended else "length"
        stop_reason = stop if stop is not None else token if token in self.stop_token_ids else None
        tops = None
        if beam.top_logprobs is not None:
            tops = beam.top_logprobs + [self._top_entry(row, token)]
        seq = beam.seq
        hypothesis = Hypothesis(seq.output_token_ids + [token], beam.logprobs + [token_logprob], tops, normalised,
                                reason, stop_reason)
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: h.score, reverse=True)  # stable: earlier ones win ties
        del self.finished[self.width:]

    def _continue(self, chosen: list[tuple[Beam, int, float, float]], rows: torch.Tensor, kv) -> None:
        """Make ``chosen`` (parent, token, score, logprob) the running beams: fork where a parent
        continues more than once, reusing the sequences of parents that do not continue.

        Under KV pressure some beams are preempted (their blocks freed, scheduler.py). A fork of a
        preempted parent shares nothing and a waiting sequence takes no blocks: either way the
        child recomputes its tokens when scheduled (prefix-cache hits where they survive)."""
        used = {id(beam) for beam, *_ in chosen}
        free = [beam.seq for beam in self.beams if id(beam) not in used] + self.spares
        self.spares = []
        taken: set[int] = set()
        placed: list[tuple[Sequence, Beam, int, float, float]] = []
        for beam, token, score, logprob in chosen:  # every fork before any parent grows
            if id(beam) not in taken:
                taken.add(id(beam))
                placed.append((beam.seq, beam, token, score, logprob))
                continue
            seq = free.pop()
            kv.free(seq)
            seq.token_ids = list(beam.seq.token_ids)
            if seq.status is SequenceStatus.RUNNING:
                kv.fork(beam.seq, seq)
            else:  # waiting sequences hold no blocks; its cache keys must be the new tokens'
                seq.block_keys = list(beam.seq.block_keys)
            placed.append((seq, beam, token, score, logprob))
        for seq in free:  # fewer continuations than beams (stop strings): spare, without blocks
            kv.free(seq)
        self.spares = free
        parent_rows = {id(beam): i for i, beam in enumerate(self.beams)}
        new_beams = []
        for seq, beam, token, score, logprob in placed:
            tops = None
            if beam.top_logprobs is not None:
                tops = beam.top_logprobs + [self._top_entry(rows[parent_rows[id(beam)]], token)]
            new_beams.append(Beam(seq, score, beam.logprobs + [logprob], tops))
        for seq, _, token, _, _ in placed:
            seq.token_ids.append(token)
        self.beams = new_beams

    def _done(self) -> bool:
        """transformers' stopping rule, checked after each step (see the module docstring)."""
        full = len(self.finished) == self.width
        if self.early_stopping is True and full:
            return True
        if not full:
            return False
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_new_tokens
        else:
            length = self.num_generated
        best_running = self.beams[0].score / (length ** self.length_penalty)
        self.improvable = self.improvable and best_running > self.finished[-1].score
        return not self.improvable

    def _top_entry(self, row: torch.Tensor, token: int) -> dict[int, float]:
        entry = {token: float(row[token])}
        if self.top_k:
            values, ids = row.topk(self.top_k)
            for t, v in zip(ids.tolist(), values.tolist()):
                entry.setdefault(t, v)
        return entry

    def best(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first (topped up with running beams in the rare
        search that ends with fewer finished hypotheses than ``n``)."""
        result = self.finished[:n]
        for beam in self.beams[:max(n - len(result), 0)]:
            length = max(beam.seq.num_output_tokens, 1)
            result.append(Hypothesis(beam.seq.output_token_ids, beam.logprobs, beam.top_logprobs,
                                     beam.score / (length ** self.length_penalty), "length", None))
        return result
