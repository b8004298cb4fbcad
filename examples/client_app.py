"""One application, the engine in process or served: only the line that makes ``llm`` changes.

      python examples/client_app.py --model PATH                      (AsyncLLM: the engine in this process)
      asyncllm serve PATH --port 8000 &
      python examples/client_app.py --url http://127.0.0.1:8000       (AsyncLLMClient: the served engine)

Both print the same greedy answers; a bad argument raises the same InvalidRequestError either way.
"""

from __future__ import annotations

import asyncio

from asyncllm import AsyncLLM
from asyncllm.client import AsyncLLMClient
from asyncllm.errors import InvalidRequestError


async def answer_questions(llm, questions: list[str], max_tokens: int = 16) -> dict:
    """The application: stream one answer, generate the others concurrently, then try a bad request."""
    chat = [{"role": "user", "content": questions[0]}]
    print("[stream] ", end="", flush=True)
    streamed = ""
    async for piece in llm.stream(chat, temperature=0, max_tokens=max_tokens):
        streamed += piece
        print(piece, end="", flush=True)
    print()
    outputs = await asyncio.gather(*(llm.generate([{"role": "user", "content": q}], temperature=0,
                                                  max_tokens=max_tokens) for q in questions[1:]))
    for question, out in zip(questions[1:], outputs):
        print(f"[generate] {question!r} -> {out.outputs[0].text!r} ({len(out.outputs[0].token_ids)} tokens)")
    try:
        await llm.generate("x", temperature=-1)
        refused = None
    except InvalidRequestError as exc:
        refused = exc.field
        print(f"[refused] {exc}")
    return {"streamed": streamed, "answers": [out.outputs[0].text for out in outputs],
            "token_ids": [out.outputs[0].token_ids for out in outputs], "refused_field": refused}


async def main_async(args) -> dict:
    questions = ["What is the capital of France?", "Name a colour.", "Say hello."]
    if args.url:
        async with AsyncLLMClient(args.url, api_key=args.api_key) as llm:
            return await answer_questions(llm, questions, args.max_tokens)
    async with AsyncLLM(args.model) as llm:
        return await answer_questions(llm, questions, args.max_tokens)


def main() -> None:
    from asyncllm.toy import example_parser, model_or_demo

    parser = example_parser(__doc__)
    parser.add_argument("--url", help="a served engine (asyncllm serve), e.g. http://127.0.0.1:8000; "
                                      "without it the engine runs in this process")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    if not args.url:
        args.model = model_or_demo(args.model)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
