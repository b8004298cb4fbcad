"""Speculative decoding (prompt lookup): greedy output unchanged, sampled output's distribution
unchanged, counters, back-off, configuration."""

import json
import random
from types import SimpleNamespace

import pytest
import torch

from asyncllm import LLM, AsyncLLM, SamplingParams
from asyncllm.engine.speculation import (NgramProposer, Proposer, SpeculativeConfig, acceptance_rate,
                                         draft_length, grammar_states_along, plan_drafts, record_outcome)
from asyncllm.errors import ConfigError
from asyncllm.server import create_app
from server_helpers import build_test_adapter

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def copy_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random unit: the random models fall into loops that prompt lookup can
    predict, so drafts get accepted as well as rejected."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        unit = [rng.randrange(5, 1000) for _ in range(rng.randrange(2, 7))]
        prompts.append(unit * rng.randrange(2, 5) + [rng.randrange(5, 1000) for _ in range(rng.randrange(0, 4))])
    return prompts


def generate_both(model_dir, prompts, params, lora=None, script=False, **engine_kwargs):
    """Plain and speculative outputs; ``script``: the speculative engine proposes plain decoding's
    output (ScriptedProposer) instead of looking its prompt up."""
    plain = LLM(str(model_dir), dtype="float32", **engine_kwargs)
    spec = LLM(str(model_dir), dtype="float32", speculative_config=NGRAM, **engine_kwargs)
    if lora is not None:
        plain.add_lora("a", lora)
        spec.add_lora("a", lora)
        lora = "a"
    expected = plain.generate(prompts, params, lora=lora)
    if script:
        ids = [o.prompt_token_ids for o in expected]
        scripted(spec, ids, expected)
    return expected, spec.generate(prompts, params, lora=lora), spec


def assert_unchanged(expected, got, spec, some_accepted=True):
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    assert [[c.finish_reason for c in o.outputs] for o in got] == \
        [[c.finish_reason for c in o.outputs] for o in expected]
    stats = spec.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    assert stats["spec_accepted_tokens"] > 0 or not some_accepted
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("engine_kwargs", [{"block_size": 4}, {"block_size": 16, "enable_prefix_caching": False}],
                         ids=["bs4-prefix-cache", "bs16-no-cache"])
def test_greedy_output_unchanged(kind, engine_kwargs, model_dirs):
    prompts = copy_prompts(1, 6)
    plain = LLM(str(model_dirs[kind]), dtype="float32", **engine_kwargs)
    spec = LLM(str(model_dirs[kind]), dtype="float32", speculative_config=NGRAM, **engine_kwargs)
    first = plain.generate(prompts, GREEDY)
    assert_unchanged(first, spec.generate(prompts, GREEDY), spec)
    # continuations of the outputs: with prefix caching they reuse blocks that verified steps wrote
    longer = [p + o.outputs[0].token_ids[:40] for p, o in zip(prompts, first)]
    assert_unchanged(plain.generate(longer, GREEDY), spec.generate(longer, GREEDY), spec)
    if engine_kwargs.get("enable_prefix_caching", True):
        assert spec.stats()["prefix_cache_hits"] > 0


class ScriptedProposer(Proposer):
    """Proposes a known continuation of each prompt (e.g. plain decoding's greedy output), with
    every ``corrupt_every``-th proposal made wrong at its third token: drafts are then accepted
    often, partly, and rejected, which copies from random-weight models rarely are."""

    def __init__(self, continuations: dict[tuple, list[int]], k: int = 4, corrupt_every: int = 3) -> None:
        self.continuations = continuations
        self.k = k
        self.corrupt_every = corrupt_every
        self.calls = 0

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(continuation[done:done + min(self.k, limit)])
                self.calls += 1
                if self.corrupt_every and self.calls % self.corrupt_every == 0 and len(drafts) > 2:
                    drafts[2] = (drafts[2] + 1) % 1000
                return drafts
        return []


def scripted(llm, prompts, outputs, **kwargs) -> ScriptedProposer:
    proposer = ScriptedProposer({tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs)}, **kwargs)
    llm.engine.proposer = proposer
    return proposer


def test_greedy_unchanged_with_processors_logprobs_stops_and_n(model_dirs):
    """Penalties, min_tokens, logit_bias and stop tokens see the drafts before each verified row;
    logprobs of accepted drafts are those of plain decoding; n > 1 children verify their own drafts."""
    prompts = [[11, 57, 300, 812, 45], [20, 21, 22], [640, 7, 99, 13], [5, 6, 700]]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=20, frequency_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={7: 3.0}, n=2),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    plain = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    stop_at = plain.generate([prompts[3]], params[3])[0].outputs[0].token_ids[9]
    params[3] = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at])
    expected = plain.generate(prompts, params)
    spec = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, speculative_config=NGRAM)
    scripted(spec, prompts, expected)
    got = spec.generate(prompts, params)
    assert_unchanged(expected, got, spec)
    assert got[3].outputs[0].finish_reason == "stop" and len(got[3].outputs[0].token_ids) <= 10
    for mine, theirs in zip(got[0].outputs[0].logprobs, expected[0].outputs[0].logprobs):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-4)
    assert got[1].outputs[0].cumulative_logprob == pytest.approx(expected[1].outputs[0].cumulative_logprob,
                                                                 abs=1e-3)


