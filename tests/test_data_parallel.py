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

from asyncllm.errors import ConfigError
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
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=90)[0]
        except Exception:
            proc.kill()
            raise
    shutil.rmtree(session_dir, ignore_errors=True)
    assert proc.returncode == 0, out[-3000:]
