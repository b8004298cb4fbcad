"""Logprobs and prompt logprobs against transformers' log-softmax."""

import math

import pytest

from asyncllm import LLM, SamplingParams
from checkpoints import load_reference_model, reference_logprobs


@pytest.fixture(scope="module")
def llama(model_dirs):
    return LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, max_num_batched_tokens=16)


def test_chosen_and_prompt_logprobs_match_transformers(llama, model_dirs):
    prompt = [11, 400, 23, 87, 5, 900, 61, 62, 63, 301, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # chunked: 16 + 3
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llama.generate([prompt], params)
    completion = out.outputs[0]
    full = prompt + completion.token_ids
    ref = reference_logprobs(model_dirs["llama"], full, model=load_reference_model(model_dirs["llama"]))
    assert len(completion.logprobs) == 10
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token] - float(row[token])) < 1e-4
        assert 3 <= len(entry) <= 4  # the chosen token plus the top 3
        for t, lp in entry.items():
            assert abs(lp - float(row[t])) < 1e-4
    assert math.isclose(completion.cumulative_logprob, sum(e[t] for t, e in zip(completion.token_ids, completion.logprobs)),
                        abs_tol=1e-4)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[i][prompt[i]] - float(ref[i - 1, prompt[i]])) < 1e-4


def test_logprobs_off_by_default(llama):
    (out,) = llama.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out.outputs[0].logprobs is None and out.prompt_logprobs is None
    assert out.outputs[0].cumulative_logprob < 0
