"""A small byte-level BPE tokenizer trained locally on an embedded corpus (no hub access).

Used by the demo model, the tests and the benchmarks. Special tokens: bos ``<|begin_of_text|>``
(0), eos ``<|end_of_text|>`` (1), pad ``<|pad|>`` (2), ``<|im_start|>`` (3), ``<|im_end|>`` (4).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

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
