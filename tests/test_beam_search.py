"""Beam search (equal to transformers' generate(num_beams=k)) and best_of sampling."""

import asyncio
import random

import pytest
import torch

from asyncllm import AsyncLLM, BeamSearchParams, InvalidRequestError, LLM, SamplingParams
from asyncllm.server import create_app
from checkpoints import load_reference_model
from server_helpers import assert_error, request

NEW_TOKENS = 12
_models: dict = {}


def reference_model(path):
    if path not in _models:
        _models[path] = load_reference_model(path)
    return _models[path]


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(3, 20))] for _ in range(count)]


@torch.no_grad()
def hf_beams(model, prompt, k, max_new_tokens=NEW_TOKENS, **kwargs):
    """transformers' k hypotheses (generated tokens only; padding after an end token removed)."""
    out = model.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, max_new_tokens=max_new_tokens,
                         num_return_sequences=k, output_scores=True, return_dict_in_generate=True, **kwargs)
    return [seq[len(prompt):].tolist() for seq in out.sequences], out.sequences_scores.tolist()


def same_beams(ours, theirs, pad) -> bool:
    return all(mine == ref[:len(mine)] and all(t == pad for t in ref[len(mine):])
               for mine, ref in zip(ours, theirs))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_beams_equal_transformers(kind, k, block_size, model_dirs):
    """Every returned hypothesis (not only the top beam) and its score equal transformers'; block
    size 4 puts the forks on partial blocks (copy-on-write) and re-forks beams every step."""
    model = reference_model(model_dirs[kind])
    llm = LLM(str(model_dirs[kind]), dtype="float32", block_size=block_size)
    batch = prompts(k, 3)
    outputs = llm.generate(batch, SamplingParams(n=k, best_of=k, use_beam_search=True, temperature=0,
                                                 max_tokens=NEW_TOKENS))
    for prompt, out in zip(batch, outputs):
        expected, scores = hf_beams(model, prompt, k)
        got = [c.token_ids for c in out.outputs]
        assert same_beams(got, expected, model.generation_config.pad_token_id), (got, expected)
        assert [c.cumulative_logprob / len(c.token_ids) for c in out.outputs] == pytest.approx(scores, abs=1e-4)
        assert [c.index for c in out.outputs] == list(range(k))
        assert all(c.finish_reason == ("length" if len(c.token_ids) == NEW_TOKENS else "stop")
                   for c in out.outputs)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0


def _frequent_token(llm, prompt) -> int:
    """A token the model picks early on greedily: used as the end token so that beams end."""
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return out.outputs[0].token_ids[2]


@pytest.mark.parametrize("options", [
    {},
    {"length_penalty": 0.5},
    {"length_penalty": 2.0, "early_stopping": "never"},
    {"early_stopping": True},
    {"length_penalty": -1.0},
], ids=["default", "lp0.5", "lp2-never", "early", "lp-1"])
def test_end_tokens_length_penalty_and_early_stopping_follow_transformers(options, model_dirs):
    model = reference_model(model_dirs["llama"])
    llm = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    num_ended = 0
    for prompt in prompts(7, 4):
        end = _frequent_token(llm, prompt)
        expected, scores = hf_beams(model, prompt, 3, max_new_tokens=10, eos_token_id=end, pad_token_id=end,
                                    **options)
        (out,) = llm.generate([prompt], SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0,
                                                       max_tokens=10, ignore_eos=True, stop_token_ids=[end],
                                                       **options))
        got = [c.token_ids for c in out.outputs]
        assert same_beams(got, expected, end), (got, expected)
        ended = [c for c in out.outputs if c.token_ids[-1] == end]
        assert all(c.finish_reason == "stop" and c.stop_reason == end for c in ended)
        num_ended += len(ended)
    assert num_ended > 0  # the end token did end hypotheses
    assert llm.stats()["kv_blocks_used"] == 0


