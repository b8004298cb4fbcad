"""``POST /v1/completions``: text prompts (one or a batch), ``echo`` and legacy logprobs."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from ..outputs import CompletionOutput, RequestOutput
from .logprobs import CompletionLogprobsBuilder, prompt_logprobs_json
from .protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from .serving import (ServerContext, UsageCounter, check_not_aborted, chunk_json, collect, merged, open_streams,
                      parse_body, sse_response)


async def create_completion(ctx: ServerContext, request: Request) -> Response:
    """Validate, submit one engine request per prompt, and answer whole or streamed.

    Choice ``i`` of prompt ``p`` has index ``p * n + i``, as in OpenAI's batch completions.
    """
    body = await parse_body(request, CompletionRequest)
    lora = ctx.resolve_model(body.model)
    kwargs = body.sampling_kwargs()
    prompts = body.prompts()
    ctx.check_batch(len(prompts), "prompt", body.n)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await open_streams(ctx, request, prompts, kwargs, request_id=request_id, lora=lora,
                                 tools=None, param_for=body.param_for)
    model = body.model or ctx.model_name
    if body.stream:
        return sse_response(_chunks(ctx, body, request_id, model, streams))
    outputs = await collect(request, streams)
    # logprobs (prompt logprobs above all) decode a token per entry: work that grows with the prompt,
    # done off the event loop
    return await ctx.json_answer(_response, ctx, body, request_id, model, outputs)


class _Choice:
    """Turns one choice's deltas into (text, logprobs), echoing the prompt first if asked."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest) -> None:
        self.tokenizer = ctx.llm.tokenizer
        self.echo = body.echo
        as_ids = bool(body.return_tokens_as_token_ids)
        self.logprobs = CompletionLogprobsBuilder(self.tokenizer, body.logprobs, as_ids) \
            if body.logprobs is not None else None
        self.started = False

    def render(self, output: RequestOutput, c: CompletionOutput) -> tuple[str, CompletionLogprobs | None]:
        text, token_ids, entries = c.text, list(c.token_ids), list(c.logprobs or [])
        if self.echo and not self.started:
            prompt = output.prompt if output.prompt is not None else self.tokenizer.decode(output.prompt_token_ids)
            text = prompt + text
            prompt_lps = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            token_ids, entries = list(output.prompt_token_ids) + token_ids, list(prompt_lps) + entries
        self.started = True
        if self.logprobs is None or not token_ids:
            return text, None
        return text, self.logprobs.build(token_ids, entries)


def _response(ctx: ServerContext, body: CompletionRequest, request_id: str, model: str,
              outputs: list[RequestOutput]) -> CompletionResponse:
    usage = UsageCounter()
    choices = []
    for position, output in enumerate(outputs):
        usage.add(position, output)
        prompt_lps = None  # the prompt's, shared by its n choices (built once: it grows with the prompt)
        if body.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_json(ctx.llm.tokenizer, output.prompt_logprobs,
                                              bool(body.return_tokens_as_token_ids))
        for c in output.outputs:
            text, logprobs = _Choice(ctx, body).render(output, c)
            choice = CompletionChoice(index=position * body.n + c.index, text=text, logprobs=logprobs,
                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            if body.return_token_ids:
                choice.token_ids, choice.prompt_token_ids = list(c.token_ids), list(output.prompt_token_ids)
            # ours, already of the field's shape: validating 2,000 x 21 entries would hold the GIL ~50 ms
            choice.prompt_logprobs = prompt_lps
            choices.append(choice)
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage.info())


async def _chunks(ctx: ServerContext, body: CompletionRequest, request_id: str, model: str,
                  streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choice: CompletionChoice | None, usage=None) -> str:
        return chunk_json(CompletionResponse(id=request_id, created=created, model=model,
                                             choices=[choice] if choice else [], usage=usage), body.include_usage)

    usage = UsageCounter()
    choices: dict[int, _Choice] = {}
    async for position, delta in merged(streams):
        usage.add(position, delta)
        for c in delta.outputs:
            index = position * body.n + c.index
            first = index not in choices
            text, logprobs = choices.setdefault(index, _Choice(ctx, body)).render(delta, c)
            piece = CompletionChoice(index=index, text=text, logprobs=logprobs)
            if body.return_token_ids:  # every token in some chunk, the prompt's in the choice's first
                piece.token_ids = list(c.token_ids) or None
                piece.prompt_token_ids = list(delta.prompt_token_ids) if first else None
            if text or logprobs or piece.token_ids or piece.prompt_token_ids:
                yield chunk(piece)
            if c.finish_reason is not None:
                check_not_aborted(delta)
                yield chunk(CompletionChoice(index=index, text="", finish_reason=c.finish_reason,
                                             stop_reason=c.stop_reason))
    if body.include_usage:
        yield chunk(None, usage.info())
