"""Pydantic models of the OpenAI chat-completions and completions protocol (plus vLLM's extras).

Requests are validated strictly (``"0.5"`` is not a number, ``true`` is not an integer), as
OpenAI does, and unknown fields are ignored, as vLLM does, so clients and agent frameworks
that send newer OpenAI fields keep working. Responses serialise exactly the fields OpenAI sends.
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from ..errors import InvalidRequestError
from ..frontend.messages import ChatMessage, TextContentPart  # noqa: F401 - part of the protocol
from ..frontend.prompts import ChatPrompt  # noqa: F401 - chat_prompt() returns one


# A prompt (text or token ids) or a batch of them. Each list stops at its first bad item: a union tries
# every alternative, and a 100,000-id list would otherwise collect 100,000 errors as "a list of strings".
PromptInput = Union[str, Annotated[list[str], Field(fail_fast=True)], Annotated[list[int], Field(fail_fast=True)],
                    Annotated[list[Annotated[list[int], Field(fail_fast=True)]], Field(fail_fast=True)]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="after")
    def _finite_numbers(self):
        """NaN and Infinity are not JSON (the parser accepts them): refused in free-form fields too
        (metadata, schemas, tool definitions), which would otherwise reach the answer and fail it."""
        path = non_finite_path(self.__dict__)
        if path is not None:
            raise PydanticCustomError("non_finite_number", "{path}: NaN and Infinity are not valid JSON numbers",
                                      {"path": path})
        return self


def non_finite_path(value: Any) -> str | None:
    """The path (``a.b[2]``) of the first NaN or infinite float inside ``value``, found without recursion."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, float):
            if not math.isfinite(node):
                return path.lstrip(".")
        elif isinstance(node, dict):
            stack.extend((v, f"{path}.{k}") for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
    return None


class _Response(BaseModel):
    """A response object; fields listed in ``_omit_if_none`` vanish from the JSON when None."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


# ---- requests ------------------------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = None  # OpenAI's {"name", "schema", "strict", "description"}

    def schema(self) -> dict[str, Any]:
        """The JSON schema the output must follow (``json_object``: any JSON object)."""
        if self.type == "json_object":
            return {"type": "object"}
        if not isinstance(self.json_schema, dict) or not isinstance(self.json_schema.get("schema", {}), dict):
            raise InvalidRequestError("response_format: json_schema needs {'name': ..., 'schema': {...}}",
                                      field="response_format")
        return self.json_schema.get("schema", {"type": "object"})


class _SamplingFields(_Request):
    """Fields shared by both endpoints: OpenAI's, then vLLM's sampling extras."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields kept (ignored) to spot refused ones

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted and ignored
    response_format: Optional[ResponseFormat] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    priority: Optional[int] = None  # scheduling: lower first (AsyncLLM's ``priority`` keyword, not sampling)
    best_of: Optional[int] = None
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    early_stopping: Union[bool, Literal["never"], None] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_tokens_as_token_ids: Optional[bool] = None
    # the generated (and prompt) token ids beside the text: ``token_ids`` per choice or delta,
    # ``prompt_token_ids`` once per prompt (what asyncllm.client.AsyncLLMClient reads)
    return_token_ids: Optional[bool] = None
    # structured output, vLLM's names: structured_outputs {json, regex, choice, grammar, json_object}
    # and the older guided_json / guided_regex / guided_choice / guided_grammar
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    _passthrough: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed",
        "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
        "include_stop_str_in_output", "skip_special_tokens", "best_of", "use_beam_search", "length_penalty",
        "early_stopping", "bad_words", "truncate_prompt_tokens", "prompt_logprobs")
    # vLLM request fields this server knows and cannot honour: a 400, never silence
    _refused: ClassVar[tuple[str, ...]] = (
        "guided_whitespace_pattern", "guided_decoding_backend", "logits_processors", "allowed_token_ids",
        "mm_processor_kwargs", "documents", "kv_transfer_params", "vllm_xargs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def common_sampling_kwargs(self) -> dict[str, Any]:
        """The SamplingParams keywords both endpoints share; the engine validates their values."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", field="stream_options")
        kwargs = {name: getattr(self, name) for name in self._passthrough if getattr(self, name) is not None}
        if self.stop:  # OpenAI treats an empty list as no stop
            kwargs["stop"] = self.stop
        for name in self._refused:
            if (self.model_extra or {}).get(name) is not None:
                raise InvalidRequestError(f"{name}: not supported by this server", field=name)
        kwargs.update(self._structured_kwargs(self._answer_is_text()))
        if self.priority is not None:  # binds to stream_outputs' own keyword, beside the sampling ones
            kwargs["priority"] = self.priority
        return kwargs

    def _answer_is_text(self) -> bool:
        """False where the answer must be a tool call (chat's forced tool_choice): ``response_format`` then
        shapes the text of later turns, not this one, as OpenAI sequences them."""
        return True

    def _structured_kwargs(self, with_response_format: bool = True) -> dict[str, Any]:
        """The one structured-output constraint of the request, from whichever name carried it."""
        given: list[tuple[str, str, Any]] = []  # (request parameter, SamplingParams field, value)
        if self.response_format is not None and self.response_format.type != "text":
            schema = self.response_format.schema()  # checked even where this answer does not use it
            if with_response_format:
                given.append(("response_format", "json_schema", schema))
        if self.structured_outputs is not None:
            names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
            for key, value in self.structured_outputs.items():
                if key == "json_object" and value:
                    given.append(("structured_outputs", "json_schema", {"type": "object"}))
                elif key in names and value is not None:
                    given.append(("structured_outputs", names[key], value))
                elif key not in names and key != "json_object" and value is not None:
                    raise InvalidRequestError(f"structured_outputs: {key!r} is not supported (json, regex, choice, "
                                              "grammar, json_object are)", field="structured_outputs")
        for name, target in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                             ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, target, getattr(self, name)))
        if len(given) > 1:
            raise InvalidRequestError(f"{given[1][0]}: only one structured-output constraint per request (also "
                                      f"given: {given[0][0]})", field=given[1][0])
        return {target: value for _, target, value in given}

    def param_for(self, field: str | None) -> str | None:
        """The request parameter a SamplingParams field came from (for error messages)."""
        if field in ("json_schema", "regex", "choice", "grammar"):
            return self.structured_source()
        return field

    def structured_source(self) -> str:
        """The request parameter that carried the structured-output constraint (for error messages)."""
        for name in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "response_format"


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI's deprecated function calling, which it still accepts: mapped to tools (see chat_tools)
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Union[Literal["none", "auto"], dict[str, Any], None] = None
    # vLLM's chat extras
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: Optional[bool] = None
    continue_final_message: bool = False
    echo: bool = False

    def chat_prompt(self) -> "ChatPrompt":
        """The messages with the template options (``add_generation_prompt`` defaults to the opposite
        of ``continue_final_message``)."""
        add = self.add_generation_prompt if self.add_generation_prompt is not None else not self.continue_final_message
        return ChatPrompt([m.to_template_dict() for m in self.messages], add_generation_prompt=add,
                          continue_final_message=self.continue_final_message,
                          chat_template_kwargs=dict(self.chat_template_kwargs or {}))

    def _answer_is_text(self) -> bool:
        choice = self.function_call if self.functions is not None else self.tool_choice
        return not (choice == "required" or isinstance(choice, dict))

    @property
    def legacy_functions(self) -> bool:
        """The request uses ``functions``/``function_call``: the answer then carries ``function_call``."""
        return self.functions is not None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """``tools``, or the legacy ``functions`` as tools (one call at most, as that API returns)."""
        if self.functions is None:
            if self.function_call is not None:
                raise InvalidRequestError("function_call: requires functions", field="function_call")
            return self.tools
        if self.tools is not None:
            raise InvalidRequestError("functions: cannot be combined with tools (functions is the older form "
                                      "of tools: send one of them)", field="functions")
        if not all(isinstance(f, dict) for f in self.functions):
            raise InvalidRequestError("functions: expected a list of function objects", field="functions")
        return [{"type": "function", "function": f} for f in self.functions]

    def _tool_choice(self) -> Any:
        if self.functions is None:
            return self.tool_choice
        if self.tool_choice is not None:
            raise InvalidRequestError("tool_choice: use function_call with functions", field="tool_choice")
        call = self.function_call
        if call is None or isinstance(call, str):
            return call
        name = call.get("name")
        if not isinstance(name, str) or set(call) - {"name"}:
            raise InvalidRequestError('function_call: expected "none", "auto" or {"name": <function name>}',
                                      field="function_call")
        return {"type": "function", "function": {"name": name}}

    def echoed(self) -> str:
        """With ``echo``: the last message's text when it is the assistant's (the answer continues it)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        content = last.to_template_dict().get("content")
        return content if isinstance(content, str) else ""

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = self.common_sampling_kwargs()
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kwargs["max_tokens"] = max_tokens  # None: as much as the context leaves, as OpenAI does
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs to be true", field="top_logprobs")
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        tool_choice = self._tool_choice()
        if tool_choice is not None:  # validated (with tools) by the engine's front
            kwargs["tool_choice"] = tool_choice
        if self.functions is not None:
            kwargs["parallel_tool_calls"] = False  # the legacy answer holds one function_call
        elif self.parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = self.parallel_tool_calls
        return kwargs

    def param_for(self, field: str | None) -> str | None:
        """The request parameter a SamplingParams field came from (for error messages)."""
        if self.functions is not None and field in ("tools", "tool_choice"):
            return {"tools": "functions", "tool_choice": "function_call"}[field]
        renames = {"prompt": "messages", "logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"}
        return renames.get(field) or super().param_for(field)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` (the legacy text-completion endpoint)."""

    prompt: PromptInput
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

    def prompts(self) -> list[Union[str, list[int]]]:
        """The request's prompts as a list (a batch request has several)."""
        return _prompt_list(self.prompt, "prompt")

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = self.common_sampling_kwargs()
        kwargs["max_tokens"] = self.max_tokens
        if self.suffix is not None:
            raise InvalidRequestError("suffix: not supported by this server", field="suffix")
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:
                kwargs["prompt_logprobs"] = self.logprobs
        return kwargs

    def param_for(self, field: str | None) -> str | None:
        if field == "prompt_logprobs" and self.prompt_logprobs is None:
            return "logprobs"  # (echo with logprobs asks for them)
        return super().param_for(field)


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``."""

    model: Optional[str] = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None  # accepted and ignored
    truncate_prompt_tokens: Optional[int] = None  # vLLM's
    pooling: Optional[Literal["last", "mean"]] = None  # ours: this request's pooling (None: the server's)

    def inputs(self) -> list[Union[str, list[int]]]:
        """The texts (or token id lists) to embed."""
        return _prompt_list(self.input, "input")


def _prompt_list(value: Union[str, list[str], list[int], list[list[int]]], field: str) -> list:
    """One prompt (a text or token ids) or a batch of them, as a list."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    if not value:
        raise InvalidRequestError(f"{field}: must not be empty", field=field)
    return list(value)


class TokenizeRequest(_Request):
    """``POST /tokenize``: either ``prompt`` or ``messages``."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    tools: Optional[list[dict[str, Any]]] = None


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoRARequest(_Request):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(_Request):
    lora_name: str = Field(min_length=1)


# ---- responses -----------------------------------------------------------------------------------

class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None


class AssistantMessage(_Response):
    _omit_if_none = ("tool_calls", "reasoning_content", "function_call")
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # with a reasoning parser: the model's thinking
    tool_calls: Optional[list[dict[str, Any]]] = None
    function_call: Optional[dict[str, Any]] = None  # the legacy functions API's one call


class ChatChoice(_Response):
    _omit_if_none = ("stop_reason", "token_ids")
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None  # the stop string or token id that ended it
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ChatCompletionResponse(_Response):
    _omit_if_none = ("prompt_logprobs", "prompt_token_ids")
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None  # vLLM's, when asked
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids


class DeltaMessage(_Response):
    _omit_if_none = ("role", "content", "reasoning_content", "tool_calls", "function_call")
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    function_call: Optional[dict[str, Any]] = None


class ChatChunkChoice(_Response):
    _omit_if_none = ("stop_reason", "token_ids")
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids: the tokens new in this chunk


class ChatCompletionChunk(_Response):
    _omit_if_none = ("usage", "prompt_token_ids")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids: in the first chunk


class CompletionLogprobs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(_Response):
    _omit_if_none = ("prompt_logprobs", "stop_reason", "token_ids", "prompt_token_ids")
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None  # the stop string or token id that ended it
    prompt_logprobs: Optional[list[Optional[dict[str, dict[str, Any]]]]] = None  # vLLM's, when asked
    token_ids: Optional[list[int]] = None  # with return_token_ids (streamed: the tokens new in this chunk)
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids (streamed: in a choice's first chunk)


class CompletionResponse(_Response):
    _omit_if_none = ("usage",)
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: UsageInfo


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "asyncllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
