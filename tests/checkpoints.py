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

import inspect
from pathlib import Path

import torch

from asyncllm.toy.checkpoints import KINDS, build_checkpoint  # noqa: F401 (re-exported for tests)
from asyncllm.toy.checkpoints import _quiet_progress_bars
from asyncllm.toy.tokenizer import *  # noqa: F401,F403 (token ids, corpus, build_tokenizer)
from asyncllm.toy.tokenizer import build_tokenizer  # noqa: F401


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
def assert_greedy_equal_up_to_ties(got: list[list[int]], expected: list[list[int]], prompts_token_ids: list[list[int]],
                                   model: torch.nn.Module, tie: float = 1e-4) -> None:
    """``got`` equals transformers' greedy ``expected`` token for token, except that a continuation may part
    from it where transformers' own top two logits lie within ``tie`` of each other: there the winner is decided
    by float32 summation order, not by the model (two correct float32 programs can pick either). Everything
    before that point must be equal, and the token taken must be one transformers scores within ``tie`` of its
    maximum; after it the continuations are different texts and are not compared."""
    assert len(got) == len(expected)
    for prompt, ours, theirs in zip(prompts_token_ids, got, expected):
        assert len(ours) == len(theirs)
        if ours == theirs:
            continue
        at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
        logits = model(input_ids=torch.tensor([list(prompt) + theirs[:at]]), use_cache=False).logits[0, -1].float()
        margin = float(logits[theirs[at]] - logits[ours[at]])
        assert margin <= tie, (f"token {at} of a continuation differs from transformers' with a margin of "
                               f"{margin:.3g} (not a tie): {ours} != {theirs}")


def strong_peft_adapter(model_dir: Path, targets: list[str], out_dir: Path, seed: int,
                        parameters: list[str] | None = None, rank: int = 4):
    """A rank-``rank`` PEFT LoRA adapter on modules ``targets`` (and on ``parameters``: PEFT's
    ``target_parameters``, the experts' stacked weights) whose A matrices are scaled up (so its effect on
    greedy output is visible), saved to ``out_dir``; returns PEFT's merged model to compare against."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    extra = {"target_parameters": parameters} if parameters else {}
    peft_model = get_peft_model(load_reference_model(model_dir), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.mul_(3.0)
    peft_model.save_pretrained(out_dir)
    return peft_model.merge_and_unload()


def random_prompts(name: str, lengths: list[int]) -> list[list[int]]:
    """Prompts of random token ids (5..999) of the given lengths, seeded by ``name``."""
    import random

    rng = random.Random(name)
    return [[rng.randrange(5, 1000) for _ in range(n)] for n in lengths]


def fresh_reference_greedy(model_dir: Path, prompts_token_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """:func:`reference_greedy` with a freshly loaded model per prompt: transformers' dynamic rope keeps
    state between calls (a later, shorter prompt would reuse an earlier one's frequencies)."""
    return [reference_greedy(model_dir, [p], max_new_tokens, model=load_reference_model(model_dir))[0]
            for p in prompts_token_ids]


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
    "load_reference_model", "reference_greedy", "reference_logprobs", "random_prompts", "fresh_reference_greedy",
]