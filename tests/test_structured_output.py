"""Structured output on a random-weight model: json_schema / regex / choice / grammar outputs always
conform, across seeds, with n > 1, preemption and prefix caching; unconstrained neighbours are
unchanged; bad grammars are InvalidRequestErrors that leave the engine working."""

import json
import re

import jsonschema
import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.errors import InvalidRequestError
from asyncllm.model import sampler as sampler_module
from asyncllm.structured import GrammarCompiler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"floor": {"type": "integer", "minimum": -2, "maximum": 99}},
                 "required": ["floor"]},
        "nickname": {"type": "string", "maxLength": 6},  # optional
    },
    "required": ["name", "age", "active", "role", "tags", "home"],
}
PROMPT = "Describe the user as JSON:"


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=512)


def _check_json(output, schema=PERSON):
    for c in output.outputs:
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), schema)
        assert "  " not in c.text and "\n" not in c.text  # no free whitespace


def test_json_schema_output_validates_across_seeds(llm):
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=200, json_schema=PERSON) for seed in range(12)]
    params.append(SamplingParams(temperature=0, max_tokens=200, json_schema=json.dumps(PERSON)))  # str schema
    outputs = llm.generate([PROMPT] * len(params), params)
    for output in outputs:
        _check_json(output)
    assert len({o.outputs[0].text for o in outputs}) > 6  # really sampled, not one forced answer
    again = llm.generate([PROMPT], params[3])[0]  # a seed gives the same constrained output
    assert again.outputs[0].token_ids == outputs[3].outputs[0].token_ids


def test_n_children_have_their_own_matchers(llm):
    (output,) = llm.generate([PROMPT], SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=200,
                                                      json_schema=PERSON))
    _check_json(output)
    assert len({c.text for c in output.outputs}) > 1


def test_regex_choice_and_grammars(llm):
    cases = [
        (SamplingParams(temperature=1.0, seed=1, max_tokens=40, regex=r"([0-9]{3})-([0-9]{4}) [a-z]{2,5}"),
         lambda t: re.fullmatch(r"([0-9]{3})-([0-9]{4}) [a-z]{2,5}", t)),
        (SamplingParams(temperature=1.0, seed=2, max_tokens=20, choice=["yes", "no", "maybe later"]),
         lambda t: t in ("yes", "no", "maybe later")),
        (SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                        grammar='start: "(" num ("+" num){0,3} ")"\nnum: /[1-9][0-9]?/'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", t)),
        (SamplingParams(temperature=1.0, seed=4, max_tokens=20, grammar='root ::= "on" | "off"'),  # GBNF
         lambda t: t in ("on", "off")),
    ]
    outputs = llm.generate([PROMPT] * len(cases), [params for params, _ in cases])
    for output, (_, check) in zip(outputs, cases):
        c = output.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_mixed_batch_leaves_unconstrained_rows_unchanged(llm):
    prompts = ["The cat", "A dog runs", "my friend reads", "the teacher"]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    constrained = [SamplingParams(temperature=t, seed=i, max_tokens=200, json_schema=PERSON)
                   for i, t in enumerate([0, 1.0, 0.7])]
    mixed = llm.generate([PROMPT, prompts[0], PROMPT, prompts[1], prompts[2], PROMPT, prompts[3]],
                         [constrained[0], greedy, constrained[1], greedy, greedy, constrained[2], greedy])
    assert [mixed[i].outputs[0].token_ids for i in (1, 3, 4, 6)] == alone
    for i in (0, 2, 5):
        _check_json(mixed[i])


def test_unconstrained_batches_never_touch_the_grammar_engine(llm, monkeypatch):
    def boom(*args):
        raise AssertionError("grammar masks computed for an unconstrained batch")

    monkeypatch.setattr(sampler_module, "apply_grammar_masks", boom)
    llm.generate(["Hello", "The cat"], SamplingParams(temperature=0.8, max_tokens=8))


def test_preemption_and_prefix_caching_keep_outputs_valid_and_identical(model_dirs, llm):
    params = [SamplingParams(temperature=0.9, seed=seed, max_tokens=120, json_schema=PERSON) for seed in range(6)]
    expected = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 6, params)]
    bytes_per_token = llm.engine.runner.bytes_per_block // llm.config.block_size
    tight = LLM(str(model_dirs["llama"]), dtype="float32", block_size=4, max_model_len=160,
                kv_cache_memory=48 * 4 * bytes_per_token)  # 48 blocks: 6 requests need ~90
    outputs = tight.generate([PROMPT] * 6, params)
    assert tight.stats()["num_preemptions"] > 0  # recomputed sequences did not replay their matchers
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output in outputs:
        _check_json(output)
    again = tight.generate([PROMPT] * 2, params[:2])  # prompt blocks now come from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == expected[:2]
    assert tight.stats()["prefix_cache_hits"] > 0