def test_greedy_unchanged_with_lora(model_dirs, tmp_path):
    pytest.importorskip("peft")
    adapter = build_test_adapter(model_dirs["llama"], tmp_path / "adapter")
    expected, got, spec = generate_both(model_dirs["llama"], copy_prompts(3, 6), GREEDY, lora=str(adapter),
                                        script=True, block_size=4)
    assert_unchanged(expected, got, spec)


def test_greedy_unchanged_with_structured_output(model_dirs):
    """Drafts pass through the grammar first (only the allowed prefix is verified), and each
    verified row is masked by the grammar state after the drafts before it."""
    params = SamplingParams(temperature=0, max_tokens=60, regex=r"(ab|cd|[a-z ]{1,5}){1,30}")
    prompts = ["abab abab abab cdcd cd", "the cat the cat the cat", "xyz xyz xyz xyz"]
    expected, got, spec = generate_both(model_dirs["llama"], prompts, params, script=True, block_size=4)
    assert_unchanged(expected, got, spec)


def _chi_square_p(a: dict, b: dict) -> float:
    """p-value of a chi-square test that two samples of categories come from one distribution
    (categories with fewer than 10 draws in all are pooled)."""
    keys = set(a) | set(b)
    rare = [k for k in keys if a.get(k, 0) + b.get(k, 0) < 10]
    table = [[a.get(k, 0), b.get(k, 0)] for k in keys if k not in rare]
    table.append([sum(a.get(k, 0) for k in rare), sum(b.get(k, 0) for k in rare)])
    table = torch.tensor([row for row in table if sum(row)], dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_sampled_distribution_unchanged(model_dirs):
    """Rejection sampling keeps the output distribution: tokens 2-4 drawn at temperature 0.7 while
    drafts propose the greedy continuation (right often, wrong often) follow the same distribution
    with and without speculation (chi-square, 1,200 samples each, per position and jointly for 2-3)."""
    plain = LLM(str(model_dirs["llama"]), dtype="float32")
    spec = LLM(str(model_dirs["llama"]), dtype="float32", speculative_config=NGRAM)
    prompt = [11, 57, 300, 812, 45]
    greedy = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    scripted(spec, [prompt], greedy, corrupt_every=0)
    samples = []
    for engine in (plain, spec):
        params = [SamplingParams(n=100, temperature=0.7, max_tokens=4, ignore_eos=True, seed=seed)
                  for seed in range(12)]
        samples.append([c.token_ids for out in engine.generate([prompt] * 12, params) for c in out.outputs])
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] > 300 and stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] > 300

    def counts(tokens, key):
        table = {}
        for t in tokens:
            table[key(t)] = table.get(key(t), 0) + 1
        return table

    for key in (lambda t: t[1], lambda t: t[2], lambda t: t[3], lambda t: tuple(t[1:3])):
        assert _chi_square_p(counts(samples[0], key), counts(samples[1], key)) > 0.001


def test_chi_square_helper_detects_a_different_distribution():
    assert _chi_square_p({1: 500, 2: 500}, {1: 600, 2: 400}) < 0.001
    assert _chi_square_p({1: 500, 2: 500}, {1: 510, 2: 490}) > 0.1


def test_ngram_proposer_finds_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig.parse(NGRAM))
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3], limit=10) == [4, 5, 9, 2]
    assert proposer.propose([1, 2, 3, 4, 2, 3, 7, 2, 3], limit=10) == [7, 2, 3]  # the latest occurrence
    assert proposer.propose([1, 2, 3, 4, 2, 3], limit=2) == [4, 2]
    assert proposer.propose([1, 2, 3, 4], limit=10) == []
    # item alignment: the bytes of 1 (01 00 00 00) appear inside 256, 0 (00 01 00 00 00 ...), no token 1 does
    assert proposer.propose([256, 0, 7, 1], limit=4) == []


def test_draft_length_follows_acceptance():
    """Drafts cost a fraction of a step each: none pay at low acceptance, all k at high acceptance."""
    lengths = [draft_length(a / 10, 8) for a in range(11)]
    assert lengths[:2] == [0, 0] and lengths[-1] == 8 and draft_length(0.9, 4) == 4
    assert lengths == sorted(lengths)
    assert draft_length(0.5, 8, row_cost=0.0) == 8 and draft_length(0.5, 8, row_cost=1.0) == 0


