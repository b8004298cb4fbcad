"""Data-parallel replicas on Ray Serve: the routing policy, and ``asyncllm serve --data-parallel-size 2``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sys
import tempfile

import httpx
import pytest

from asyncllm.client import AsyncLLMClient
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.integrations.ray import REPLICA_HEADER, PrefixAffinity, prompt_text, require_ray
from server_helpers import start_serve

SHARED = ("You are a careful assistant for a shipping company. Answer in one sentence, cite the tariff table "
          "by its number, never invent a price, and say when a question is outside the tariff. " * 3)


def test_requests_sharing_a_prefix_go_to_one_replica_while_it_has_room():
    router = PrefixAffinity(["a", "b"], max_imbalance=2)
    first = router.choose(SHARED + "question one")
    router.started(first)
    for i in range(2):  # same prefix, the replica busier by up to max_imbalance: still there
        name = router.choose(SHARED + f"question {i}")
        assert name == first
        router.started(name)
    # three more in flight there than on the other one: no room, the least busy replica takes it
    other = router.choose(SHARED + "question three")
    assert other != first
    for name in (first, first, first):
        router.finished(name)
    assert router.choose(SHARED + "question four") == first  # room again: back to its prefix cache


def test_unrelated_requests_spread_over_idle_replicas():
    router = PrefixAffinity(["a", "b", "c"])
    picks = []
    for i in range(6):
        name = router.choose(f"short prompt {i}")  # below one block: no affinity, round robin among the idle
        picks.append(name)
    assert set(picks) == {"a", "b", "c"}
    busy = PrefixAffinity(["a", "b"])
    busy.started("a")
    assert busy.choose("x" * 500) == "b"  # no match anywhere: the least busy one


def test_prompt_text_of_each_api():
    assert prompt_text(json.dumps({"prompt": "hello"}).encode()) == "hello"
    assert prompt_text(json.dumps({"prompt": [1, 2]}).encode()) == "1,2,"
    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert "be brief" in prompt_text(json.dumps(chat).encode()) and "hi" in prompt_text(json.dumps(chat).encode())
    assert prompt_text(json.dumps({"instructions": "sys", "input": "q"}).encode()) == "sysq"
    assert prompt_text(b"not json") == "" and prompt_text(b"[1]") == ""


def test_without_ray_the_option_says_how_to_install_it(monkeypatch, llama_dir):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'asyncllm\[ray\]'"):
        require_ray()
    from asyncllm.cli import build_parser
    from asyncllm.server.serve import main

    args = build_parser().parse_args(["serve", str(llama_dir), "--data-parallel-size", "2"])
    with pytest.raises(SystemExit, match=r"asyncllm\[ray\]"):
        main(args)


def test_serve_two_replicas_on_ray(llama_dir):
    """Both replicas answer a burst; requests sharing a long prefix land on one replica, whose
    /metrics counts the prefix-cache hits; streams stream through the router."""
    pytest.importorskip("ray.serve")  # in the test set-up (requirements-dev.txt); an optional extra otherwise
    session_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = dict(os.environ, RAY_ADDRESS="", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=session_dir)
    proc, base = start_serve(str(llama_dir), "--data-parallel-size", "2", "--max-num-seqs", "8",
                             "--kv-cache-memory", str(8 << 20), "--dtype", "float32", env=env, timeout=240)
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=base, timeout=120) as client:
                async def one(i):
                    r = await client.post("/v1/completions", json={"prompt": f"burst {i}", "max_tokens": 24,
                                                                  "temperature": 0, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    return r.headers[REPLICA_HEADER]
                return await asyncio.gather(*(one(i) for i in range(8)))

        assert set(asyncio.run(burst())) == {"engine-0", "engine-1"}
        with httpx.Client(base_url=base, timeout=120) as client:
            served = set()
            for i in range(4):
                r = client.post("/v1/completions", json={"prompt": SHARED + f"question {i}", "max_tokens": 4,
                                                         "temperature": 0})
                assert r.status_code == 200, r.text
                served.add(r.headers[REPLICA_HEADER])
            assert len(served) == 1
            (replica,) = served
            metrics = client.get("/metrics", headers={REPLICA_HEADER: replica})
            assert metrics.headers[REPLICA_HEADER] == replica
            hits = re.search(r"^asyncllm:prefix_cache_hits_total(?:{[^}]*})? (\S+)$", metrics.text, re.M)
            assert hits and float(hits.group(1)) > 0, metrics.text[:2000]
            with client.stream("POST", "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and len(lines) > 2
            bad = client.get("/v1/models", headers={REPLICA_HEADER: "engine-9"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == REPLICA_HEADER

        async def through_the_client():  # AsyncLLM's API against the replicas (docs/client.md)
            async with AsyncLLMClient(base) as llm:
                first = await llm.generate("client", max_tokens=6, temperature=0, ignore_eos=True)
                pieces = [p async for p in llm.stream("client", max_tokens=6, temperature=0, ignore_eos=True)]
                with pytest.raises(InvalidRequestError):
                    await llm.generate("client", max_tokens=10**6)
                return first, "".join(pieces), await llm.stats()

        first, streamed, stats = asyncio.run(through_the_client())
        assert len(first.outputs[0].token_ids) == 6 and streamed == first.outputs[0].text
        assert "kv_blocks_total" in stats
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=90)[0]
        except Exception:
            proc.kill()
            raise
    shutil.rmtree(session_dir, ignore_errors=True)
    assert proc.returncode == 0, out[-3000:]


class _FakeHandle:
    """A stand-in for a Ray Serve deployment handle: ``options(stream=True).handle.remote(...)``."""

    def __init__(self, events=None, error=None):
        self.events, self.error, self.calls = events or [], error, []

    def options(self, stream):
        assert stream is True
        return self

    @property
    def handle(self):
        return self

    def remote(self, *args):
        self.calls.append(args)

        async def gen():
            if self.error is not None:
                raise self.error
            for event in self.events:
                yield event
        return gen()


def _router_call(router, body: bytes, headers: dict | None = None):
    from starlette.requests import Request

    async def main():
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                 "headers": [(k.encode(), v.encode()) for k, v in (headers or {}).items()]}
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        response = await router(Request(scope, receive))
        chunks = [chunk async for chunk in response.body_iterator] if hasattr(response, "body_iterator") else []
        return response, b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks)

    return asyncio.run(main())


def test_router_streams_the_replica_answer_and_names_it():
    from asyncllm.integrations.ray import Router

    ok = _FakeHandle([("start", 200, [("content-type", "text/event-stream"), ("content-length", "9")]),
                      ("body", b"data: 1\n\n"), ("body", b"data: [DONE]\n\n")])
    router = Router(ok, names=["engine-0"])
    response, body = _router_call(router, json.dumps({"prompt": "hi"}).encode())
    assert response.status_code == 200 and body == b"data: 1\n\ndata: [DONE]\n\n"
    headers = dict(response.headers)
    assert headers[REPLICA_HEADER] == "engine-0" and "content-length" not in headers
    assert router.affinity.in_flight == {"engine-0": 0}  # the request is over: counted out again
    assert ok.calls[0][1] == "/v1/completions"


def test_a_failing_replica_is_a_503_in_openai_shape():
    from asyncllm.integrations.ray import Router

    router = Router(_FakeHandle(error=RuntimeError("actor died")), names=["engine-0"])
    response, _ = _router_call(router, b"{}")
    assert response.status_code == 503 and response.headers[REPLICA_HEADER] == "engine-0"
    error = json.loads(response.body)["error"]
    assert error["type"] == "server_error" and "actor died" in error["message"]
    assert router.affinity.in_flight == {"engine-0": 0}


def test_call_asgi_streams_and_closing_early_disconnects(llama_dir):
    """A replica runs the app in-process: SSE events arrive one by one, and a client that goes away
    (the generator closed early) ends the app's request, leaving the engine empty."""
    from asyncllm import AsyncLLM
    from asyncllm.integrations.ray import call_asgi
    from asyncllm.server.app import create_app

    async def main():
        async with AsyncLLM(str(llama_dir), dtype="float32") as llm:
            app = create_app(llm)
            aborted, abort = [], llm.engine.abort_request
            llm.engine.abort_request = lambda request_id: (aborted.append(request_id), abort(request_id))
            body = json.dumps({"prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}).encode()
            events = call_asgi(app, "POST", "/v1/completions", "", [("content-type", "application/json")], body)
            kind, status, headers = await events.__anext__()
            assert (kind, status) == ("start", 200)
            assert dict(headers)["content-type"].startswith("text/event-stream")
            kind, chunk = await events.__anext__()
            assert kind == "body" and chunk.startswith(b"data: ")
            await events.aclose()  # the client left mid-stream
            for _ in range(100):
                if aborted and llm.stats()["num_running"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert aborted  # the 400-token request was aborted, not left to finish
            assert llm.stats()["num_running"] == 0 and llm.stats()["kv_blocks_used"] == 0

    asyncio.run(main())


def test_router_refuses_a_body_past_the_limit_before_reading_it_whole():
    from asyncllm.integrations.ray import Router

    replica = _FakeHandle([("start", 200, []), ("body", b"{}")])
    router = Router(replica, names=["engine-0"], max_body_bytes=1024)
    response, _ = _router_call(router, b'{"prompt": "' + b"x" * 4096 + b'"}')
    assert response.status_code == 413 and json.loads(response.body)["error"]["code"] == "request_too_large"
    assert replica.calls == [] and router.affinity.in_flight == {"engine-0": 0}
    # a big body within the limit is parsed off the loop and still routed
    router = Router(replica, names=["engine-0"], max_body_bytes=1 << 20)
    response, body = _router_call(router, json.dumps({"prompt": "y" * 200_000}).encode())
    assert response.status_code == 200 and body == b"{}"


def test_affinity_hashes_only_the_head_of_a_prompt():
    from asyncllm.integrations.ray import AFFINITY_MAX_CHARS

    router = PrefixAffinity(["a"])
    assert len(router.block_hashes("z" * (10 * AFFINITY_MAX_CHARS))) == AFFINITY_MAX_CHARS // router.block_chars


def test_replica_options_without_replicas_are_a_usage_error(llama_dir):
    from asyncllm.cli import build_parser
    from asyncllm.server.serve import main

    args = build_parser().parse_args(["serve", str(llama_dir), "--ray-address", "auto"])
    with pytest.raises(SystemExit, match="--data-parallel-size"):
        main(args)
