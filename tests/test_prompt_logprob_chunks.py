"""prompt_logprobs in bounded chunks: a step computes at most ``max_prompt_logprob_rows`` prompt
positions' logprobs (engine/scheduler.py), sliced again in the sampler (model/sampler.py); the
values equal the unchunked ones and other streams decode between the chunks."""

import random

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.engine.scheduler import PROMPT_LOGPROBS_STEP_BYTES, prompt_logprob_rows
from asyncllm.model import sampler
from checkpoints import load_reference_model, reference_logprobs

PROMPT_LEN = 150
ROWS = 7  # the tiny bound the tests set: the prompt needs 22 chunks


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(length)]


def _record_chunks(llm: LLM) -> list[list[tuple[str, int]]]:
    """Per step: (sequence id, tokens scheduled) of every scheduled sequence."""
    steps: list[list[tuple[str, int]]] = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append([(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)])
        return batch

    llm.engine.scheduler.schedule = recording
    return steps


def test_bound_follows_the_vocabulary():
    assert prompt_logprob_rows(49152) == PROMPT_LOGPROBS_STEP_BYTES // (4 * 49152) == 341
    assert prompt_logprob_rows(10**9) == 1  # always at least one position a step


@pytest.mark.parametrize("tight_kv", [False, True], ids=["roomy", "preempted"])
def test_chunked_prompt_logprobs_equal_unchunked_and_transformers(model_dirs, monkeypatch, tight_kv):
    prompt = _prompt(PROMPT_LEN, 1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=5)
    whole = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    assert whole.engine.scheduler.max_prompt_logprob_rows > PROMPT_LEN  # the toy vocabulary: one chunk
    (expected,) = whole.generate([prompt], params)

    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_SLICE_BYTES", 3 * 4 * whole.engine.vocab_size)  # 3-row slices
    kwargs = dict(max_model_len=192, kv_cache_memory=48 * whole.engine.runner.bytes_per_block) if tight_kv else {}
    chunked = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, **kwargs)
    chunked.engine.scheduler.max_prompt_logprob_rows = ROWS
    steps = _record_chunks(chunked)
    others = [_prompt(30, 2)] if tight_kv else []  # an earlier request that outgrows the cache beside it
    other_params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    *_, got = chunked.generate(others + [prompt], [other_params] * len(others) + [params])

    chunks = [n for step in steps for seq_id, n in step if seq_id.endswith(f"-{len(others)}#0")]
    assert len(chunks) >= -(-(PROMPT_LEN - 1) // ROWS)
    if tight_kv:
        # preempted and recomputed: the positions already reported come back in one chunk
        assert chunked.stats()["num_preemptions"] > 0 and sum(chunks) > PROMPT_LEN + 4, chunks
    else:
        assert max(chunks[:-1]) == ROWS  # prompt chunks of at most ROWS positions (the last one samples)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.prompt_logprobs[0] is None and len(got.prompt_logprobs) == PROMPT_LEN
    ref = reference_logprobs(model_dirs["llama"], prompt, model=load_reference_model(model_dirs["llama"]))
    for i in range(1, PROMPT_LEN):
        mine, theirs = got.prompt_logprobs[i], expected.prompt_logprobs[i]
        assert next(iter(mine)) == prompt[i] and set(mine) == set(theirs)  # the actual token, the same top 5
        # chunking changes float32 summation orders (and the CPU kernels' vector width the host's ISA):
        # CI saw 1.2e-4 on a logprob of -2.9, so the bound is relative as well as absolute
        assert [mine[t] for t in theirs] == pytest.approx(list(theirs.values()), abs=1e-4, rel=1e-4)
        assert mine[prompt[i]] == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4, rel=1e-4)
    assert chunked.stats()["kv_blocks_used"] == 0


def test_decoding_stream_gets_a_token_every_chunk(model_dirs):
    """A stream that is decoding when a long prompt_logprobs request arrives gets a token in every
    step that carries one of that request's chunks."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    llm.engine.scheduler.max_prompt_logprob_rows = ROWS
    engine = llm.engine
    _, stream = llm.inputs.process(_prompt(10, 3), SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                   request_id="stream")
    _, long = llm.inputs.process(_prompt(PROMPT_LEN, 4), SamplingParams(temperature=0, max_tokens=1,
                                                                        prompt_logprobs=20), request_id="long")
    engine.add_request(stream)
    engine.step()  # the stream's prefill: it decodes from now on
    engine.add_request(long)
    steps = _record_chunks(llm)
    positions, interleaved, chunk_steps = 0, 0, 0
    for _ in range(200):
        outputs = engine.step()
        scheduled = dict(steps[-1])
        if "long#0" in scheduled:
            chunk_steps += 1
            interleaved += any(o.request_id == "stream" and o.new_token_ids for o in outputs)
        positions += sum(len(o.prompt_logprobs or ()) for o in outputs if o.request_id == "long")
        if positions == PROMPT_LEN - 1:
            break
    assert positions == PROMPT_LEN - 1
    assert chunk_steps >= -(-(PROMPT_LEN - 1) // ROWS) and interleaved == chunk_steps
    engine.abort_request("stream")
    while engine.has_work():
        engine.step()
    assert llm.stats()["kv_blocks_used"] == 0


def test_sliced_prompt_logprobs_equal_one_pass(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(23, 97) * 4
    targets = torch.randint(0, 97, (23,)).tolist()
    whole = sampler.prompt_logprobs(logits, targets, 6)
    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_SLICE_BYTES", 4 * 4 * 97)  # slices of 4 rows: 6 of them
    sliced = sampler.prompt_logprobs(logits, targets, 6)
    assert [list(e) for e in sliced] == [list(e) for e in whole]
    assert [list(e.values()) for e in sliced] == [pytest.approx(list(e.values()), abs=1e-6) for e in whole]
    assert sampler.prompt_logprobs(logits[:0], [], 6) == []
