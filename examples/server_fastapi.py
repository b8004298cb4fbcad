"""Mounting the OpenAI-compatible API into a FastAPI app (needs ``pip install fastapi``).

Run:  python examples/server_fastapi.py [--model PATH] [--port 8000]
then: curl http://127.0.0.1:8000/llm/v1/models      (and /docs for the host's own routes)

FastAPI is Starlette underneath, so ``app.mount`` takes the sub-app as it is. The host's lifespan
owns the engine; the sub-app has no lifespan of its own.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from asyncllm.toy import example_parser, parse_example_args


def build_app(llm: AsyncLLM, *, owns_llm: bool = False) -> FastAPI:
    """A FastAPI app with one route of its own and the LLM API under /llm."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if owns_llm:
            await llm.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/engine")
    async def engine_stats() -> dict:
        return llm.stats()

    app.mount("/llm", create_app(llm))
    return app


def main() -> None:
    import uvicorn

    args = parse_example_args(example_parser(__doc__, server=True))
    uvicorn.run(build_app(AsyncLLM(args.model), owns_llm=True), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
