"""Validates a prompt and its sampling parameters into an EngineRequest."""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Iterable

from ..engine.request import EngineRequest
from ..errors import InvalidRequestError
from ..sampling_params import DEFAULT_MAX_N, SamplingParams
from ..structured import GrammarCompiler, GrammarTemplate
from ..tools import ToolContext, build_tool_context, parser_class
from .generation_defaults import sampling_defaults
from .prompts import Prompt, check_prompt_length, is_chat, tokenize_prompt
from .stop_strings import StopStringEnds

_counter = itertools.count()

# Inputs above these sizes are processed in a worker thread by AsyncLLM (tokenizing 4k characters
# takes ~0.3 ms; chat templates, tools and grammars always go there: their cost is not bounded).
WORKER_PROMPT_CHARS = 4096
WORKER_PROMPT_IDS = 8192
WORKER_FIELD_ITEMS = 256
_STRUCTURED = ("json_schema", "regex", "choice", "grammar")


class InputProcessor:
    """Front-side validation: parameters, prompt, tools, and the grammar a request needs.

    Grammars (structured output, forced tool calls) are compiled here, at submission, so a bad
    schema, regex or grammar is an InvalidRequestError naming the field and never reaches the
    engine; compiled grammars are cached (``self.grammars``).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: Iterable[int] = (),
                 tool_parser: str = "hermes", max_n: int = DEFAULT_MAX_N, max_num_seqs: int | None = None,
                 sampling_defaults: dict[str, Any] | None = None,
                 check_fits: Callable[[EngineRequest], None] | None = None, multimodal=None) -> None:
        """``check_fits``: the engine's own refusal of a request no schedule could complete (KV blocks),
        run here so that such a request is refused before any front registers it."""
        self.tokenizer = tokenizer
        self.check_fits = check_fits
        # the checkpoint's generation_config.json values, for requests without a SamplingParams object
        self.sampling_defaults = dict(sampling_defaults or {})
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # a request's n sequences must fit in the running set at once, or it could never start
        self.max_n = min(max_n, max_num_seqs) if max_num_seqs else max_n
        self.tool_parser = parser_class(tool_parser).name
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.multimodal = multimodal  # a vision-language model's MultiModalProcessor (frontend/multimodal.py)

    def process(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None = None,
                sampling_kwargs: dict[str, Any] | None = None, tools: list | None = None,
                cache_salt: Any = None, lora: Any = None, tool_choice: Any = None,
                parallel_tool_calls: bool | None = None, priority: int = 0,
                pooling: str | None = None) -> tuple[str | None, EngineRequest]:
        """Tokenize and validate; raises InvalidRequestError naming the bad field. ``pooling`` ("last"
        or "mean") makes an embedding request: the prompt's hidden states pooled, nothing sampled."""
        check_priority(priority)
        if pooling not in (None, "last", "mean"):
            raise InvalidRequestError(f"pooling: expected 'last' or 'mean', got {pooling!r}", field="pooling")
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError("params: expected a SamplingParams", field="params")
        # always a private copy: validation normalises fields and the caller may reuse its object
        sampling_kwargs = sampling_kwargs or {}
        if params is None and self.sampling_defaults:
            sampling_kwargs = {**self.sampling_defaults, **sampling_kwargs}
        params = SamplingParams.from_kwargs(params, sampling_kwargs)
        params.validate(self.vocab_size, self.max_n)
        if self.tokenizer is None:
            _check_token_only(prompt, params, tools)
        tool_context = build_tool_context(tools, tool_choice, parallel_tool_calls, self.tool_parser)
        if tool_context is not None and not is_chat(prompt):
            raise InvalidRequestError("tools: only allowed with a chat (list of messages) prompt", field="tools")
        grammar = self._grammar(params, tool_context)
        truncate = params.truncate_prompt_tokens
        # a prompt to be truncated may be longer than the context: only its tail has to fit
        text, ids, images = tokenize_prompt(prompt, self.tokenizer, self.vocab_size, tools, self.tool_parser,
                                            None if truncate else self.max_model_len, self.multimodal)
        if truncate is not None and len(ids) > truncate:
            if images:  # cutting the head could cut an image's placeholders in two
                raise InvalidRequestError("truncate_prompt_tokens: not with images in the prompt",
                                          field="truncate_prompt_tokens")
            ids = ids[-truncate:]
        check_prompt_length(len(ids), self.max_model_len)
        max_tokens = self._max_tokens(params, len(ids))
        if request_id is None:
            request_id = f"req-{next(_counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id: expected a non-empty string", field="request_id")
        request = EngineRequest(request_id, ids, params, max_tokens, time.monotonic(), cache_salt, lora,
                                grammar=grammar, tool_context=tool_context, priority=priority)
        if params.use_beam_search and params.stop_strings:  # beams end on stop strings as on end tokens
            request.beam_stop = StopStringEnds(self.tokenizer, params.stop_strings)
        if params.bad_words:
            request.bad_words_ids = self._bad_words_ids(params.bad_words)
        request.pooling = pooling
        request.images = images
        if images:  # M-RoPE families: the prompt's 3-D positions, computed here once (model/mrope.py)
            request.mrope = self.multimodal.mrope_positions(len(ids), images)
        if self.check_fits is not None:
            self.check_fits(request)
        return text, request

    def needs_worker(self, prompt: Any, params: SamplingParams | None, sampling_kwargs: dict[str, Any],
                     tools: list | None) -> bool:
        """Whether :meth:`process` may take long enough to stall an event loop (then AsyncLLM runs it
        in its input worker pool): chat prompts, tools, grammars, and anything large."""
        if tools or (params is not None and isinstance(params, SamplingParams)
                     and (params.structured or params.bad_words)):
            return True
        if isinstance(prompt, str):
            if len(prompt) > WORKER_PROMPT_CHARS:
                return True
        elif isinstance(prompt, dict) or is_chat(prompt) or not isinstance(prompt, (list, tuple)) or len(prompt) > WORKER_PROMPT_IDS \
                or any(isinstance(item, dict) for item in prompt):
            return True
        for name, value in sampling_kwargs.items():
            # compiled / tokenized at submission (an empty schema or regex still compiles: not truthiness)
            if (name in _STRUCTURED or name == "bad_words") and value is not None and value is not False:
                return True
            if isinstance(value, (str, list, tuple, dict)) and len(value) > WORKER_FIELD_ITEMS:
                return True
        return False

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (a word inside a sentence is
        usually tokenized with its leading space)."""
        if self.tokenizer is None:
            raise InvalidRequestError("bad_words: needs a tokenizer (skip_tokenizer_init=True)", field="bad_words")
        sequences: dict[tuple[int, ...], None] = {}  # (ordered, without repeats)
        for word in words:
            for variant in {word, word if word.startswith(" ") else " " + word}:
                ids = tuple(self.tokenizer.encode(variant, add_special_tokens=False))
                if ids:
                    sequences[ids] = None
        return [list(ids) for ids in sequences]

    def _max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> int:
        """``max_tokens`` checked against what the context leaves; omitted (None): all of it."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise InvalidRequestError(
                    f"min_tokens: {params.min_tokens} requested, but the prompt's {num_prompt_tokens} tokens "
                    f"leave room for {room} in max_model_len {self.max_model_len}", field="min_tokens")
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens: {params.max_tokens} requested, but the prompt has {num_prompt_tokens} tokens and "
                f"max_model_len is {self.max_model_len}, which leaves room for {room}", field="max_tokens")
        return params.max_tokens

    def _grammar(self, params: SamplingParams, tools: ToolContext | None) -> GrammarTemplate | None:
        """The request's grammar: its structured-output fields, or the one that forces a tool call."""
        if tools is None or not tools.forces_call:
            return self.grammars.compile_params(params) if params.structured else None
        if params.structured:
            raise InvalidRequestError("tool_choice: 'required' or a named function cannot be combined with "
                                      "json_schema, regex, choice or grammar", field="tool_choice")
        fmt = parser_class(tools.parser)
        parallel = tools.parallel and tools.choice == "required"
        lark = fmt.forced_grammar(tools.forced_functions(), parallel, self._special_token_id)
        return self.grammars.compile_lark(lark, "tools")

    def _special_token_id(self, text: str) -> int | None:
        """The id of an added (e.g. special) token spelled ``text``, if the tokenizer has one."""
        added = getattr(self.tokenizer, "added_tokens_encoder", None) or {}
        return added.get(text)


