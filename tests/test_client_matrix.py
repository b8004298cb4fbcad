"""Client libraries against the app over real HTTP (docs/server.md, "Clients known to work"): the OpenAI
Agents SDK on its default model (the Responses API) completes a tool loop, and LangChain's ChatOpenAI with
``use_responses_api=True`` answers, whole and streamed. Then a forced tool call whose arguments are a nested
pydantic model (``$defs``/``$ref`` in the schema, as pydantic writes it) through each library's own way of
asking for one over chat completions: the openai SDK's ``parse`` with ``pydantic_function_tool``, the Agents
SDK's ``OpenAIChatCompletionsModel`` (a required tool and an ``output_type``), LangChain's ``bind_tools`` and
``with_structured_output``, and pydantic-ai's tool output. The weights are random: the call grammar alone makes
the arguments validate."""

from __future__ import annotations

import os
from typing import Literal

import pytest
from pydantic import BaseModel, Field

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


class Stop(BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    nights: int = Field(ge=1, le=9)


class Trip(BaseModel):
    """Plan a trip."""
    traveller: str = Field(max_length=8)  # bounded: the random model's strings would run on
    stops: list[Stop] = Field(min_length=1, max_length=2)  # a list of another model: "$ref": "#/$defs/Stop"


PLAN = [{"role": "user", "content": "Plan a trip"}]
MAX_TOKENS = 300  # a Trip's arguments take ~110 tokens of the tiny tokenizer


def test_openai_sdk_parses_a_nested_pydantic_tool(server):
    """``chat.completions.parse`` (and its stream helper) with ``openai.pydantic_function_tool``: a strict tool
    whose parameters keep pydantic's ``$defs``, forced by name; the SDK parses the arguments into the model."""
    import openai

    llm, model, url = server
    tool = openai.pydantic_function_tool(Trip)
    assert "$defs" in tool["function"]["parameters"]  # what the grammar must resolve
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=model, messages=PLAN, tools=[tool], max_tokens=MAX_TOKENS, temperature=0,
                  tool_choice={"type": "function", "function": {"name": "Trip"}})
    choice = client.chat.completions.parse(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "Trip" and isinstance(call.function.parsed_arguments, Trip)
    assert Trip.model_validate_json(call.function.arguments) == call.function.parsed_arguments
    with client.chat.completions.stream(**kwargs) as stream:
        (streamed,) = stream.get_final_completion().choices[0].message.tool_calls
    assert streamed.function.name == "Trip" and streamed.function.parsed_arguments == call.function.parsed_arguments
    assert llm.stats()["kv_blocks_used"] == 0


def test_agents_sdk_output_type_with_a_required_nested_tool_on_chat_completions(server):
    """The Agents SDK over chat completions (``OpenAIChatCompletionsModel``): turn one sends tool_choice
    "required" (one call: parallel_tool_calls off) beside the output type's response_format, and must answer
    with a call whose arguments (a Trip, under ``$defs`` beside the SDK's own wrapper) validate; the SDK runs
    the tool, resets tool_choice (its default, as in the Responses test above) and the second turn's answer
    (tools offered, tool_choice unset: the response_format's grammar holds) parses as the output type."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    llm, model, url = server
    trips: list[Trip] = []

    @agents.function_tool
    def plan_trip(trip: Trip) -> str:
        """Book the stops of a trip."""
        trips.append(trip)
        return f"booked {len(trip.stops)} stops"

    agents.set_tracing_disabled(True)
    chat_model = agents.OpenAIChatCompletionsModel(
        model=model, openai_client=AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="planner", instructions="Plan the trip, then report.", tools=[plan_trip],
                         model=chat_model, output_type=Report,
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             max_tokens=MAX_TOKENS, temperature=0))
    result = agents.Runner.run_sync(agent, "Trip to Paris", max_turns=4)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert result.new_items[0].raw_item.name == "plan_trip"
    assert len(trips) == 1 and isinstance(trips[0], Trip) and trips[0].stops
    assert result.new_items[1].output == f"booked {len(trips[0].stops)} stops"
    assert isinstance(result.final_output, Report)
    assert llm.stats()["kv_blocks_used"] == 0


def test_langchain_chat_openai_forces_a_nested_tool(server):
    """ChatOpenAI on chat completions: ``with_structured_output(method="function_calling")`` (LangChain inlines
    the ``$defs``, and forces the tool by name) gives a Trip; ``bind_tools`` passes an OpenAI tool dict that
    keeps them as is, and its call's args validate as one too."""
    langchain_openai = pytest.importorskip("langchain_openai")
    import openai

    llm, model, url = server
    chat = langchain_openai.ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", max_tokens=MAX_TOKENS,
                                       temperature=0, max_retries=0, use_responses_api=False)
    trip = chat.with_structured_output(Trip, method="function_calling").invoke("Plan a trip")
    assert isinstance(trip, Trip) and trip.stops
    message = chat.bind_tools([openai.pydantic_function_tool(Trip)], tool_choice="Trip").invoke("Plan a trip")
    (call,) = message.tool_calls
    assert call["name"] == "Trip" and not message.invalid_tool_calls
    assert isinstance(Trip.model_validate(call["args"]), Trip)


def test_pydantic_ai_tool_output_is_a_nested_model(server):
    """pydantic-ai's OpenAIChatModel with ``ToolOutput(Trip)``: its output tool (strict, ``$defs`` kept) is the
    only tool, so it sends tool_choice "required" (one call: parallel_tool_calls off); the call ends the run
    and its arguments are the output."""
    pytest.importorskip("pydantic_ai")
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    llm, model, url = server
    provider = OpenAIProvider(openai_client=AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    agent = Agent(OpenAIChatModel(model, provider=provider), output_type=ToolOutput(Trip, name="plan_trip"),
                  model_settings={"max_tokens": MAX_TOKENS, "temperature": 0, "parallel_tool_calls": False})
    result = agent.run_sync("Plan a trip")
    assert isinstance(result.output, Trip) and result.output.stops
    calls = [part for message in result.all_messages() if isinstance(message, ModelResponse)
             for part in message.parts if isinstance(part, ToolCallPart)]
    assert [call.tool_name for call in calls] == ["plan_trip"]
    assert Trip.model_validate_json(calls[0].args_as_json_str()) == result.output
    assert llm.stats()["kv_blocks_used"] == 0
