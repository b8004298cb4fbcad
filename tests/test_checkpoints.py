"""Sanity checks for the tiny test checkpoints in tests/checkpoints.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from checkpoints import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    KINDS,
    MODEL_VOCAB_SIZE,
    NON_ASCII_SAMPLES,
    PAD_TOKEN_ID,
    TOKENIZER_VOCAB_SIZE,
    load_reference_model,
    reference_greedy,
    reference_logprobs,
)

PROMPTS = [
    "Hello, my name is",
    "The quick brown fox",
    "日本語 café",
    "def f(x):",
    "Once upon a time the robot",
]
MAX_NEW = 24
NFC_TEXTS = [
    " ".join(NON_ASCII_SAMPLES),
    "I'm 12345 years old!! Don't\n\n  x = 3.14\t\ty",
    "HELLO'S World's 2024-01-01 ...",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return ids + [[BOS_TOKEN_ID] + ids[0], [IM_START_TOKEN_ID]]


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [
        IM_START_TOKEN_ID,
        IM_END_TOKEN_ID,
    ]
    assert len(tokenizer) == TOKENIZER_VOCAB_SIZE <= MODEL_VOCAB_SIZE


def test_tokenizer_adds_no_bos(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert BOS_TOKEN_ID not in ids and EOS_TOKEN_ID not in ids
    assert tokenizer("Hello world")["input_ids"] == ids


@pytest.mark.parametrize(
    "text",
    NON_ASCII_SAMPLES
    + [
        " ".join(NON_ASCII_SAMPLES),
        "  leading spaces, trailing space ",
        "tabs\tand\nnewlines\n\n  x = [1, 2, 3] ; \"quoted\" .",
        "<|im_start|>user\nhi café<|im_end|>\n",
    ],
)
def test_tokenizer_roundtrip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_has_multibyte_and_partial_utf8_tokens(tokenizer):
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    # merged tokens holding whole non-ASCII characters ...
    assert any(any(ord(c) > 127 for c in p) and "\ufffd" not in p for p in pieces)
    # ... and tokens that are incomplete UTF-8 sequences on their own
    assert any("\ufffd" in p for p in pieces)
    ids = tokenizer.encode("emoji 🙂")
    assert tokenizer.decode(ids) == "emoji 🙂"


def test_tokenizer_roundtrips_non_nfc_text(tokenizer):
    # No normalizer: decomposed characters survive (note: transformers 5
    # AutoTokenizer on a *qwen2* model dir forces NFC, see checkpoints.py).
    text = "cafe\u0301 e\u0301 \ufb01"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_qwen2_dir_tokenizer_quirk(qwen2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(qwen2_dir, local_files_only=True)
    if type(tok).__name__ == "Qwen2Tokenizer":
        # transformers >= 5 replaces the tokenizer.json pre-tokenizer /
        # normalizer for model_type qwen2 (NFC) -- must not add tokens though.
        assert len(tok) == TOKENIZER_VOCAB_SIZE
        assert tok.decode(tok.encode("cafe\u0301")) == "caf\u00e9"


def test_chat_template(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_loads_offline(model_dirs, kind):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = model_dirs[kind]
    assert (d / "config.json").is_file() and (d / "model.safetensors").is_file()
    assert (d / "tokenizer.json").is_file()
    cfg = AutoConfig.from_pretrained(d, local_files_only=True)
    assert cfg.model_type == kind
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    assert cfg.vocab_size == MODEL_VOCAB_SIZE
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
        PAD_TOKEN_ID,
    )
    assert tok.unk_token is None
    # Same tokenization as the raw tokenizer.json for (NFC) text, whatever
    # tokenizer class transformers picks for this model type.
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    for text in NFC_TEXTS:
        assert tok.encode(text) == raw.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    assert json.loads((d / "config.json").read_text())["dtype"] == "float32"


def test_llama_rope_llama3(llama_dir):
    from transformers import AutoConfig

    rope = AutoConfig.from_pretrained(llama_dir, local_files_only=True).rope_parameters
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 256
    assert "rope_theta" in rope


def test_qwen3_head_dim(qwen3_dir):
    with safe_open(qwen3_dir / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        assert "model.layers.0.self_attn.q_norm.weight" in f.keys()
    assert tuple(q.shape) == (4 * 32, 64) and tuple(k.shape) == (2 * 32, 64)


@pytest.mark.parametrize("kind,tied", [("llama", False), ("qwen2", True), ("qwen3", True), ("mistral", False)])
def test_tied_embeddings_on_disk(model_dirs, kind, tied):
    with safe_open(model_dirs[kind] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    assert ("lm_head.weight" in keys) == (not tied)


def test_sharded_checkpoint(model_dir_factory, llama_dir):
    d = model_dir_factory("llama", sharded=True)
    assert model_dir_factory("llama", sharded=True) == d  # cached
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((d / s).is_file() for s in shards)
    assert not (d / "model.safetensors").exists()
    ids = [[5, 17, 300, 42]]
    a = reference_logprobs(d, ids[0])
    b = reference_logprobs(llama_dir, ids[0])
    assert torch.equal(a, b)  # same seed -> same weights


def test_overrides(model_dir_factory):
    d = model_dir_factory("mistral", num_hidden_layers=3, vocab_size=1100)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["vocab_size"] == 1100


# ---------------------------------------------------------------- references


@pytest.mark.parametrize("kind", KINDS)
def test_reference_greedy(model_dirs, prompt_ids, kind):
    d = model_dirs[kind]
    model = load_reference_model(d)
    outs = reference_greedy(d, prompt_ids, MAX_NEW, model=model)
    assert len(outs) == len(prompt_ids)
    for out in outs:
        assert len(out) == MAX_NEW
        assert all(0 <= t < MODEL_VOCAB_SIZE for t in out)
        # not a degenerate "same token forever" model: parity tests need signal
        assert len(set(out)) >= 3, out
    # different prompts give different continuations
    assert len({tuple(o) for o in outs}) == len(outs)
    # no-cache full recompute (and the sdpa kernel) agree in float32
    sdpa = load_reference_model(d, attn_implementation="sdpa")
    assert reference_greedy(d, prompt_ids[:2], 8, model=sdpa, use_cache=False) == [
        o[:8] for o in outs[:2]
    ]
    # logprobs: shape, normalisation, and argmax consistent with greedy
    prompt = prompt_ids[0]
    lp = reference_logprobs(d, prompt + outs[0], model=model)
    assert lp.dtype == torch.float32 and lp.shape == (len(prompt) + MAX_NEW, MODEL_VOCAB_SIZE)
    torch.testing.assert_close(lp.logsumexp(-1), torch.zeros(lp.shape[0]), atol=1e-5, rtol=0)
    assert lp[len(prompt) - 1 : -1].argmax(-1).tolist() == outs[0]
    # peaked, trained-model-like next-token distributions
    assert lp.exp().max(-1).values.mean() > 0.3


def test_reference_greedy_ignores_eos(llama_dir):
    # Prompt with EOS itself and an arbitrary other prompt: always exactly N tokens.
    outs = reference_greedy(llama_dir, [[EOS_TOKEN_ID], [7, 8, 9]], 5)
    assert [len(o) for o in outs] == [5, 5]
