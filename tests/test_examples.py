"""The examples and the demo run, and do what they say."""

import asyncio
import importlib.util
from pathlib import Path

import httpx
import pytest

from asyncllm import AsyncLLM

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_generate_example(model_dirs):
    outputs = _load("offline_generate").run(str(model_dirs["llama"]))
    assert len(outputs) == 3 and len(outputs[1].outputs) == 2
    assert outputs[2].outputs[0].logprobs is not None


def test_concurrent_streams_example_leaves_engine_empty(model_dirs):
    result = asyncio.run(_load("concurrent_streams").run(str(model_dirs["llama"]), streams=30))
    assert len(result["outcomes"]) == 30 and len(set(result["outcomes"])) > 2
    stats = result["stats"]
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0


def test_starlette_streaming_example(model_dirs):
    example = _load("starlette_streaming")

    async def main():
        llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
        try:
            app = example.build_app(llm)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                response = await client.get("/generate", params={"prompt": "Hello there", "max_tokens": 8})
                expected = await llm.generate("Hello there", max_tokens=8, temperature=0)
                assert response.status_code == 200
                assert response.text == expected.outputs[0].text
                bad = await client.get("/generate", params={"prompt": "Hello", "max_tokens": 0})
                assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]
        finally:
            await llm.aclose()

    asyncio.run(main())


def test_demo_runs_and_reports(model_dirs, capsys):
    from asyncllm.demo import run_demo

    figures = asyncio.run(run_demo(str(model_dirs["llama"]), num_prompts=3, max_tokens=5, chat=False))
    assert figures["output_tokens"] == 15 and figures["tokens_per_s"] > 0
    assert figures["ttft_ms_p50"] > 0
    assert "[2]" in capsys.readouterr().out
    chat = asyncio.run(run_demo(str(model_dirs["llama"]), num_prompts=2, max_tokens=5))  # chat template: questions
    assert 2 <= chat["output_tokens"] <= 10
    assert "capital of France" in capsys.readouterr().out


def test_server_examples_starlette_mount_and_openai_client(model_dirs, capsys):
    from server_helpers import serve_in_thread

    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    try:
        app = _load("server_starlette").build_app(llm)
        with serve_in_thread(app) as url:
            assert httpx.get(f"{url}/").json()["llm"].endswith("/llm/v1/models")
            result = _load("openai_client").run(f"{url}/llm/v1", max_tokens=12)
    finally:
        llm.close()
    assert result["model"] == model_dirs["llama"].name
    assert result["streamed"] == result["chat"] and result["stream_usage"].completion_tokens <= 12
    assert result["completion"].choices[0].finish_reason in ("stop", "length")
    assert "[stream]" in capsys.readouterr().out


def test_server_fastapi_example(model_dirs):
    pytest.importorskip("fastapi")
    example = _load("server_fastapi")

    async def main():
        llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
        try:
            app = example.build_app(llm)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                assert (await client.get("/engine")).json()["num_running"] == 0
                models = (await client.get("/llm/v1/models")).json()
                chat = await client.post("/llm/v1/chat/completions", json={
                    "model": models["data"][0]["id"], "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4})
                assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 4
                bad = await client.post("/llm/v1/chat/completions", json={"messages": "Hi"})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        finally:
            await llm.aclose()

    asyncio.run(main())


def test_example_command_line_defaults_to_the_demo_model_and_takes_a_port(tmp_path):
    from asyncllm.toy import example_parser, parse_example_args

    args = parse_example_args(example_parser("Serve.\n\nMore.", server=True), ["--model", str(tmp_path), "--port", "9"])
    assert (args.model, args.port) == (str(tmp_path), 9)
    parser = example_parser("Run.")
    assert parser.description == "Run." and not hasattr(parser.parse_args([]), "port")


def test_resilient_service_example(model_dirs):
    report = asyncio.run(_load("resilient_service").run(str(model_dirs["llama"])))
    assert report["bad request"].startswith("refused, field 'seed'")
    assert "timeout" in report["deadline"]
    served, overloaded = (int(word) for word in report["burst of 16"].replace(",", "").split() if word.isdigit())
    assert served >= 4 and overloaded >= 1 and served + overloaded == 16
    assert report["engine fault"].startswith("4 streams got EngineDeadError; then 0 running, 0 blocks used")
    assert "next request: 4 tokens" in report["engine fault"]


def test_real_checkpoints_example(model_dirs):
    """On the tests' checkpoint (the example's default, SmolLM2, runs in tests/test_real_model.py's way)."""
    module = _load("real_checkpoints")
    result = asyncio.run(module.run(str(model_dirs["llama"]), quantization="int8", max_tokens=4))
    assert result["int8"] and result["source"] == "directory"
    assert set(result["answers"]) == set(module.QUESTIONS)


def test_smooth_streams_example(model_dirs):
    report = asyncio.run(_load("smooth_streams").run(str(model_dirs["llama"])))
    # without a target a whole 401-token prompt rides beside the decodes; with one, never more
    assert report["target off"]["largest chunk beside decodes"] == 401
    assert 0 < report["target on"]["largest chunk beside decodes"] <= 401
    order = report["finishing order"]
    assert order[0] == "interactive" and sorted(order[1:3]) == ["batch-0", "batch-1"]
    assert order[3] != "(preemptions: 0)"


def test_decoding_example(model_dirs):
    module = _load("decoding")
    result = module.beams_and_best_of(str(model_dirs["llama"]))
    scores = [h.cum_logprob / len(h.logprobs) for h in result["beams"]]  # length_penalty 1: the search's score
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert [c.index for c in result["best_of"]] == [0, 1]
    assert result["best_of"][0].cumulative_logprob >= result["best_of"][1].cumulative_logprob
    spec = asyncio.run(module.speculative_stream(str(model_dirs["llama"])))
    assert spec["text"] == spec["plain"] and spec["stats"]["spec_draft_tokens"] > 0


def test_scaling_example(model_dirs):
    example = _load("scaling")
    result = asyncio.run(example.run(str(model_dirs["llama"]), max_tokens=8))
    assert result["tensor_parallel"] == result["one_process"] and all(result["one_process"])
    pytest.importorskip("ray.serve")
    from ray.serve import Application

    assert isinstance(example.build_ray_app(str(model_dirs["llama"])), Application)


def test_client_app_example_same_answers_in_process_and_served(model_dirs, capsys):
    """examples/client_app.py: the same application on AsyncLLM and on AsyncLLMClient, same answers."""
    from asyncllm.client import AsyncLLMClient
    from asyncllm.server import create_app
    from server_helpers import serve_in_thread

    example = _load("client_app")
    questions = ["What is the capital of France?", "Name a colour.", "Say hello."]
    llm = AsyncLLM(str(model_dirs["llama"]), dtype="float32")
    try:
        in_process = asyncio.run(example.answer_questions(llm, questions, max_tokens=8))
        with serve_in_thread(create_app(llm)) as url:
            async def served():
                async with AsyncLLMClient(url) as client:
                    return await example.answer_questions(client, questions, max_tokens=8)

            over_http = asyncio.run(served())
    finally:
        llm.close()
    assert over_http == in_process and in_process["refused_field"] == "temperature"
    assert all(in_process["token_ids"]) and in_process["streamed"]
    assert "[generate]" in capsys.readouterr().out
