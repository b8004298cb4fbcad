"""W-HOSTILE: what one hostile request costs everyone else (workloads: docs/benchmarks.md).

    python -m benchmarks.w_hostile [--kinds batched_prompts,stop_strings,...] [--background 2] [--json out.json]

The OpenAI sub-app is embedded in this process as a host app would embed it (``create_app`` served through
httpx's ASGI transport on this event loop). For each hostile kind, a 10 ms ticker runs on the loop and
``--background`` streams decode beside it; the hostile request is sent and awaited; then a normal request must be
answered. Reported per kind: the status the hostile request got, its wall time, the ticker's worst gap (how long
the host's loop was blocked at once), the other streams' inter-token latency (p50/p99/max), and the KV blocks
held afterwards. Model: the embedded default model (``make demo``'s), float32, ``max_model_len`` 2048 (or the
model's own, if shorter).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.measure import finish_report, fmt_ms, loadavg, percentile, utc_now

MAX_MODEL_LEN = 2048


def _deep_json_string(levels: int) -> str:
    return "[" * levels + "]" * levels


def _chained_schema(links: int) -> dict[str, Any]:
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["x"]}
            for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


# kind -> (route, body builder); every body stays within the default 4 MiB body limit
HOSTILE: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {  # builders take max_model_len
    "batched_prompts": ("/v1/completions", lambda max_len: {"prompt": [[7]] * 50_000, "max_tokens": 1}),
    "batched_prompts_at_limit": ("/v1/completions", lambda max_len: {"prompt": [[7 + i % 100] for i in range(1024)],
                                                               "max_tokens": 1}),
    "embedding_inputs": ("/v1/embeddings", lambda max_len: {"input": [[7]] * 200_000}),
    "embedding_inputs_at_limit": ("/v1/embeddings", lambda max_len: {"input": [[7 + i % 100, 9] for i in range(1024)]}),
    "stop_strings": ("/v1/completions", lambda max_len: {"prompt": "hello", "max_tokens": 16,
                                                  "stop": [f"s{i}" for i in range(300_000)]}),
    "n_logprobs_echo": ("/v1/completions", lambda max_len: {"prompt": "hello there", "max_tokens": 16, "n": 64,
                                                     "logprobs": 20, "echo": True}),
    "chat_messages": ("/v1/chat/completions", lambda max_len: {"messages": [{"role": "user", "content": "hi"}] * 50_000,
                                                       "max_tokens": 1}),
    "prompt_logprobs": ("/v1/completions", lambda max_len: {"prompt": [10 + i % 200 for i in range(max_len - 48)],
                                                     "max_tokens": 1, "prompt_logprobs": 20}),
    "echo_logprobs": ("/v1/completions", lambda max_len: {"prompt": [10 + i % 200 for i in range(max_len - 48)],
                                                   "max_tokens": 1, "echo": True, "logprobs": 20}),
    "deep_guided_json": ("/v1/completions", lambda max_len: {"prompt": "hi", "max_tokens": 4,
                                                      "guided_json": _deep_json_string(5_000)}),
    "ref_chain_schema": ("/v1/chat/completions", lambda max_len: {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _chained_schema(1_000)}}}),
    "template_loop": ("/v1/chat/completions", lambda max_len: {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "chat_template_kwargs": {"chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                                  "{% endfor %}{% endfor %}"}}),
    "huge_logit_bias_key": ("/v1/completions", lambda max_len: {"prompt": "hi", "max_tokens": 1,
                                                         "logit_bias": {"9" * 5_000: 1}}),
}


class Ticker:
    """A 10 ms ticker on the loop: its worst gap is how long the loop was blocked at once."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.worst = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(self.period)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last - self.period)
            last = now

    def __enter__(self) -> "Ticker":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