def test_n_below_beam_width_returns_the_best_beams(model_dirs):
    model = reference_model(model_dirs["llama"])
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    prompt = prompts(11, 1)[0]
    (out,) = llm.generate([prompt], SamplingParams(n=2, best_of=4, use_beam_search=True, temperature=0,
                                                   max_tokens=NEW_TOKENS))
    expected, _ = hf_beams(model, prompt, 4)
    assert [c.token_ids for c in out.outputs] == expected[:2]


def test_beam_search_survives_preemption(model_dirs):
    """With a KV cache too small for every beam, preempted beams are recomputed and their group
    waits for them: the hypotheses stay transformers'."""
    model = reference_model(model_dirs["llama"])
    roomy = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    tight = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, max_model_len=64,
                kv_cache_memory=26 * roomy.engine.runner.bytes_per_block)
    batch = prompts(5, 4)
    params = SamplingParams(n=4, best_of=4, use_beam_search=True, temperature=0, max_tokens=NEW_TOKENS)
    outputs = tight.generate(batch, params)
    for prompt, out in zip(batch, outputs):
        assert [c.token_ids for c in out.outputs] == hf_beams(model, prompt, 4)[0]
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_used"] == 0


def test_llm_beam_search_api(model_dirs):
    model = reference_model(model_dirs["llama"])
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    batch = prompts(3, 2)
    results = llm.beam_search(batch, BeamSearchParams(beam_width=2, max_tokens=NEW_TOKENS))
    for prompt, result in zip(batch, results):
        expected, _ = hf_beams(model, prompt, 2)
        assert [s.tokens for s in result.sequences] == [prompt + e for e in expected]
        for seq in result.sequences:
            assert len(seq.logprobs) == NEW_TOKENS and seq.cum_logprob == pytest.approx(sum(seq.logprobs))
            # (the incremental detokenizer never shows a trailing incomplete character)
            assert seq.text == llm.tokenizer.decode(seq.tokens[len(prompt):], skip_special_tokens=True).rstrip("\ufffd")
        assert result.sequences[0].cum_logprob >= result.sequences[1].cum_logprob
    with pytest.raises(InvalidRequestError, match="temperature"):
        llm.beam_search(batch, BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5))


