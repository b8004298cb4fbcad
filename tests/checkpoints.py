"""Tiny random-weight Hugging Face checkpoints for tests and benchmarks.

Everything here is built locally and deterministically: no hub access.

* :func:`build_tokenizer` trains a small byte-level BPE tokenizer on an
  embedded English corpus (plus some non-ASCII text).
* :func:`build_checkpoint` writes a tiny ``llama`` / ``qwen2`` / ``qwen3`` /
  ``mistral`` model directory (safetensors + config + tokenizer) that
  ``AutoModelForCausalLM`` / ``AutoTokenizer`` load offline.
* :func:`reference_greedy` and :func:`reference_logprobs` give the
  transformers reference outputs that engine parity tests compare against.

This module must stay free of pytest imports (benchmarks import it too).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
import shutil
from pathlib import Path
from typing import Any

import torch

# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order fixes the ids: the BPE trainer puts special tokens first (0..4).
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN]
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
PAD_TOKEN_ID = 2
IM_START_TOKEN_ID = 3
IM_END_TOKEN_ID = 4

# The tokenizer is trained to exactly this size, which equals the models'
# vocab_size, so every id a model can emit is a real token. (Pass
# ``vocab_size=...`` larger as an override to build_checkpoint to get a
# Qwen-style padded vocabulary.)
TOKENIZER_VOCAB_SIZE = 1024
MODEL_VOCAB_SIZE = 1024

# Qwen2's pre-tokenization regex (see _train_tokenizer_object).
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Non-ASCII snippets so that multi-byte UTF-8 characters appear both as raw
# byte tokens and (for the frequent ones) as merged / partial-UTF-8 tokens.
NON_ASCII_SAMPLES = [
    "café",
    "naïve",
    "日本語",
    "emoji 🙂",
    "crème brûlée",
    "Straße",
    "über",
    "señor",
    "français",
    "Ελληνικά",
    "русский",
    "中文",
    "こんにちは",
    "🙂🚀🎉😀",
    "→ ± ≈ °C €",
]

_SUBJECTS = [
    "the cat", "a dog", "my friend", "the old man", "a young girl", "the teacher",
    "our team", "the robot", "a small bird", "the engine", "this model", "the server",
    "every student", "the river", "a stranger", "the city", "her brother", "the farmer",
]
_VERBS = [
    "runs", "jumps", "reads", "writes", "builds", "sees", "finds", "likes",
    "carries", "follows", "opens", "closes", "paints", "computes", "answers", "visits",
    "watches", "remembers", "forgets", "loves",
]
_OBJECTS = [
    "the book", "a red ball", "the long road", "an apple", "the blue door", "a letter",
    "the mountain", "some water", "the window", "a new song", "the garden", "a story",
    "the tokens", "a quick answer", "the last train", "the small house", "a cup of tea",
    "the morning news",
]
_ADVERBS = [
    "quickly", "slowly", "today", "again", "quietly", "every day", "at night",
    "in the morning", "without a word", "with great care", "before dinner", "after school",
    "near the lake", "under the bridge",
]
_TEMPLATES = [
    "{s} {v} {o} {a}.",
    "{S} {v} {o}.",
    "Why does {s} {vb} {o}?",
    "{A}, {s} {v} {o}.",
    "I think {s} {v} {o} {a}!",
    "{S} never {vb} {o}; {s2} {v2} {o2} instead.",
    "\"{S} {v} {o},\" she said.",
    "When {s} {v} {o}, {s2} {v2} {o2} {a}.",
    "{S} {v} {n} {things} {a}.",
    "Note {n}: {s} {v} {o} ({a}).",
    "{S} {v} {n} {adj} {things}.",
    "Is it true that {s} {v} the {adj} {things}?",
    "The {adj} {things} were {adj2}, and {s} {v} them {a}.",
]
_THINGS = [
    "apples", "books", "cars", "tokens", "birds", "letters", "songs", "stars",
    "questions", "windows", "children", "mountains", "bottles", "pictures", "rivers",
    "machines", "numbers", "flowers", "journeys", "problems",
]
_ADJECTIVES = [
    "bright", "quiet", "strange", "beautiful", "heavy", "gentle", "ancient", "modern",
    "curious", "wonderful", "dangerous", "simple", "complicated", "yellow", "purple",
    "frozen", "electric", "hungry", "generous", "careful", "magnificent", "important",
]
_EXTRA = [
    "Yesterday the weather was cold and windy, but tomorrow should be warmer.",
    "Please remember to bring your umbrella, your passport and your tickets.",
    "The quick brown fox jumps over the lazy dog.",
    "In 2024, researchers published a paper about language models and inference.",
    "Scheduling requests efficiently requires careful memory management.",
    "Temperature, top-p and top-k control how the next token is sampled.",
    "Knowledge, experience and patience are important for every engineer.",
    "She whispered: \"Everything will be alright, just wait and see.\"",
    "Mathematics: 3 + 4 = 7, 12 * 12 = 144, and 100 / 4 = 25.",
    "An elephant, a giraffe and a zebra were walking through the savanna.",
    "Chocolate, vanilla and strawberry are the most popular flavours.",
    "Government, business and education each play a different role in society.",
]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _base_verb(verb: str) -> str:
    if verb.endswith("ches") or verb.endswith("shes"):
        return verb[:-2]
    return verb[:-1] if verb.endswith("s") else verb


def training_corpus(num_sentences: int = 600, seed: int = 0) -> list[str]:
    """Deterministic embedded English corpus (plus non-ASCII lines)."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(num_sentences):
        s, s2 = rng.choice(_SUBJECTS), rng.choice(_SUBJECTS)
        v, v2 = rng.choice(_VERBS), rng.choice(_VERBS)
        o, o2 = rng.choice(_OBJECTS), rng.choice(_OBJECTS)
        a = rng.choice(_ADVERBS)
        line = rng.choice(_TEMPLATES).format(
            s=s, S=_cap(s), s2=s2, v=v, v2=v2, vb=_base_verb(v), o=o, o2=o2,
            a=a, A=_cap(a), n=rng.randint(0, 999), things=rng.choice(_THINGS),
            adj=rng.choice(_ADJECTIVES), adj2=rng.choice(_ADJECTIVES),
        )
        if i % 7 == 0:
            line += " " + rng.choice(NON_ASCII_SAMPLES)
        if i % 11 == 0:
            line += "\n" + rng.choice(["def f(x):\n    return x + 1", "x = [1, 2, 3]", "  indented\ttext"])
        lines.append(line)
    for _ in range(3):
        lines.extend(_EXTRA)
    # Every non-ASCII sample a few times, so frequent byte pairs get merged.
    for _ in range(8):
        lines.extend(NON_ASCII_SAMPLES)
    lines.append(" ".join(NON_ASCII_SAMPLES))
    return lines


