"""Mounting the OpenAI-compatible API into your own Starlette app.

Run:  python examples/server_starlette.py [--model PATH] [--port 8000]
then: curl http://127.0.0.1:8000/llm/v1/models
      curl -N http://127.0.0.1:8000/llm/v1/chat/completions -H 'Content-Type: application/json' \
           -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32, "stream": true}'

The host owns the engine: it creates the AsyncLLM and closes it in its own lifespan (Starlette
does not run a mounted app's lifespan, and the sub-app needs none). Everything the sub-app serves
lives under the prefix: /llm/v1/chat/completions, /llm/health, /llm/metrics, ...
"""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from asyncllm.toy import example_parser, parse_example_args


def build_app(llm: AsyncLLM, *, owns_llm: bool = False, api_key: str | None = None) -> Starlette:
    """The host app: its own routes, plus the LLM API mounted at /llm."""

    async def home(request: Request):
        return JSONResponse({"service": "my-app", "llm": str(request.url_for("llm", path="/v1/models"))})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if owns_llm:
            await llm.aclose()

    return Starlette(routes=[Route("/", home), Mount("/llm", app=create_app(llm, api_key=api_key), name="llm")],
                     lifespan=lifespan)


def main() -> None:
    import uvicorn

    args = parse_example_args(example_parser(__doc__, server=True))
    uvicorn.run(build_app(AsyncLLM(args.model), owns_llm=True), host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
