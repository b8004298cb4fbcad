"""W-SOAK: thousands of mixed requests with random disconnects against ``asyncllm serve``, over loopback.

    python -m benchmarks.w_soak [--requests 4000] [--concurrency 16] [--json out.json] [--no-probe]

Phase 1 (soak): one ``asyncllm serve`` process on 127.0.0.1 with the demo model; a bounded
client sends a mix of chat (whole and streamed), text completions, /tokenize and deliberately bad
requests, and leaves one streamed request in ten after a few events. The first requests go one at a
time, the rest ``--concurrency`` at once. The server's resident memory
(``/proc/PID/status``) is sampled every ``--sample-every`` requests. Reported: errors (anything but
the expected status, deliberate disconnects aside), RSS over time, and RSS growth per 10k requests
after warm-up (the first fifth of the requests).

Phase 2 (probe): a server whose model accepts a million-token context and 8 MiB bodies; four
streams run while one 5 MB chat message arrives. Reported: /health latency while that message is
processed, and the streams' inter-token gaps before and during it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.measure import loadavg, machine_record, percentile, utc_now, write_report

SIZES = {"full": [], "quick": ["--requests", "1000"], "tiny": ["--requests", "60", "--no-probe"]}
CHAT = [{"role": "user", "content": "Tell me about the cat and the old man by the sea."}]
LONG_CONTEXT = 1 << 20


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@contextlib.contextmanager
def serve(model_dir: str, *extra: str):
    """``asyncllm serve`` in a child process; yields (base URL, pid)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncllm.cli", "serve", model_dir, "--port", str(port),
                             "--dtype", "float32", "--model-name", "soak", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---- phase 1: the soak ------------------------------------------------------------------------------

KINDS = ("chat", "chat_stream", "completion", "tokenize", "bad")
WEIGHTS = (30, 35, 20, 10, 5)


