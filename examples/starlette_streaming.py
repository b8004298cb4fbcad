"""Streaming tokens from inside a Starlette (or FastAPI) handler.

Run:  python examples/starlette_streaming.py [--model PATH] [--port 8000]
then: curl -N 'http://127.0.0.1:8000/generate?prompt=Hello&max_tokens=32'

The host application owns the AsyncLLM (created in its lifespan, closed on shutdown). A client that
disconnects mid-stream cancels the response's generator, which aborts the request and frees its
KV blocks at once.
"""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asyncllm import AsyncLLM
from asyncllm.errors import InvalidRequestError
from asyncllm.toy import example_parser, parse_example_args


def build_app(llm: AsyncLLM, *, owns_llm: bool = False) -> Starlette:
    """A small app with one streaming route; ``owns_llm`` closes the engine on shutdown."""

    async def generate(request: Request):
        prompt = request.query_params.get("prompt", "")
        try:
            max_tokens = int(request.query_params.get("max_tokens", "32"))
            stream = llm.stream(prompt, max_tokens=max_tokens, temperature=0)
            first = await stream.__anext__()  # surfaces bad input as a 400 before the body starts
        except (InvalidRequestError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except StopAsyncIteration:
            first, stream = "", None

        async def body():
            yield first
            if stream is not None:
                async for piece in stream:
                    yield piece

        return StreamingResponse(body(), media_type="text/plain; charset=utf-8")

    async def stats(request: Request):
        return JSONResponse(llm.stats())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owns_llm:
            await llm.aclose()

    return Starlette(routes=[Route("/generate", generate), Route("/stats", stats)], lifespan=lifespan)


def main() -> None:
    import uvicorn

    args = parse_example_args(example_parser(__doc__, server=True))
    uvicorn.run(build_app(AsyncLLM(args.model), owns_llm=True), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
