"""``LLM``: the synchronous, offline-batch front of the engine."""

from __future__ import annotations

import itertools
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine.core import EngineCore
from .errors import EngineDeadError, InvalidRequestError
from .frontend.input_processor import make_input_processor
from .frontend.lora import load_lora
from .frontend.output_processor import OutputProcessor
from .frontend.pooling import embedding_kwargs, model_pooling
from .frontend.prompts import Prompt
from .model.loader import load_tokenizer
from .outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams

_batch_ids = itertools.count()


class LLM:
    """Generate for a batch of prompts in the caller's thread.

    ``LLM("path/to/checkpoint", dtype="float32").generate(["Hello"], SamplingParams(max_tokens=8))``
    """

    def __init__(self, model: str, *, tool_parser: str | None = None, **engine_kwargs: Any) -> None:
        """Other keywords configure the engine (docs/api.md). ``max_itl_ms`` defaults to None here:
        ``generate`` streams nothing, so throughput is all that counts (AsyncLLM defaults to "auto")."""
        engine_kwargs.setdefault("max_itl_ms", None)
        self.config = EngineConfig.from_kwargs(model, engine_kwargs)
        self.engine = EngineCore(self.config)
        # skip_tokenizer_init: token ids in and out, no text (docs/api.md)
        self.tokenizer = None if self.config.skip_tokenizer_init else load_tokenizer(self.engine.model_dir)
        self.inputs = make_input_processor(self.engine, self.tokenizer, tool_parser)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, lora: Any = None, use_tqdm: bool | None = None, tools: list | None = None,
                 tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                 priority: int | Seq[int] = 0) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        ``prompts`` is one prompt or a list of them (text, token ids or chat messages);
        ``params`` is one SamplingParams for all or a list with one per prompt; ``lora`` likewise
        one adapter (name or LoRARequest) for all, or a list with one per prompt (None: base model).
        ``tools``/``tool_choice``/``parallel_tool_calls`` apply to every (chat) prompt (docs/tools.md).
        ``priority`` is one integer for all or one per prompt: lower values are scheduled first.
        """
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        loras = lora if isinstance(lora, (list, tuple)) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"lora: {len(loras)} adapters for {len(prompts)} prompts", field="lora")
        adapters = [load_lora(self.engine.loras, item) for item in loras]
        priorities = list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(f"priority: {len(priorities)} values for {len(prompts)} prompts",
                                      field="priority")
        batch = next(_batch_ids)
        tool_args = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
        requests = [self.inputs.process(p, sp, request_id=f"gen-{batch}-{i}", lora=adapter, priority=prio,
                                        **tool_args)
                    for i, (p, sp, adapter, prio) in enumerate(zip(prompts, params_list, adapters, priorities))
                    ]  # validate all first
        return self._run_requests(requests, use_tqdm)

    def embed(self, prompts: Prompt | Seq[Prompt], *, pooling: str | None = None, lora: Any = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool | None = None) -> list[list[float]]:
        """One embedding per prompt, in order: the final hidden states pooled ("last" token or "mean"
        over the prompt) and L2-normalised (see ``AsyncLLM.embed``)."""
        prompts = _as_prompt_list(prompts)
        adapter = load_lora(self.engine.loras, lora)
        batch = next(_batch_ids)
        pooling = pooling or model_pooling(self.engine.model_dir)
        requests = [self.inputs.process(p, None, request_id=f"emb-{batch}-{i}",
                                        sampling_kwargs=embedding_kwargs(truncate_prompt_tokens),
                                        lora=adapter, pooling=pooling) for i, p in enumerate(prompts)]
        return [out.embedding for out in self._run_requests(requests, use_tqdm, "embedding")]

    def _run_requests(self, requests: list, use_tqdm: bool | None, what: str = "generating") -> list[RequestOutput]:
        """Step the engine until every request finished; their outputs in order."""
        processor = OutputProcessor(self.tokenizer, self.engine.stop_sequence, self.engine.abort_request)
        for text, request in requests:
            processor.add(request, text)
            self.engine.add_request(request)
        finals: dict[str, RequestOutput] = {}
        show = use_tqdm if use_tqdm is not None else False
        with tqdm(total=len(requests), desc=what, disable=not show) as progress:
            try:
                while len(finals) < len(requests):
                    for state in processor.process(self._step()):
                        if state.error is not None:
                            raise state.error
                        if state.finished:
                            finals[state.request_id] = state.output()
                            progress.update(1)
            except BaseException:
                for _, request in requests:  # leave the engine clean (KeyboardInterrupt included)
                    if request.request_id not in finals:
                        self.engine.abort_request(request.request_id)
                raise
            finally:
                self.engine.apply_pending()  # stop strings found in the last step free their blocks now
        return [finals[request.request_id] for _, request in requests]

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams, *, lora: Any = None,
                    use_tqdm: bool | None = None) -> list[BeamSearchOutput]:
        """Beam search for every prompt: each result holds ``params.beam_width`` hypotheses, best
        first (score: log-probability sum / length ** length_penalty, docs/decoding.md)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError("params: expected a BeamSearchParams", field="params")
        outputs = self.generate(prompts, params.to_sampling_params(), lora=lora, use_tqdm=use_tqdm)
        return [BeamSearchOutput([BeamSearchSequence(out.prompt_token_ids + c.token_ids, _token_logprobs(c),
                                                     c.cumulative_logprob, c.text, c.finish_reason, c.stop_reason)
                                  for c in out.outputs]) for out in outputs]

    def _step(self):
        """One engine step; a failure inside it resets the engine (nothing else runs in it: this
        call's requests are dropped, every block freed) and becomes EngineDeadError, so the next
        ``generate`` starts from a clean engine."""
        if not self.engine.healthy:
            raise EngineDeadError("a tensor-parallel worker is gone: the engine cannot recover; create a new LLM")
        try:
            return self.engine.step()
        except Exception as exc:
            self.engine.reset()
            raise EngineDeadError(f"an engine step failed: {exc!r} (the engine was reset)") from exc

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also end with this process), and the
        grammar engine's guard processes."""
        self.engine.shutdown()
        self.inputs.grammars.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def add_lora(self, name: str, path: str) -> None:
        """Load and register a PEFT adapter under ``name`` (LoRAError if it does not fit the model)."""
        self.engine.loras.load(name, str(path))

    def remove_lora(self, name: str) -> None:
        self.engine.loras.remove(name)

    def list_loras(self) -> list[str]:
        return self.engine.loras.names()

    def stats(self) -> dict[str, int]:
        """Engine counters: running/waiting sequences, KV blocks, preemptions, prefix-cache hits."""
        return self.engine.stats()


def _token_logprobs(completion) -> list[float]:
    """Each generated token's log-probability (beam outputs carry them in their top-logprob maps
    only when asked; the cumulative value is always there)."""
    if completion.logprobs:
        return [entry[token] for entry, token in zip(completion.logprobs, completion.token_ids)]
    return []


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):  # a dict: one multimodal prompt {"prompt": ..., "images": ...}
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(m, dict) and ("prompt" in m or "prompt_token_ids" in m)
                                                              and "role" not in m for m in prompts):
        return list(prompts)  # multimodal prompts, or vLLM's {"prompt_token_ids": [...]}
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt given as token ids
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(m, dict) for m in prompts):
        return [list(prompts)]  # one chat conversation
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts: expected a prompt or a non-empty list of prompts", field="prompts")
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"params: {len(params)} SamplingParams for {count} prompts", field="params")
    return params