def test_best_of_returns_the_highest_scoring_samples(model_dirs):
    """best_of=4, n=2 runs the same four seeded samples as n=4 and returns the two with the highest
    cumulative log-probability, best first, numbered 0 and 1."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    prompt = prompts(2, 1)[0]
    common = dict(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    (all_four,) = llm.generate([prompt], SamplingParams(n=4, **common))
    (best,) = llm.generate([prompt], SamplingParams(n=2, best_of=4, **common))
    ranked = sorted(all_four.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert len({tuple(c.token_ids) for c in all_four.outputs}) > 1  # the samples differ
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert llm.stats()["kv_blocks_used"] == 0


def test_validation_names_the_field(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    cases = [({"n": 3, "best_of": 2}, "best_of"), ({"best_of": 4, "temperature": 0}, "best_of"),
             ({"use_beam_search": True, "best_of": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
             ({"use_beam_search": True, "best_of": 2, "choice": ["a", "b"]}, "choice"),
             ({"use_beam_search": "yes"}, "use_beam_search"), ({"length_penalty": "x"}, "length_penalty"),
             ({"early_stopping": "sometimes"}, "early_stopping"), ({"best_of": 10_000}, "best_of"),
             ({"use_beam_search": True, "best_of": 2, "stop": ["x" * 257]}, "stop"),
             ({"use_beam_search": True, "best_of": 2, "bad_words": ["x"]}, "bad_words")]
    for kwargs, name in cases:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(["hello"], SamplingParams(**kwargs))
        assert info.value.field == name, kwargs


def test_streamed_beam_request_yields_once_and_other_streams_flow(model_dirs):
    """A beam request streams its final text once (beams change until the search ends), while a
    plain stream beside it yields token by token."""
    async def main():
        async with AsyncLLM(str(model_dirs["llama"]), dtype="float32", block_size=4) as llm:
            async def beams():
                return [d async for d in llm.stream_outputs("The cat", n=2, best_of=3, use_beam_search=True,
                                                             temperature=0, max_tokens=16, ignore_eos=True)]

            async def plain():
                return [piece async for piece in llm.stream("The dog", temperature=0, max_tokens=16,
                                                            ignore_eos=True)]

            beam_deltas, pieces = await asyncio.gather(beams(), plain())
            final = await llm.generate("The cat", n=2, best_of=3, use_beam_search=True, temperature=0,
                                       max_tokens=16, ignore_eos=True)
            stats = llm.stats()
        return beam_deltas, pieces, final, stats

    beam_deltas, pieces, final, stats = asyncio.run(main())
    assert len(beam_deltas) == 1 and beam_deltas[0].finished
    assert [c.token_ids for c in beam_deltas[0].outputs] == [c.token_ids for c in final.outputs]
    assert len(pieces) > 1
    assert stats["kv_blocks_used"] == 0


def test_abort_frees_every_beam(model_dirs):
    async def main():
        async with AsyncLLM(str(model_dirs["llama"]), dtype="float32", block_size=4) as llm:
            task = asyncio.create_task(llm.generate("Once upon a time", request_id="beams", n=1, best_of=4,
                                                    use_beam_search=True, temperature=0, max_tokens=200,
                                                    ignore_eos=True))
            while llm.stats()["num_running"] < 4:
                await asyncio.sleep(0.005)
            await llm.abort("beams")
            out = await task
            await asyncio.sleep(0.05)
            return out, llm.stats()

    out, stats = asyncio.run(main())
    assert out.outputs[0].finish_reason == "abort"
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


def test_server_beam_search_and_best_of(model_dirs):
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    try:
        app = create_app(llm)
        body = {"prompt": "The cat", "max_tokens": 8, "n": 2, "best_of": 3, "use_beam_search": True,
                "temperature": 0, "ignore_eos": True}
        response = request(app, "POST", "/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        direct = asyncio.run(llm.generate("The cat", n=2, best_of=3, use_beam_search=True, temperature=0,
                                          max_tokens=8, ignore_eos=True))
        assert [c["text"] for c in choices] == [c.text for c in direct.outputs]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 1, "best_of": 3,
                "temperature": 0.8, "seed": 3}
        response = request(app, "POST", "/v1/chat/completions", json=chat)
        assert response.status_code == 200 and len(response.json()["choices"]) == 1
        bad = request(app, "POST", "/v1/completions", json={**body, "best_of": 1})
        assert_error(bad, 400, "best_of")
        bad = request(app, "POST", "/v1/completions", json={**body, "frequency_penalty": 0.5})
        assert_error(bad, 400, "frequency_penalty")
    finally:
        llm.close()


def test_stop_strings_end_hypotheses_as_transformers_does(model_dirs):
    """A candidate whose text completes a stop string ends like an end token does (transformers'
    StopStringCriteria); the returned text is cut before the stop string."""
    from transformers import AutoTokenizer

    model = reference_model(model_dirs["llama"])
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    llm = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    beams = dict(n=3, best_of=3, use_beam_search=True, temperature=0, max_tokens=12)
    stopped = 0
    for prompt in prompts(13, 4):
        (free,) = llm.generate([prompt], SamplingParams(**beams))
        text = free.outputs[0].text
        stop = text[len(text) // 2:len(text) // 2 + 2]  # occurs in the best beam's text
        expected, _ = hf_beams(model, prompt, 3, stop_strings=[stop], tokenizer=tokenizer)
        (out,) = llm.generate([prompt], SamplingParams(stop=[stop], **beams))
        got = [c.token_ids for c in out.outputs]
        assert same_beams(got, expected, model.generation_config.pad_token_id), (stop, got, expected)
        for c in out.outputs:
            if c.finish_reason == "stop":
                stopped += 1
                assert c.stop_reason == stop and stop not in c.text
    assert stopped > 0
