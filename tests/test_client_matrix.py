"""Agent frameworks against the app over real HTTP: the OpenAI Agents SDK on its default model (the
Responses API) completes a tool loop, and LangChain's ChatOpenAI with ``use_responses_api=True``
answers, whole and streamed (docs/server.md, "Clients known to work")."""

from __future__ import annotations

import os
from typing import Literal

import pytest
from pydantic import BaseModel

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from server_helpers import serve_in_thread

os.environ.setdefault("LANGSMITH_TRACING", "false")
os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


@pytest.fixture(scope="module")
def server(model_dir_factory):
    # tool definitions and the agent's instructions need a longer context than the default test model's
    llm = AsyncLLM(str(model_dir_factory("llama", max_position_embeddings=2048)), dtype="float32")
    app = create_app(llm)
    with serve_in_thread(app) as url:
        yield llm, app.state.asyncllm.model_name, url
    llm.close()


class Report(BaseModel):
    city: Literal["Paris", "Rome"]
    sky: Literal["sunny", "rainy"]


def test_agents_sdk_agent_completes_a_tool_loop(server):
    """The agent asks the model (Responses API, streamed: the SDK's default), the model calls the tool
    (tool_choice "required": a random model would not choose to), the SDK runs it and sends its output
    back as a function_call_output item, and the model's final answer parses as the agent's output type."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    llm, model, url = server
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather forecast for a city."""
        calls.append(city)
        return f"22 C and sunny in {city}"

    agents.set_default_openai_client(AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
                                     use_for_tracing=False)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         output_type=Report,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=300, temperature=0))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert len(calls) == 1 and isinstance(result.final_output, Report)
    assert llm.stats()["kv_blocks_used"] == 0


def test_langchain_chat_openai_on_the_responses_api(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm, model, url = server
    kwargs = dict(model=model, base_url=f"{url}/v1", api_key="unused", max_tokens=8, temperature=0, max_retries=0)
    responses = langchain_openai.ChatOpenAI(use_responses_api=True, **kwargs)
    message = responses.invoke("Tell me about the cat")
    text = message.content[0]["text"] if isinstance(message.content, list) else message.content
    chat = langchain_openai.ChatOpenAI(**kwargs).invoke("Tell me about the cat")
    assert text == chat.content  # the same answer through the Responses API and chat completions
    streamed = "".join(part["text"] for chunk in responses.stream("Tell me about the cat")
                       for part in (chunk.content if isinstance(chunk.content, list) else [])
                       if isinstance(part, dict) and part.get("type") == "text")
    assert streamed == text