def test_plan_drafts_backs_off_and_recovers():
    seq = SimpleNamespace(spec_hits=0.0, spec_misses=0.0, spec_cooldown=0, spec_wait=0)
    assert plan_drafts(seq, 4) >= 1  # no evidence yet: acceptance 0.5
    for _ in range(10):
        record_outcome(seq, 1, 0)
    assert acceptance_rate(seq) < 0.2
    plans = [plan_drafts(seq, 4) for _ in range(20)]
    probes = [i for i, p in enumerate(plans) if p]
    assert all(plans[i] == 1 for i in probes) and probes == [0, 2, 5, 10, 19]  # waits of 1, 2, 4, 8 steps
    for _ in range(6):
        record_outcome(seq, 4, 4)
    while seq.spec_wait:
        plan_drafts(seq, 4)
    assert acceptance_rate(seq) > 0.8 and plan_drafts(seq, 4) == 4 and seq.spec_cooldown == 0


def test_grammar_filters_drafts(model_dirs):
    llm = LLM(str(model_dirs["llama"]), dtype="float32")
    template = llm.inputs.grammars.compile_params(SamplingParams(regex="a+").validate())
    state = template.new_state()
    a = llm.tokenizer.encode("a")[0]
    b = llm.tokenizer.encode("b")[0]
    drafts, states = grammar_states_along(state, [a, a, b, a])
    assert drafts == [a, a] and len(states) == 2
    assert state.accept(b) is False  # the sequence's own state did not move


@pytest.mark.parametrize("bad", [
    {"method": "medusa"}, {"num_speculative_tokens": 0}, {"prompt_lookup_max": "3"}, {"colour": 1},
    {"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "{not json", [1, 2], {"method": "draft_model"},
    {"method": "ngram", "model": "x"},
])
def test_bad_speculative_config_is_a_config_error(bad, model_dirs):
    with pytest.raises(ConfigError, match="speculative_config"):
        LLM(str(model_dirs["llama"]), dtype="float32", speculative_config=bad)


def test_async_streams_and_metrics(model_dirs):
    """Streams receive several tokens per step when drafts are accepted; /metrics has the counters."""
    import asyncio

    async def main():
        prompt = copy_prompts(4, 1)[0]
        plain = LLM(str(model_dirs["llama"]), dtype="float32").generate([prompt], GREEDY)
        llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32", speculative_config=json.dumps(NGRAM))
        scripted(llm, [prompt], plain)
        try:
            deltas = [d async for d in llm.stream_outputs(prompt, temperature=0, max_tokens=48, ignore_eos=True)]
            app = create_app(llm)
            registry, name = app.state.asyncllm.metrics.registry, app.state.asyncllm.model_name
            scraped = {metric: registry.get_sample_value(f"asyncllm:{metric}", {"model_name": name})
                       for metric in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                                      "spec_decode_num_accepted_tokens_total", "spec_decode_mean_accepted_length")}
            return deltas, llm.stats(), scraped
        finally:
            llm.close()

    deltas, stats, scraped = asyncio.run(main())
    tokens = [len(d.outputs[0].token_ids) for d in deltas]
    assert sum(tokens) == 48 and stats["spec_accepted_tokens"] > 0
    assert max(tokens) > 1  # accepted drafts arrive together with their step's last token
    assert scraped["spec_decode_num_drafts_total"] == stats["spec_num_drafts"]
    assert scraped["spec_decode_num_accepted_tokens_total"] == stats["spec_accepted_tokens"]
    assert scraped["spec_decode_mean_accepted_length"] == pytest.approx(
        1 + stats["spec_accepted_tokens"] / stats["spec_num_drafts"])


# ---- draft model ------------------------------------------------------------------------------------

def draft_config(path, k=4):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def test_draft_model_equal_to_target_accepts_every_draft(model_dirs):
    """The target as its own draft: every greedy draft is accepted; output unchanged, including
    with prefix-cache hits on the second round and n = 2."""
    prompts = copy_prompts(6, 5)
    plain = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4)
    spec = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4,
               speculative_config=draft_config(model_dirs["llama"]))
    params = [GREEDY] * 4 + [SamplingParams(n=2, temperature=0, max_tokens=48, ignore_eos=True)]
    for round_prompts in (prompts, [p + [7, 8, 9] for p in prompts]):
        expected, got = plain.generate(round_prompts, params), spec.generate(round_prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in expected]
    stats = spec.stats()
    assert stats["spec_draft_tokens"] > 300 and stats["spec_accepted_tokens"] >= 0.95 * stats["spec_draft_tokens"]
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("engine_kwargs", [{"block_size": 4}, {"enable_prefix_caching": False}])
def test_other_draft_model_keeps_greedy_output(engine_kwargs, model_dir_factory, model_dirs):
    """A different (one-layer, other seed) draft: random models disagree, so its drafts are rejected
    (and back-off spaces its proposals out); the output stays the target's."""
    draft = model_dir_factory("llama", seed=5, num_hidden_layers=1)
    prompts = copy_prompts(7, 6)
    plain = LLM(str(model_dirs["llama"]), dtype="float32", **engine_kwargs)
    spec = LLM(str(model_dirs["llama"]), dtype="float32", speculative_config=draft_config(draft), **engine_kwargs)
    assert_unchanged(plain.generate(prompts, GREEDY), spec.generate(prompts, GREEDY), spec, some_accepted=False)


