"""``POST /v1/responses`` through the openai SDK: plain, streamed, a function tool loop with
previous_response_id, structured output, errors."""

import json

import openai
import pytest

from asyncllm import AsyncLLM
from asyncllm.server import create_app
from server_helpers import assert_error, request, serve_in_thread

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def served(model_dir_factory):
    # tools in the prompt need a longer context than the default test model's
    llm = AsyncLLM(str(model_dir_factory("llama", max_position_embeddings=2048)), dtype="float32")
    app = create_app(llm)
    with serve_in_thread(app) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield llm, app, client
    llm.close()


def test_plain_response_equals_the_chat_answer(served):
    llm, app, client = served
    name = app.state.asyncllm.model_name
    response = client.responses.create(model=name, input="Tell me about the cat", max_output_tokens=12,
                                       temperature=0)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Tell me about the cat"}],
                                          max_tokens=12, temperature=0)
    assert response.output_text == chat.choices[0].message.content
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    with_instructions = client.responses.create(model=name, input="Tell me about the cat", max_output_tokens=2,
                                                instructions="You are terse.", temperature=0)
    assert with_instructions.usage.input_tokens > response.usage.input_tokens


def test_streamed_response_events(served):
    llm, app, client = served
    name = app.state.asyncllm.model_name
    events = list(client.responses.create(model=name, input="Tell me about the dog", max_output_tokens=10,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and text == next(e.text for e in events if e.type == "response.output_text.done")
    final = events[-1].response
    assert final.output_text == text
    whole = client.responses.create(model=name, input="Tell me about the dog", max_output_tokens=10, temperature=0)
    assert whole.output_text == text


def test_function_tool_loop_with_previous_response_id(served):
    llm, app, client = served
    name = app.state.asyncllm.model_name
    first = client.responses.create(model=name, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=80, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    second = client.responses.create(model=name, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "22 C, sunny"}],
                                     max_output_tokens=6, temperature=0)
    # the stored conversation (question, call) came back with the tool's answer
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id
    streamed = list(client.responses.create(model=name, input="Weather in Paris?", tools=[WEATHER],
                                            tool_choice="required", max_output_tokens=80, temperature=0,
                                            stream=True))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments
    done = [e for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done and done[0].item.arguments == calls[0].arguments


def test_structured_output_and_errors(served):
    llm, app, client = served
    name = app.state.asyncllm.model_name
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(model=name, input="Is it raining?", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert json.loads(response.output_text)["answer"] in ("yes", "no")
    assert_error(request(app, "POST", "/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"}),
                 400, "previous_response_id")
    assert_error(request(app, "POST", "/v1/responses", json={"input": []}), 400, "input")
    assert_error(request(app, "POST", "/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}]}),
                 400, "tools")
    assert_error(request(app, "POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 0}), 400,
                 "max_output_tokens")
