"""Talking to the server with the official ``openai`` client: chat, streaming, completions.

Run a server first (``asyncllm serve PATH`` or ``python examples/server_starlette.py``), then:
      python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
      python examples/openai_client.py --base-url http://127.0.0.1:8000/llm/v1     (the mounted example)

The model name is the checkpoint directory's name unless the server was given another; this
script asks the server (``GET /v1/models``) instead of guessing.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def run(base_url: str, api_key: str = "none", max_tokens: int = 24) -> dict:
    """One chat completion, the same one streamed, and a text completion; returns what came back."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Write one sentence about a cat."}]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        print(f"[chat] {chat.choices[0].message.content!r} ({chat.usage.completion_tokens} tokens)")

        streamed = ""
        print("[stream] ", end="", flush=True)
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                streamed += chunk.choices[0].delta.content
                print(chunk.choices[0].delta.content, end="", flush=True)
            usage = chunk.usage or usage
        print()

        completion = client.completions.create(model=model, prompt="The old man", max_tokens=max_tokens,
                                               temperature=0.8, seed=7, stop=["."])
        print(f"[completion] {completion.choices[0].text!r} ({completion.choices[0].finish_reason})")
        return {"model": model, "chat": chat.choices[0].message.content, "streamed": streamed,
                "stream_usage": usage, "completion": completion}
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    args = parser.parse_args()
    run(args.base_url, args.api_key)


if __name__ == "__main__":
    main()
