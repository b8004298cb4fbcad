"""``POST /v1/embeddings``: one vector per input, through the engine's own forward pass."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ..errors import AsyncLLMError, InvalidRequestError
from .errors import from_engine_error
from .protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from .serving import PRIME_GROUP, ServerContext, parse_body, until_disconnect


async def create_embeddings(ctx: ServerContext, request: Request) -> Response:
    """Every input embedded concurrently (they batch in the engine); float lists or base64."""
    body = await parse_body(request, EmbeddingRequest)
    lora = ctx.resolve_model(body.model)
    inputs = body.inputs()
    ctx.check_batch(len(inputs), "input")
    width = ctx.llm.engine.runner.shape.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise InvalidRequestError(f"dimensions: this model's embeddings have {width} dimensions "
                                  f"(no shortening), got {body.dimensions}", field="dimensions")
    request_id = f"embd-{uuid.uuid4().hex}"
    # each distinct input is computed once: identical inputs get identical vectors (the same input in
    # two batch rows could differ in the last bit, float sums depending on the batch's shape)
    distinct: dict[str, int] = {}
    keys = [json.dumps(item) for item in inputs]
    for key in keys:
        distinct.setdefault(key, len(distinct))
    unique = [json.loads(key) for key in distinct]
    tasks: list[asyncio.Future] = []

    async def submit_all() -> list:
        for i, item in enumerate(unique):
            tasks.append(asyncio.ensure_future(ctx.llm.encode(
                item, pooling=body.pooling or ctx.pooling, lora=lora, request_id=f"{request_id}-{i}",
                truncate_prompt_tokens=body.truncate_prompt_tokens)))
            if i % PRIME_GROUP == PRIME_GROUP - 1:
                await asyncio.sleep(0)  # a big batch's submissions are spread over turns of the loop
        return await asyncio.gather(*tasks)

    try:
        computed = await until_disconnect(request, submit_all())
    except BaseException as exc:  # one refused (or the client left): the others are aborted, not left running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(exc, AsyncLLMError):
            raise from_engine_error(exc, lambda field: "input" if field == "prompt" else field) from None
        raise
    # built in the response threads (serving.json_bytes writes 2,048 vectors one at a time)
    return await ctx.json_answer(_response, body, ctx.model_name, [computed[distinct[key]] for key in keys])


def _response(body: EmbeddingRequest, model_name: str, outputs: list) -> EmbeddingResponse:
    data = [EmbeddingData(index=i, embedding=_encode(out.embedding, body.encoding_format))
            for i, out in enumerate(outputs)]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return EmbeddingResponse(data=data, model=body.model or model_name,
                             usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a list of floats, or the little-endian float32 bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
