"""Bad input raises InvalidRequestError naming the field, and the engine keeps working."""

import json
import shutil

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ConfigError, InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=64)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logprobs": 50}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"logit_bias": {5000: 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 500}}, "logit_bias"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"seed": "abc"}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"regex": "[a-z"}, "regex"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_sampling_values_name_the_field(llm, kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[5, 6, 7]], SamplingParams.from_kwargs(None, kwargs))
    assert info.value.field == field and field in str(info.value)


def test_unknown_keyword_is_rejected():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_kwargs(None, {"temprature": 0.5})
    assert info.value.field == "temprature"


@pytest.mark.parametrize("prompt", ["", [], [5, -1], [5, 10**6], [1.5], None])
def test_bad_prompts(llm, prompt):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([prompt])
    assert info.value.field == "prompt"


@pytest.mark.parametrize("prompt, field", [({"prompt_token_ids": []}, "prompt_token_ids"),
                                           ({"prompt_token_ids": [5, -1]}, "prompt_token_ids"),
                                           ({"prompt_token_ids": "5"}, "prompt_token_ids"),
                                           ({"prompt_token_ids": [5], "extra": 1}, "prompt")])
def test_bad_token_prompts(llm, prompt, field):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([prompt])
    assert info.value.field == field


def test_tokens_prompt_equals_a_token_list(llm):
    """vLLM's ``{"prompt_token_ids": [...]}`` prompt runs the same tokens as the bare list."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    ids = llm.tokenizer.encode("Hello there")
    (as_dict,), (as_list,) = llm.generate([{"prompt_token_ids": ids}], greedy), llm.generate([ids], greedy)
    assert as_dict.prompt is None and as_dict.prompt_token_ids == ids
    assert as_dict.outputs[0].token_ids == as_list.outputs[0].token_ids


def test_chat_messages_render_with_the_template(llm):
    (out,) = llm.generate([[{"role": "user", "content": "Hello there"}]], SamplingParams(max_tokens=3, temperature=0))
    assert "<|im_start|>assistant" in out.prompt and out.prompt.endswith("\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[{"content": "no role"}]])
    assert info.value.field == "messages"


def test_bad_prompt_collections(llm):
    for prompts in (42, [], None):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(prompts)
        assert info.value.field == "prompts"


def test_prompt_longer_than_max_model_len_then_engine_still_works(llm):
    with pytest.raises(InvalidRequestError, match="max_model_len") as info:
        llm.generate([[7] * 64])
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as info:  # more than the context leaves: refused, naming both
        llm.generate([[7] * 60], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert info.value.field == "max_tokens" and "50" in str(info.value) and "leaves room for 4" in str(info.value)
    (out,) = llm.generate([[7] * 60], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"  # omitted: the rest
    assert llm.stats()["kv_blocks_used"] == 0


def test_one_bad_request_in_a_batch_submits_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], [5, 6]], [SamplingParams(max_tokens=2), SamplingParams(top_p=-1)])
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["kv_blocks_used"] == 0


def test_params_list_length_must_match(llm):
    with pytest.raises(InvalidRequestError, match="params"):
        llm.generate([[5], [6]], [SamplingParams()])


def test_unknown_architecture_names_supported_ones(tmp_path, model_dirs):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(model_dirs["llama"], bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM"):  # forced native: the error lists the families
        LLM(str(bad), model_impl="native")
    config.update(architectures=["MadeUpForCausalLM"], model_type="made_up")
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="made_up"):  # neither native nor known to transformers
        LLM(str(bad))


def test_missing_checkpoint_and_bad_engine_arguments(tmp_path, model_dirs):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM(str(model_dirs["llama"]), block_sise=4)
    with pytest.raises(ConfigError, match="dtype"):
        LLM(str(model_dirs["llama"]), dtype="float8")
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        LLM(str(model_dirs["llama"]), kv_cache_memory=1000)
