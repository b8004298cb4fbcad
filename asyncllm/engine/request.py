"""A request as the engine sees it, and its ``n`` sequences."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from ..sampling_params import SamplingParams
from .block_pool import BlockKey

_serials = itertools.count(1)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"        # queued (new, or preempted and to be recomputed)
    RUNNING = "running"        # holds blocks and is scheduled every step
    AWAITING_FORK = "fork"     # a child of n > 1 waiting for its leader's prefill
    FINISHED = "finished"


@dataclass
class EngineRequest:
    """A validated request handed to the engine (prompt already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                     # resolved: never runs past max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: Hashable = None         # extra prefix-cache key (the LoRA adapter identity)
    lora: Any = None                    # LoRAWeights of the request's adapter, or None for the base model
    serial: int = field(default_factory=lambda: next(_serials))  # unique even when request ids are reused
    grammar: Any = None                 # structured output: a compiled GrammarTemplate (asyncllm.structured)
    tool_context: Any = None            # the front's tool-calling state (parser choice); the engine ignores it
    num_unfinished: int = 0             # the engine's count of this request's sequences still running
    priority: int = 0                   # lower runs first (scheduler.py); equal priorities: arrival order
    beam_stop: Any = None               # beam search with stop strings: token ids -> the stop string they end with
    bad_words_ids: list[list[int]] | None = None  # SamplingParams.bad_words as token id sequences
    pooling: str | None = None          # an embedding request: "last" or "mean" over the prompt; nothing sampled
    images: list = field(default_factory=list)  # ImageInput (model/step_io.py) per image, in prompt order
    mrope: Any = None                   # M-RoPE families, a prompt with images: its MRopePositions (model/mrope.py)

    def __post_init__(self) -> None:
        if self.lora is not None and self.cache_salt is None:
            self.cache_salt = ("lora", self.lora.adapter_id)  # two adapters never share KV blocks


class Sequence:
    """One generated continuation: its tokens, how many have KV computed, its block table."""

    def __init__(self, request: EngineRequest, index: int, generator: torch.Generator | None) -> None:
        self.request = request
        self.index = index
        self.seq_id = f"{request.request_id}#{index}"
        self.params = request.params
        self.priority = request.priority
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_released_blocks = 0  # leading block-table entries given back (behind a sliding window)
        self.block_keys: list[BlockKey] = []   # keys of this sequence's full blocks, computed lazily
        self.num_registered_blocks = 0         # full blocks already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.pending_children: list[Sequence] = []  # n > 1: siblings forked after this one's prefill
        self.num_cached_tokens = 0             # prompt tokens served from the prefix cache
        self.lora_wait_steps = 0               # steps spent waiting for a free LoRA slot
        self.prompt_logprob_pos = 0            # prompt positions whose next-token logprob was reported
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.grammar = None                    # GrammarState: this sequence's own matcher, if constrained
        self.beam_group = None                 # BeamGroup of a beam-search request (engine/beam_search.py)
        # speculative decoding (engine/speculation.py): tokens proposed after the last one, the grammar
        # states after each of them (constrained sequences), and the back-off after failed proposals
        self.draft_tokens: list[int] = []
        self.draft_grammars: list = []
        self.pooled_sum = None                 # embedding requests, mean pooling: hidden states summed so far
        self.spec_hits = 0.0     # decayed counts of accepted drafts and of rejections (speculation.py)
        self.spec_misses = 0.0
        self.spec_cooldown = 0
        self.spec_wait = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def lora_id(self) -> int | None:
        return self.request.lora.adapter_id if self.request.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """The leader of a request with ``prompt_logprobs`` still owes some of them."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and self.prompt_logprob_pos < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_key(self, block_index: int, block_size: int) -> BlockKey:
        """The prefix-cache key of full block ``block_index`` (chained through its parents)."""
        while len(self.block_keys) <= block_index:
            i = len(self.block_keys)
            parent = self.block_keys[i - 1] if i else None
            tokens = tuple(self.token_ids[i * block_size:(i + 1) * block_size])
            self.block_keys.append(BlockKey(parent, tokens, self._extra_key(i * block_size, block_size)))
        return self.block_keys[block_index]

    def _extra_key(self, start: int, block_size: int) -> Hashable:
        """The cache salt, with the content hash of every image whose placeholders the block holds: the
        placeholder tokens are the same for every image, so two different images never share a block."""
        salt = self.request.cache_salt
        images = tuple((image.content_hash, image.offset - start) for image in self.request.images
                       if image.offset < start + block_size and image.offset + image.length > start)
        return (salt, images) if images else salt

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