async def one_request(client: httpx.AsyncClient, rng: random.Random, tally: dict) -> None:
    kind = rng.choices(KINDS, WEIGHTS)[0]
    max_tokens = rng.randint(1, 24)
    try:
        if kind == "chat":
            r = await client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": max_tokens,
                                                                 "temperature": rng.choice([0, 0.8])})
            ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        elif kind == "completion":
            r = await client.post("/v1/completions", json={"prompt": "Once upon a time", "n": rng.randint(1, 3),
                                                           "max_tokens": max_tokens, "seed": rng.randint(0, 2**63)})
            ok = r.status_code == 200 and len(r.json()["choices"]) >= 1
        elif kind == "tokenize":
            r = await client.post("/tokenize", json={"messages": CHAT})
            ok = r.status_code == 200 and r.json()["count"] > 0
        elif kind == "bad":
            body = rng.choice([{"prompt": "x", "seed": 2**64}, {"prompt": "x", "n": 10**6},
                               {"messages": [{"role": 5}]}, {"prompt": "x", "max_tokens": 10**12}])
            r = await client.post("/v1/completions" if "prompt" in body else "/v1/chat/completions", json=body)
            ok = r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        else:
            leave_after = rng.randint(1, 4) if rng.random() < 0.1 else None
            body = {"messages": CHAT, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                events = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if leave_after is not None and len(events) >= leave_after:
                            break  # the deliberate disconnect: the connection is closed mid-stream
            if leave_after is not None and (not events or events[-1] != "[DONE]"):
                tally["disconnects"] += 1
                ok = True
            else:
                ok = r.status_code == 200 and events[-1] == "[DONE]" and '"error"' not in "".join(events)
    except httpx.HTTPError as exc:
        ok = False
        tally.setdefault("error_samples", []).append(f"{kind}: {type(exc).__name__}: {exc}"[:200])
    tally[kind] += 1
    if not ok:
        tally["errors"] += 1
        if kind != "chat_stream" and "r" in locals():
            tally.setdefault("error_samples", []).append(f"{kind}: {r.status_code} {r.text[:160]}")


async def soak(base: str, pid: int, requests: int, concurrency: int, sample_every: int, seed: int) -> dict:
    rng = random.Random(seed)
    tally = {kind: 0 for kind in KINDS} | {"errors": 0, "disconnects": 0}
    samples = [(0, rss_kb(pid))]
    started = done = 0
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
        async def worker() -> None:
            nonlocal started, done
            while started < requests:
                started += 1
                await one_request(client, rng, tally)
                done += 1
                if done % sample_every == 0:
                    samples.append((done, rss_kb(pid)))
                    print(f"\r[w-soak] {done}/{requests} requests, RSS {samples[-1][1] / 1024:.0f} MiB, "
                          f"errors {tally['errors']}", end="", file=sys.stderr, flush=True)

        # warm-up starts with requests one at a time: single-sequence steps (decode-attention work
        # splits, kernel scratch) reach their high-water marks now, not when the load tails off
        for _ in range(min(50, requests // 10)):
            started += 1
            await one_request(client, rng, tally)
            done += 1
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        health = await client.get("/health")
        metrics = (await client.get("/metrics")).text
    print(file=sys.stderr)
    elapsed = time.perf_counter() - start
    samples.append((done, rss_kb(pid)))
    # steady state: from the end of warm-up (a fifth of the requests) to 90% of them. The last
    # tenth is left out because the server's RSS steps up once, by ~15 MiB, as the load tails off;
    # the step is the same after 400 or 10,000 requests (it does not grow with them) and is
    # reported on its own (``rss_after_load_mib``).
    warm = [s for s in samples if requests // 5 <= s[0] <= requests * 9 // 10]
    base_rss, end_rss = warm[0][1], warm[-1][1]
    span = max(1, warm[-1][0] - warm[0][0])
    growth = (end_rss - base_rss) / base_rss * 100 * (10_000 / span)
    return {
        "requests": done, "concurrency": concurrency, "seconds": round(elapsed, 1),
        "requests_per_s": round(done / elapsed, 1), "by_kind": {k: tally[k] for k in KINDS},
        "errors": tally["errors"], "error_samples": tally.get("error_samples", [])[:10],
        "deliberate_disconnects": tally["disconnects"],
        "rss_mib": [[n, round(kb / 1024, 1)] for n, kb in samples],
        "rss_after_warmup_mib": round(base_rss / 1024, 1), "rss_end_mib": round(end_rss / 1024, 1),
        "rss_window_requests": [warm[0][0], warm[-1][0]],
        "rss_growth_pct_per_10k_requests": round(growth, 2),
        "rss_after_load_mib": round(samples[-1][1] / 1024, 1),
        "health_after": health.status_code,
        "kv_usage_after": _metric(metrics, "asyncllm:kv_cache_usage_perc"),
        "running_after": _metric(metrics, "asyncllm:num_requests_running"),
    }


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


# ---- phase 2: /health and other streams while a 5 MB message is processed ----------------------------

def build_long_context_model() -> Path:
    """The toy Llama with a million-token context (random weights), built once into the cache."""
    from asyncllm.toy.checkpoints import build_checkpoint, default_demo_dir

    out = default_demo_dir().parent / "soak-long-llama"
    if not (out / ".complete").exists():
        build_checkpoint("llama", out, max_position_embeddings=LONG_CONTEXT)
        (out / ".complete").write_text("ok\n")
    return out


async def probe(base: str, message_mb: float) -> dict:
    gaps_before: list[float] = []
    gaps_during: list[float] = []
    health_ms: list[float] = []
    phase = {"during": False, "over": False}

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def stream() -> None:
            body = {"messages": CHAT, "max_tokens": 100_000, "stream": True, "ignore_eos": True}
            last = None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        (gaps_during if phase["during"] else gaps_before).append(now - last)
                    last = now
                    if phase["over"]:
                        return

        streams = [asyncio.create_task(stream()) for _ in range(4)]
        await asyncio.sleep(4.0)  # the streams' normal pace
        content = "the cat sat on the mat. " * int(message_mb * (1 << 20) / 24)
        big = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1})
        phase["during"] = True
        started = time.perf_counter()
        big_request = asyncio.create_task(client.post("/v1/chat/completions", content=big,
                                                       headers={"content-type": "application/json"}))
        while not big_request.done():
            t0 = time.perf_counter()
            r = await client.get("/health")
            health_ms.append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 200
            await asyncio.sleep(0.02)
        answer = await big_request
        processed_s = time.perf_counter() - started
        phase["during"], phase["over"] = False, True
        await asyncio.gather(*streams, return_exceptions=True)
    ms = lambda values: {"p50": round(statistics.median(values) * 1000, 2),  # noqa: E731
                         "p99": round(percentile(values, 99) * 1000, 2), "max": round(max(values) * 1000, 2)}
    return {
        "message_mb": round(len(content) / (1 << 20), 2), "big_request_status": answer.status_code,
        "big_request_answer": answer.text[:200], "big_request_seconds": round(processed_s, 2),
        "health_checks": len(health_ms),
        "health_ms": {"p50": round(statistics.median(health_ms), 2), "max": round(max(health_ms), 2)},
        "stream_gap_ms_before": ms(gaps_before), "stream_gap_ms_during": ms(gaps_during),
        "gap_p50_ratio": round(statistics.median(gaps_during) / statistics.median(gaps_before), 2),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", help="checkpoint for the soak (default: the demo model)")
    parser.add_argument("--kv-cache-mib", type=int, default=16, help="the soak server's KV cache (MiB)")
    parser.add_argument("--message-mb", type=float, default=5.0, help="size of the probe's big chat message")
    parser.add_argument("--no-probe", action="store_true", help="skip phase 2")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    from asyncllm.toy.checkpoints import build_demo_model

    load_start = loadavg()
    model_dir = args.model_dir or str(build_demo_model())
    sample_every = max(1, min(args.sample_every, args.requests // 10 or 1))
    # a fixed KV pool (16 MiB: 4k tokens of the demo model): fresh blocks are touched, and so count in
    # the RSS, as the prefix cache first spreads over the pool; a small pool is covered during warm-up
    with serve(model_dir, "--kv-cache-memory", str(args.kv_cache_mib << 20)) as (base, pid):
        result = {"benchmark": "W-SOAK", "date": utc_now(),
                  "soak": asyncio.run(soak(base, pid, args.requests, args.concurrency, sample_every, args.seed))}
    if not args.no_probe:
        with serve(str(build_long_context_model()), "--max-model-len", str(LONG_CONTEXT),
                   "--max-body-bytes", str(8 << 20)) as (base, _):
            result["probe"] = asyncio.run(probe(base, args.message_mb))
    result["machine"] = machine_record(load_start)
    result["command"] = "python -m benchmarks.w_soak " + " ".join(argv if argv is not None else sys.argv[1:])
    s = result["soak"]
    print(f"W-SOAK: {s['requests']} requests in {s['seconds']} s ({s['requests_per_s']}/s), errors {s['errors']}, "
          f"deliberate disconnects {s['deliberate_disconnects']}")
    print(f"  server RSS after warm-up {s['rss_after_warmup_mib']} MiB, at 90% {s['rss_end_mib']} MiB: "
          f"{s['rss_growth_pct_per_10k_requests']:+.2f}% per 10k requests; after the load {s['rss_after_load_mib']} MiB")
    if "probe" in result:
        p = result["probe"]
        print(f"  probe: {p['message_mb']} MB message answered {p['big_request_status']} in "
              f"{p['big_request_seconds']} s; /health p50 {p['health_ms']['p50']} ms, max {p['health_ms']['max']} ms; "
              f"stream gaps p50 {p['stream_gap_ms_before']['p50']} -> {p['stream_gap_ms_during']['p50']} ms "
              f"(x{p['gap_p50_ratio']}), max during {p['stream_gap_ms_during']['max']} ms")
    write_report(args.json, result)
    return result


if __name__ == "__main__":
    main()