async def _background_stream(llm, gaps: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        last = None
        async for _ in llm.stream("the background stream", max_tokens=64, ignore_eos=True):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                break


async def run_kind(llm, client, kind: str, background: int) -> dict[str, Any]:
    route, build = HOSTILE[kind]
    body = json.dumps(build(llm.max_model_len)).encode()
    gaps: list[float] = []
    stop = asyncio.Event()
    streams = [asyncio.ensure_future(_background_stream(llm, gaps, stop)) for _ in range(background)]
    await asyncio.sleep(0.3)  # the streams are decoding before the hostile request arrives
    gaps.clear()
    with Ticker() as ticker:
        start = time.perf_counter()
        response = await client.post(route, content=body, headers={"content-type": "application/json"})
        took = time.perf_counter() - start
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.gather(*streams, return_exceptions=True)
    normal = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    await asyncio.sleep(0.1)
    return {"kind": kind, "route": route, "body_bytes": len(body), "status": response.status_code,
            "seconds": round(took, 3), "ticker_worst_gap_ms": round(ticker.worst * 1000, 1),
            "other_streams_itl_ms": ({"p50": round(percentile(gaps, 50) * 1000, 1),
                                      "p99": round(percentile(gaps, 99) * 1000, 1),
                                      "max": round(max(gaps) * 1000, 1), "count": len(gaps)} if gaps else None),
            "error": _error_message(response),
            "next_request_status": normal.status_code,
            "blocks_held_after": llm.stats().get("kv_blocks_used")}


def _error_message(response) -> str | None:
    if response.status_code < 400:
        return None
    try:
        return response.json()["error"]["message"][:160]
    except (ValueError, KeyError, TypeError):
        return response.text[:160]


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from asyncllm import AsyncLLM
    from asyncllm.server import create_app
    from asyncllm.toy.checkpoints import build_demo_model

    model_dir = str(args.model_dir or build_demo_model())
    positions = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings", MAX_MODEL_LEN)
    llm = AsyncLLM(model_dir, dtype="float32", max_model_len=min(MAX_MODEL_LEN, positions))
    results = []
    try:
        app = create_app(llm, model_name="demo")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://host", timeout=args.timeout) as client:
            await client.post("/v1/completions", json={"prompt": "warm up", "max_tokens": 4})
            for kind in args.kinds:
                try:
                    result = await asyncio.wait_for(run_kind(llm, client, kind, args.background), args.timeout)
                except asyncio.TimeoutError:
                    result = {"kind": kind, "status": "timeout", "seconds": args.timeout}
                results.append(result)
                print(json.dumps(result), flush=True)
    finally:
        await llm.aclose()
    return {"model_dir": model_dir, "results": results}


SIZES = {"full": [], "quick": [], "tiny": ["--kinds", "stop_strings,huge_logit_bias_key", "--background", "1"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(HOSTILE), help="comma-separated: " + ", ".join(HOSTILE))
    parser.add_argument("--background", type=int, default=2, help="streams decoding beside each hostile request")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one hostile kind may take")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in HOSTILE]
    if unknown:
        parser.error(f"unknown kinds {unknown}; known: {', '.join(HOSTILE)}")
    load_start = loadavg()
    report = {"workload": "W-HOSTILE", "when": utc_now(), **asyncio.run(_main(args))}
    return finish_report(report, report["model_dir"], load_start, args.json, print_table)


def print_table(report: dict[str, Any]) -> None:
    print("\n| kind | status | s | worst loop gap ms | other streams' ITL p50 / p99 / max ms | blocks after |")
    print("|---|---|---|---|---|---|")
    for r in report["results"]:
        itl = r.get("other_streams_itl_ms") or {}
        print(f"| {r['kind']} | {r['status']} | {r['seconds']} | {fmt_ms(r.get('ticker_worst_gap_ms'))} | "
              f"{itl.get('p50')} / {itl.get('p99')} / {itl.get('max')} | {r.get('blocks_held_after')} |")

if __name__ == "__main__":
    main(sys.argv[1:])
