"""Stop strings, stop tokens, EOS, min_tokens, max_tokens through the whole engine."""

import pytest

from asyncllm import LLM, SamplingParams
from checkpoints import EOS_TOKEN_ID

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(str(model_dirs["llama"]), dtype="float32")


@pytest.fixture(scope="module")
def free_run(llm):
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    return out.outputs[0]


def _stop_string(llm, free_run) -> str:
    """A stop string that spans several tokens of the greedy output (tokens 5..7)."""
    prefix = llm.tokenizer.decode(free_run.token_ids[:5])
    span = llm.tokenizer.decode(free_run.token_ids[:8])[len(prefix):]
    assert len(span) >= 2
    return span


def test_stop_string_spanning_tokens(llm, free_run):
    stop = _stop_string(llm, free_run)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["\x00never", stop])
    (out,) = llm.generate([PROMPT], params)
    c = out.outputs[0]
    first = free_run.text.find(stop)
    assert c.text == free_run.text[:first]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert free_run.token_ids[:len(c.token_ids)] == c.token_ids and len(c.token_ids) < 40
    (kept,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                                    include_stop_str_in_output=True))
    assert kept.outputs[0].text == free_run.text[:first + len(stop)]
    assert llm.stats()["kv_blocks_used"] == 0


def test_stop_token_ids_and_max_tokens(llm, free_run):
    token = free_run.token_ids[6]
    first = free_run.token_ids.index(token)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[token]))
    assert out.outputs[0].token_ids == free_run.token_ids[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == token
    (short,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3))
    assert short.outputs[0].finish_reason in ("length", "stop") and len(short.outputs[0].token_ids) <= 3


def test_eos_and_min_tokens(llm):
    eos_forced = {EOS_TOKEN_ID: 100.0}
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, logit_bias=eos_forced))
    assert out.outputs[0].token_ids == [EOS_TOKEN_ID] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None and out.outputs[0].text == ""  # special token skipped
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, logit_bias=eos_forced, min_tokens=5))
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].token_ids[-1] == EOS_TOKEN_ID
    assert EOS_TOKEN_ID not in out.outputs[0].token_ids[:5]
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=7, logit_bias=eos_forced, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_incremental_detokenizer_never_breaks_multibyte_characters(llm):
    from asyncllm.frontend.detokenizer import IncrementalDetokenizer

    text = "café naïve 日本語 🙂 𝄞∮Ж done"  # the last three are not in the tokenizer's corpus
    ids = llm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(llm.tokenizer, [5, 6], skip_special_tokens=True)
    pieces = [detok.step(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some character really was split across tokens


def test_engine_text_equals_full_decode(llm, free_run):
    assert free_run.text == llm.tokenizer.decode(free_run.token_ids, skip_special_tokens=True)


def test_output_text_never_starts_with_the_prompts_broken_bytes(llm):
    """A prompt ending inside a multi-byte character: the output's text is its own tokens' text."""
    from asyncllm.frontend.detokenizer import IncrementalDetokenizer

    emoji = llm.tokenizer.encode("𝄞")  # not in the training corpus: several byte tokens
    assert len(emoji) > 1
    prompt, output = emoji[:1], emoji[1:] + llm.tokenizer.encode(" ok")
    detok = IncrementalDetokenizer(llm.tokenizer, [5, 6] + prompt, skip_special_tokens=True)
    text = "".join(detok.step(t) for t in output)
    assert text == llm.tokenizer.decode(output)