def _train_tokenizer_object(vocab_size: int = TOKENIZER_VOCAB_SIZE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No normalizer (NFC etc. would break exact round-trips of arbitrary text),
    # a byte-level pre-tokenizer without a prefix space, and a ByteLevel
    # decoder: decode(encode(t)) == t for any string.
    #
    # The split regex is Qwen2's (Llama-3 style) and ByteLevel runs with
    # use_regex=False, exactly like real Qwen2 / Llama-3 tokenizer.json files.
    # Reason: transformers 5 AutoTokenizer loads *qwen2* model dirs with its
    # own Qwen2Tokenizer, which rebuilds the pre-tokenizer (this regex) and
    # adds an NFC normalizer regardless of tokenizer.json. With the same regex
    # here, qwen2 dirs tokenize identically to the others for NFC text.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Deliberately NO post-processor: encoding never adds BOS/EOS by itself.
    # Callers (and the engine) add "<|begin_of_text|>" explicitly when wanted.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return tok


def build_tokenizer(out_dir: Path):
    """Train the tiny byte-level BPE tokenizer, save it to ``out_dir``, return it.

    Special tokens: bos ``<|begin_of_text|>`` (id 0), eos ``<|end_of_text|>``
    (id 1), pad ``<|pad|>`` (id 2), ``<|im_start|>`` (3), ``<|im_end|>`` (4).
    Encoding adds no BOS/EOS automatically (no post-processor).
    """
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer_object(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
    # Explicit "no unk token": otherwise transformers 5 loads qwen2 dirs with
    # Qwen2Tokenizer, whose unk_token default "<|endoftext|>" gets *added* as
    # an extra token with id 1024 (== outside the model's vocab).
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["unk_token"] = None
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    assert tok.bos_token_id == BOS_TOKEN_ID and tok.eos_token_id == EOS_TOKEN_ID
    assert tok.pad_token_id == PAD_TOKEN_ID
    return tok


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------

KINDS = ("llama", "qwen2", "qwen3", "mistral")

# Weight std for all matrices / embeddings, and the extra factor on the final
# norm weight (= logit temperature). Chosen so greedy text is varied and the
# top-1 logit is clearly separated (see _reinit_peaked).
INIT_STD = 0.25
LOGIT_SCALE = 3.0

_COMMON: dict[str, Any] = dict(
    vocab_size=MODEL_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=PAD_TOKEN_ID,
    dtype="float32",
)


def _config(kind: str, overrides: dict[str, Any]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if kind == "llama":
        cls = LlamaConfig
        kw = dict(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            # transformers 5: `rope_parameters` (rope_theta lives inside it)
            # replaces the old top-level rope_theta + rope_scaling.
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    elif kind == "qwen2":
        cls = Qwen2Config
        kw = dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    elif kind == "qwen3":
        cls = Qwen3Config
        kw = dict(
            head_dim=32,  # 4 * 32 = 128 != hidden_size 64
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    elif kind == "mistral":
        cls = MistralConfig
        kw = dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    else:
        raise ValueError(f"unknown checkpoint kind {kind!r}; expected one of {KINDS}")
    args = {**_COMMON, **kw, **overrides}
    return cls(**args)


def _model_class(kind: str):
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[kind]


@torch.no_grad()
def _reinit_peaked(model: torch.nn.Module, seed: int, std: float, logit_scale: float) -> None:
    """Re-initialise with larger weights so next-token logits are peaked.

    Default HF init (std 0.02) gives near-uniform logits and degenerate,
    repetitive greedy text. Here: matrices ~N(0, std), norm weights
    1 + 0.1*randn, biases ~N(0, 0.1); the final norm weight is additionally
    multiplied by ``logit_scale`` (works for tied and untied heads alike), so
    the next-token distribution has a clear winner like a trained model's.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    model.model.norm.weight.mul_(logit_scale)


def build_checkpoint(
    kind: str,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    *,
    sharded: bool = False,
    max_shard_size: str = "100KB",
    seed: int = 0,
    init_std: float = INIT_STD,
    logit_scale: float = LOGIT_SCALE,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight ``kind`` checkpoint (+ tokenizer) to ``out_dir``.

    ``overrides`` go into the transformers config (e.g. ``num_hidden_layers=3``,
    ``vocab_size=1100``). ``sharded=True`` saves with a small ``max_shard_size``
    so that ``model.safetensors.index.json`` and several shards are written.
    Returns ``out_dir``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _config(kind, overrides)
    torch.manual_seed(seed)
    model = _model_class(kind)(config)
    model = model.to(torch.float32).eval()
    _reinit_peaked(model, seed=seed, std=init_std, logit_scale=logit_scale)
    with _quiet_progress_bars():
        # transformers 5 always writes safetensors (no safe_serialization arg).
        if sharded:
            model.save_pretrained(out_dir, max_shard_size=max_shard_size)
        else:
            model.save_pretrained(out_dir)

    if tokenizer_dir is not None:
        # Copy the files verbatim (a load + save_pretrained round trip in
        # transformers 5 adds junk such as "is_local" to tokenizer_config.json).
        for f in sorted(Path(tokenizer_dir).iterdir()):
            if f.is_file():
                shutil.copy2(f, out_dir / f.name)
    else:
        build_tokenizer(out_dir)
    return out_dir


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _forward_with_cache(model, input_ids, cache):
    """One forward step with a KV cache, across transformers versions.

    transformers 5.24 renamed the ``past_key_values`` argument/output to
    ``cache`` (the old name still works but warns).
    """
    if _CACHE_ARG.get(type(model)) is None:
        params = inspect.signature(model.forward).parameters
        _CACHE_ARG[type(model)] = "cache" if "cache" in params else "past_key_values"
    arg = _CACHE_ARG[type(model)]
    out = model(input_ids=input_ids, use_cache=True, **{arg: cache})
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits, new_cache


_CACHE_ARG: dict[type, str] = {}


def load_reference_model(model_dir: Path, attn_implementation: str = "eager"):
    from transformers import AutoModelForCausalLM

    with _quiet_progress_bars():
        # transformers 5: `dtype=` (``torch_dtype`` is deprecated); pass it
        # explicitly, the default is no longer guaranteed to be float32.
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation=attn_implementation
        )
    return model.eval()


@torch.no_grad()
def reference_greedy(
    model_dir: Path,
    prompts_token_ids: list[list[int]],
    max_new_tokens: int,
    *,
    model: torch.nn.Module | None = None,
    use_cache: bool = True,
) -> list[list[int]]:
    """Greedy continuations (new ids only), exactly ``max_new_tokens`` each.

    Batch size 1, no padding, EOS ignored. A plain forward loop with the
    model's KV cache (``use_cache=False``: full recompute per step) is used
    rather than ``generate`` so no generation config (eos, min/max length,
    ...) can change the result. Pass ``model`` (from
    :func:`load_reference_model`) to avoid reloading.
    """
    if model is None:
        model = load_reference_model(model_dir)
    results: list[list[int]] = []
    for prompt in prompts_token_ids:
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        new: list[int] = []
        if use_cache:
            input_ids = torch.tensor([list(prompt)], dtype=torch.long)
            cache = None
            for _ in range(max_new_tokens):
                logits, cache = _forward_with_cache(model, input_ids, cache)
                nxt = int(torch.argmax(logits[0, -1].float()))
                new.append(nxt)
                input_ids = torch.tensor([[nxt]], dtype=torch.long)
        else:  # full recompute every step: slower, no cache involved at all
            seq = list(prompt)
            for _ in range(max_new_tokens):
                ids = torch.tensor([seq], dtype=torch.long)
                logits = model(input_ids=ids, use_cache=False).logits
                nxt = int(torch.argmax(logits[0, -1].float()))
                new.append(nxt)
                seq.append(nxt)
        results.append(new)
    return results


@torch.no_grad()
def reference_logprobs(
    model_dir: Path,
    full_token_ids: list[int],
    *,
    model: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``log_softmax`` of the logits at every position: float32 ``[len, vocab]``.

    Row ``i`` is the distribution over the token *following* position ``i``.
    """
    if model is None:
        model = load_reference_model(model_dir)
    input_ids = torch.tensor([list(full_token_ids)], dtype=torch.long)
    logits = model(input_ids=input_ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


__all__ = [
    "BOS_TOKEN", "EOS_TOKEN", "PAD_TOKEN", "IM_START_TOKEN", "IM_END_TOKEN",
    "BOS_TOKEN_ID", "EOS_TOKEN_ID", "PAD_TOKEN_ID", "IM_START_TOKEN_ID", "IM_END_TOKEN_ID",
    "KINDS", "NON_ASCII_SAMPLES", "CHAT_TEMPLATE", "MODEL_VOCAB_SIZE", "TOKENIZER_VOCAB_SIZE",
    "training_corpus", "build_tokenizer", "build_checkpoint",
    "load_reference_model", "reference_greedy", "reference_logprobs",
]
