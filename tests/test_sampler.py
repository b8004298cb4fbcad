"""The sampler on crafted logits: each SamplingParams knob does what it says."""

import torch

from asyncllm import SamplingParams
from asyncllm.model.sampler import SamplingRow, sample


def _row(prompt=(), output=(), generator=None, blocked=(), **kwargs) -> SamplingRow:
    return SamplingRow(SamplingParams(**kwargs), list(prompt), list(output), generator, list(blocked))


def _pick(logits, **kwargs) -> int:
    return sample(torch.tensor([logits]), [_row(**kwargs)]).token_ids[0]


def test_greedy_and_logit_bias():
    assert _pick([1.0, 3.0, 2.0], temperature=0) == 1
    assert _pick([1.0, 3.0, 2.0], temperature=0, logit_bias={2: 1.5}) == 2


def test_penalties():
    logits = [5.0, 4.5, 0.0]
    assert _pick(logits, temperature=0, output=[0], presence_penalty=1.0) == 1
    assert _pick(logits, temperature=0, output=[0], frequency_penalty=0.3) == 0          # 5 - 0.3 > 4.5
    assert _pick(logits, temperature=0, output=[0, 0], frequency_penalty=0.3) == 1       # 5 - 0.6 < 4.5
    assert _pick(logits, temperature=0, prompt=[0], repetition_penalty=2.0) == 1         # 5 / 2 < 4.5
    assert _pick([-1.0, -1.5], temperature=0, prompt=[0], repetition_penalty=2.0) == 1   # -1 * 2 < -1.5


def test_min_tokens_blocks_stop_tokens():
    assert _pick([9.0, 1.0], temperature=0, blocked=[0], min_tokens=2, output=[5]) == 1
    assert _pick([9.0, 1.0], temperature=0, blocked=[0], min_tokens=2, output=[5, 5]) == 0


def _frequencies(logits, n=6000, **kwargs) -> torch.Tensor:
    rows = [_row(**kwargs) for _ in range(n)]
    tokens = sample(torch.tensor([logits] * n), rows, torch.Generator().manual_seed(0)).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).float() / n


def test_temperature_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = _frequencies(probs.log().tolist(), temperature=1.0)
    assert torch.allclose(freq, probs, atol=0.03)
    hot = _frequencies(probs.log().tolist(), temperature=2.0)  # flatter than the original
    assert hot[3] > 0.08 and hot[0] < 0.45


def test_top_k_top_p_min_p_truncate():
    logits = torch.tensor([0.5, 0.3, 0.2]).log().tolist()
    assert _frequencies(logits, temperature=1.0, top_k=2)[2] == 0
    freq = _frequencies(logits, temperature=1.0, top_p=0.6)   # keeps 0.5 and 0.3 (mass before 0.3 < 0.6)
    assert freq[2] == 0 and freq[1] > 0.3
    freq = _frequencies(logits, temperature=1.0, min_p=0.5)   # threshold 0.25 drops 0.2
    assert freq[2] == 0 and freq[1] > 0.3
    assert _frequencies(logits, temperature=1.0, top_k=1)[0] == 1


def test_seeded_rows_are_reproducible_and_batch_independent():
    logits = torch.randn(1, 50).tolist()[0]
    alone = [sample(torch.tensor([logits]), [_row(generator=torch.Generator().manual_seed(3), temperature=1.0)])
             .token_ids[0] for _ in range(5)]
    mixed = []
    for _ in range(5):
        rows = [_row(temperature=1.0), _row(generator=torch.Generator().manual_seed(3), temperature=1.0), _row(temperature=0)]
        mixed.append(sample(torch.tensor([logits] * 3), rows, torch.Generator().manual_seed(9)).token_ids[1])
    assert alone == mixed


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    out = sample(logits, [_row(temperature=0, logprobs=2, presence_penalty=2.0, output=[0])])
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert out.token_ids == [1]  # the penalty moved the choice...
    assert abs(out.logprobs[0] - float(raw[1])) < 1e-6  # ...but not the reported logprob
    assert set(out.top_logprobs[0]) == {0, 1}