def test_padded_model_vocab_is_masked(model_dir_factory):
    padded = LLM(str(model_dir_factory("qwen2", vocab_size=1100)), dtype="float32", max_model_len=512)
    assert padded.engine.vocab_size == 1100 > len(padded.tokenizer)
    params = [SamplingParams(temperature=1.5, seed=seed, max_tokens=200, json_schema=PERSON) for seed in range(4)]
    for output in padded.generate([PROMPT] * 4, params):
        _check_json(output)
        assert max(output.outputs[0].token_ids) < len(padded.tokenizer)


@pytest.mark.parametrize("kwargs, field", [
    ({"json_schema": {"type": "objectx"}}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": 5}, "json_schema"),
    ({"regex": "(unclosed"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "grammar"),
    ({"grammar": "root ::= (broken"}, "grammar"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"regex": "a", "choice": ["a"]}, "choice"),
])
def test_bad_structured_requests_name_the_field(llm, kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, **kwargs))
    assert info.value.field == field and field in str(info.value)
    assert llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids


def test_compiler_caches_and_allows_eos_only_when_complete(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, eos_token_ids=[1])
    first = compiler.compile_params(SamplingParams(regex=r"ab?"))
    assert compiler.compile_params(SamplingParams(regex=r"ab?")) is first and compiler.hits == 1
    state = first.new_state()
    logits = torch.zeros(2, llm.engine.vocab_size)
    sampler_module.apply_grammar_masks(logits, [1], [state])
    assert bool((logits[0] == 0).all())  # the unconstrained row is untouched
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert 1 not in allowed and all(llm.tokenizer.decode([t]) in ("a", "ab") for t in allowed)
    assert state.accept(llm.tokenizer.convert_tokens_to_ids("a")) and not state.is_finished
    logits = torch.zeros(1, llm.engine.vocab_size)
    sampler_module.apply_grammar_masks(logits, [0], [state])
    assert 1 in (logits[0] == 0).nonzero().flatten().tolist()  # "a" is complete: EOS now allowed
    child = state.fork()
    assert child.accept(llm.tokenizer.convert_tokens_to_ids("b")) and child.is_finished
    assert not state.is_finished  # the fork did not move its parent


def test_prefetched_masks_equal_masks_computed_at_sampling(llm):
    """The accelerator path: masks filled ahead (during the forward pass) are the same masks, and a
    child forked from a prefetched leader reuses the leader's row."""
    from asyncllm.structured import prefetch_masks

    template = llm.inputs.grammars.compile_params(SamplingParams(json_schema=PERSON))
    states = [template.new_state() for _ in range(3)]
    token = llm.tokenizer.encode('{"', add_special_tokens=False)[0]
    assert states[1].accept(token)
    expected = torch.zeros(3, llm.engine.vocab_size)
    sampler_module.apply_grammar_masks(expected, [0, 1, 2], states)
    prefetch_masks(states[:2], llm.engine.vocab_size)
    child = states[1].fork()
    got = torch.zeros(4, llm.engine.vocab_size)
    sampler_module.apply_grammar_masks(got, [0, 1, 2, 3], states + [child])
    assert torch.equal(got[:3], expected) and torch.equal(got[3], expected[1])
    assert all(s.prefetched is None for s in states + [child])
