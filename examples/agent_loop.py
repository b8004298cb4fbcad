"""A tool-using agent loop with the official ``openai`` client against asyncllm's server.

The model asks for a tool, the app runs it and answers with a ``tool`` message, the model
continues, until it answers in words (or ``max_turns`` is reached). Run a server first:
      asyncllm serve PATH/TO/CHECKPOINT          (a Qwen2.5/3, Llama 3.1+ or Mistral instruct model)
      python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1

With a real instruct model, ``--tool-choice auto`` lets the model decide. The test model has
random weights and never decides to call anything, so the first turn defaults to "required":
the grammar then forces a well-formed call whose arguments follow the tool's schema.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 32, "description": "City name"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}]


def get_weather(city: str, unit: str = "celsius") -> dict[str, Any]:
    """The app's side of the tool (a real app would call a weather service)."""
    return {"city": city, "temperature": 21 if unit == "celsius" else 70, "unit": unit, "sky": "clear"}


HANDLERS: dict[str, Callable[..., Any]] = {"get_weather": get_weather}


def run(base_url: str, api_key: str = "none", tool_choice: str = "required", max_turns: int = 3,
        max_tokens: int = 128) -> list[dict[str, Any]]:
    """Run the loop; return the conversation (the last message is the model's final answer)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        model = client.models.list().data[0].id
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."},
            {"role": "user", "content": "What's the weather like in Paris right now?"}]
        for turn in range(max_turns):
            choice = tool_choice if turn == 0 else "auto"
            response = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                                      tool_choice=choice, max_tokens=max_tokens, temperature=0.7,
                                                      seed=turn)
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:  # an answer in words: done
                print(f"[assistant] {message.content!r} ({response.choices[0].finish_reason})")
                break
            for call in message.tool_calls:
                arguments = json.loads(call.function.arguments)
                result = HANDLERS[call.function.name](**arguments)
                print(f"[tool] {call.function.name}({arguments}) -> {result}")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
        return messages
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none")
    parser.add_argument("--tool-choice", default="required", choices=["auto", "required"],
                        help="the first turn's tool_choice (later turns are auto)")
    args = parser.parse_args()
    run(args.base_url, args.api_key, args.tool_choice)


if __name__ == "__main__":
    main()