def _check_token_only(prompt: Any, params: SamplingParams, tools: list | None) -> None:
    """Without a tokenizer (``skip_tokenizer_init=True``) only token-id prompts and token-level
    parameters make sense; anything that needs text is refused by name."""
    why = "this engine was started with skip_tokenizer_init=True"
    if isinstance(prompt, str) or is_chat(prompt):
        raise InvalidRequestError(f"prompt: pass token ids; {why} (no text prompts or messages)", field="prompt")
    if tools:
        raise InvalidRequestError(f"tools: {why}", field="tools")
    for name in ("stop", *_STRUCTURED):
        value = params.stop_strings if name == "stop" else getattr(params, name, None)
        if value:
            raise InvalidRequestError(f"{name}: needs a tokenizer; {why}", field=name)




def make_input_processor(engine, tokenizer, tool_parser: str | None = None) -> InputProcessor:
    """The InputProcessor of a front over ``engine``: EOS ids for grammars, the tool-call format."""
    from ..tools import detect_tool_parser

    parser = tool_parser or ("hermes" if tokenizer is None
                             else detect_tool_parser(tokenizer, getattr(engine.hf_config, "model_type", None)))
    defaults = sampling_defaults(engine.model_dir) if engine.config.generation_config == "auto" else {}
    return InputProcessor(tokenizer, engine.vocab_size, engine.max_model_len,
                          eos_token_ids=engine.stop_checker.eos_token_ids, tool_parser=parser,
                          max_n=engine.config.max_n, max_num_seqs=engine.config.max_num_seqs,
                          sampling_defaults=defaults, check_fits=getattr(engine, "check_fits", None),
                          multimodal=_multimodal_processor(engine, tokenizer))


def _multimodal_processor(engine, tokenizer):
    """The processor of a vision-language model (None for text models, or without a tokenizer)."""
    spec = getattr(engine.runner.shape, "vision", None)
    if spec is None or tokenizer is None:
        return None
    from ..model.registry import architecture_for
    from .images import ImagePolicy
    from .multimodal import MultiModalProcessor

    model_class = architecture_for(engine.hf_config, engine.config.model_impl).model_class()
    return MultiModalProcessor(engine.model_dir, model_class, spec, ImagePolicy.from_config(engine.config),
                               engine.config.mm_processor_kwargs)


PRIORITY_LIMIT = 2**31  # any 32-bit signed value a client may send


def check_priority(priority: Any) -> None:
    """A request's scheduling priority: an integer, lower first (engine/scheduler.py)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -PRIORITY_LIMIT <= priority < PRIORITY_LIMIT:
        raise InvalidRequestError(f"priority: expected an integer in [-2**31, 2**31), got {priority!r}",
                                  field="priority")
