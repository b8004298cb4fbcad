"""``POST /v1/chat/completions``: whole responses and SSE streams in OpenAI's chunk format."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ..outputs import RequestOutput
from .logprobs import chat_logprobs, prompt_logprobs_json
from .reasoning import ReasoningSplitter, split_reasoning
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, DeltaMessage)
from .serving import (ServerContext, UsageCounter, check_not_aborted, chunk_json, collect, merged, open_streams,
                      parse_body, sse_response)


async def create_chat_completion(ctx: ServerContext, request: Request) -> Response:
    """Validate, submit (one engine request with ``n`` choices) and answer whole or streamed."""
    body = await parse_body(request, ChatCompletionRequest)
    lora = ctx.resolve_model(body.model)
    kwargs = body.sampling_kwargs()  # its own errors already name the request's parameters
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await open_streams(ctx, request, [body.chat_prompt()], kwargs, request_id=request_id, lora=lora,
                                 tools=body.chat_tools(), param_for=body.param_for)
    model = body.model or ctx.model_name
    if body.stream:
        return sse_response(_chunks(ctx, body, request_id, model, streams))
    (output,) = await collect(request, streams)
    # logprobs (prompt logprobs above all) decode a token per entry: work that grows with the prompt,
    # done off the event loop
    return await ctx.json_answer(_response, ctx, body, request_id, model, output)


def _response(ctx: ServerContext, body: ChatCompletionRequest, request_id: str, model: str,
              output: RequestOutput) -> ChatCompletionResponse:
    usage = UsageCounter()
    usage.add(0, output)
    choices = []
    as_ids = bool(body.return_tokens_as_token_ids)
    echoed = body.echoed()
    for c in output.outputs:
        logprobs = None
        if body.logprobs:
            logprobs = chat_logprobs(ctx.llm.tokenizer, c.token_ids, c.logprobs or [], body.top_logprobs or 0, as_ids)
        reasoning, text = split_reasoning(ctx.reasoning_parser, c.text) if ctx.reasoning_parser else (None, c.text)
        message = AssistantMessage(content=echoed + text, reasoning_content=reasoning or None)
        finish_reason = c.finish_reason
        if c.tool_calls and body.legacy_functions:  # the older API's shape: one function_call
            message = AssistantMessage(content=(echoed + text) or None, reasoning_content=reasoning or None,
                                       function_call=c.tool_calls[0].to_openai()["function"])
            finish_reason = "function_call" if finish_reason == "tool_calls" else finish_reason
        elif c.tool_calls:  # as OpenAI: the calls, and content only if the model wrote some besides
            message = AssistantMessage(content=(echoed + text) or None, reasoning_content=reasoning or None,
                                       tool_calls=[t.to_openai() for t in c.tool_calls])
        choices.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                                  stop_reason=c.stop_reason,
                                  token_ids=list(c.token_ids) if body.return_token_ids else None))
    prompt_lps = prompt_logprobs_json(ctx.llm.tokenizer, output.prompt_logprobs, as_ids) \
        if body.prompt_logprobs is not None else None
    response = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage.info())
    response.prompt_logprobs = prompt_lps  # ours, already of the field's shape (validation would hold the GIL)
    if body.return_token_ids:
        response.prompt_token_ids = list(output.prompt_token_ids)
    return response


async def _chunks(ctx: ServerContext, body: ChatCompletionRequest, request_id: str, model: str,
                  streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    """The role chunk of every choice, its content deltas, its finish chunk, then usage if asked."""
    created = int(time.time())

    def chunk(choice: ChatChunkChoice | None, usage=None, prompt_token_ids=None) -> str:
        return chunk_json(ChatCompletionChunk(id=request_id, created=created, model=model,
                                              choices=[choice] if choice else [], usage=usage,
                                              prompt_token_ids=prompt_token_ids), body.include_usage)

    usage = UsageCounter()
    echoed = body.echoed()
    for index in range(body.n):
        yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        if echoed:  # the continued message first, as its own content delta
            yield chunk(ChatChunkChoice(index=index, delta=DeltaMessage(content=echoed)))
    as_ids = bool(body.return_tokens_as_token_ids)
    splitters = {index: ReasoningSplitter(ctx.reasoning_parser) for index in range(body.n)} \
        if ctx.reasoning_parser else None
    prompt_ids_sent = False
    async for position, delta in merged(streams):
        usage.add(position, delta)
        if body.return_token_ids and not prompt_ids_sent:  # the prompt's ids in a chunk of their own, once
            prompt_ids_sent = True
            yield chunk(None, prompt_token_ids=list(delta.prompt_token_ids))
        for c in delta.outputs:
            # with return_token_ids: a delta's tokens ride on its first chunk (on an empty one if the text
            # is held back, by a stop string or a tool call being parsed)
            token_ids = list(c.token_ids) if body.return_token_ids and c.token_ids else None
            logprobs = None
            if body.logprobs and c.token_ids:
                logprobs = chat_logprobs(ctx.llm.tokenizer, c.token_ids, c.logprobs or [], body.top_logprobs or 0,
                                         as_ids)
            reasoning, text = None, c.text
            if splitters is not None:  # thinking streams as reasoning_content deltas, the answer as content
                reasoning, text = splitters[c.index].feed(c.text)
                if c.finish_reason is not None:
                    more_reasoning, more_text = splitters[c.index].finish()
                    reasoning, text = reasoning + more_reasoning, text + more_text
            if reasoning:
                yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(reasoning_content=reasoning),
                                            token_ids=token_ids))
                token_ids = None
            if text or logprobs or token_ids:
                yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(content=text), logprobs=logprobs,
                                            token_ids=token_ids))
            if c.tool_calls and body.legacy_functions:  # {"name", "arguments": ""} first, then argument pieces
                for call in c.tool_calls:
                    yield chunk(ChatChunkChoice(index=c.index,
                                                delta=DeltaMessage(function_call=call.to_openai_delta()["function"])))
            elif c.tool_calls:  # OpenAI's order: a call's index, id and name first, then argument pieces
                calls = [t.to_openai_delta() for t in c.tool_calls]
                yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(tool_calls=calls)))
            if c.finish_reason is not None:
                check_not_aborted(delta)
                finish = "function_call" if body.legacy_functions and c.finish_reason == "tool_calls" \
                    else c.finish_reason
                yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(), finish_reason=finish,
                                            stop_reason=c.stop_reason))
    if body.include_usage:
        yield chunk(None, usage.info())