def test_draft_model_with_lora_structured_output_and_preemption(model_dirs, tmp_path):
    """The target's adapter verifies (the draft runs without it); the grammar filters the drafts;
    a KV cache too small for every sequence preempts and recomputes them."""
    pytest.importorskip("peft")
    adapter = build_test_adapter(model_dirs["llama"], tmp_path / "adapter")
    prompts = copy_prompts(8, 4)
    kwargs = dict(dtype="float32", block_size=4)
    plain = LLM(str(model_dirs["llama"]), **kwargs)
    plain.add_lora("a", str(adapter))
    spec = LLM(str(model_dirs["llama"]), speculative_config=draft_config(model_dirs["llama"]), **kwargs)
    spec.add_lora("a", str(adapter))
    assert_same = lambda a, b: [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]  # noqa
    assert assert_same(plain.generate(prompts, GREEDY, lora="a"), spec.generate(prompts, GREEDY, lora="a"))
    regex = SamplingParams(temperature=0, max_tokens=40, regex=r"(ab|cd|[a-z ]{1,5}){1,30}")
    texts = ["abab abab cd", "the cat the cat"]
    assert [o.outputs[0].text for o in plain.generate(texts, regex)] == \
        [o.outputs[0].text for o in spec.generate(texts, regex)]
    tight = LLM(str(model_dirs["llama"]), max_model_len=64, kv_cache_memory=20 * plain.engine.runner.bytes_per_block,
                speculative_config=draft_config(model_dirs["llama"]), **kwargs)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    many = copy_prompts(9, 8)
    assert assert_same(plain.generate(many, long), tight.generate(many, long))
    assert tight.stats()["num_preemptions"] > 0 and tight.stats()["kv_blocks_used"] == 0
    assert spec.stats()["spec_accepted_tokens"] > 0


def test_draft_model_sampled_distribution_unchanged(model_dirs):
    plain = LLM(str(model_dirs["llama"]), dtype="float32")
    spec = LLM(str(model_dirs["llama"]), dtype="float32", speculative_config=draft_config(model_dirs["llama"], k=3))
    prompt = [11, 57, 300, 812, 45]
    samples = []
    for engine in (plain, spec):
        params = [SamplingParams(n=100, temperature=0.7, max_tokens=4, ignore_eos=True, seed=seed)
                  for seed in range(12)]
        samples.append([tuple(c.token_ids) for out in engine.generate([prompt] * 12, params) for c in out.outputs])
    stats = spec.stats()
    assert stats["spec_accepted_tokens"] > 300 and stats["spec_draft_tokens"] - stats["spec_accepted_tokens"] > 300
    for position in (1, 2, 3):
        first, second = ({}, {})
        for table, tokens in ((first, samples[0]), (second, samples[1])):
            for t in tokens:
                table[t[position]] = table.get(t[position], 0) + 1
        assert _chi_square_p(first, second) > 0.001


def test_draft_model_must_share_the_vocabulary(model_dir_factory, model_dirs):
    other = model_dir_factory("llama", vocab_size=1200)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(model_dirs["llama"]), dtype="float32", speculative_config=draft_config(other))


def test_serve_speculative_config_flag(model_dirs):
    """``asyncllm serve --speculative-config JSON`` reaches the engine (its counters appear on
    /metrics); a bad value stops the command with a message naming the option."""
    import subprocess
    import sys

    import httpx

    from server_helpers import start_serve

    proc, base = start_serve(str(model_dirs["llama"]), "--dtype", "float32", "--speculative-config", json.dumps(NGRAM))
    try:
        body = {"prompt": copy_prompts(1, 6), "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200
        metrics = httpx.get(f"{base}/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("asyncllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    bad = subprocess.run([sys.executable, "-m", "asyncllm.cli", "serve", str(model_dirs["llama"]),
                          "--speculative-config", "{oops"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "speculative_config" in bad.stderr
