"""W-SCALE-OUT: past one process: tensor parallelism (TP) and data-parallel replicas (DP) on this machine.

    python -m benchmarks.w_scale_out [--model PATH] [--tp 1,2] [--dp 1,2] [--batch 1,8] [--new-tokens 64]
                                     [--clients 16] [--requests 48] [--json out.json]

Model: by default a random-weight Llama of SmolLM2-135M's width and depth (hidden 576, 30 layers, intermediate
1,536) with 8 query / 4 KV heads, so that it splits 2 ways (SmolLM2's 9 heads split 3 ways only), and the tests'
1,024-token vocabulary; float32 on the CPU.

TP: one ``LLM`` per size (``tensor_parallel_size=N``; the ranks share the machine's cores, each with its part),
batches of B prompts of 64 tokens, greedy, ``--new-tokens`` new tokens each (EOS ignored). Reported: prefill time
(the run's first engine step, which holds every prompt while B x 64 tokens fit its token budget), decode step time
(the mean of the run's later steps), end-to-end tokens/s; the prefix cache is emptied before each run.

DP: ``asyncllm serve MODEL --data-parallel-size N`` (Ray Serve, one CPU per replica, so one thread each), and, as
the baseline users start from, plain ``asyncllm serve MODEL`` (one process, every core). ``--clients``
concurrent clients send ``--requests`` completions in all (distinct 32-token prompts, ``--new-tokens`` tokens each,
greedy, EOS ignored); throughput = completion tokens / wall time, and how many requests each replica served
(``x-asyncllm-replica``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import StepRecorder, loadavg, publish_report, reset_prefix_cache, utc_now

SIZES = {"full": [], "quick": ["--new-tokens", "32", "--requests", "24"],
         "tiny": ["--tp", "1,2", "--dp", "", "--batch", "2", "--new-tokens", "6", "--requests", "4", "--clients", "2"]}
SCALE_OVERRIDES = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                       num_key_value_heads=4, max_position_embeddings=2048)
PROMPT_TOKENS = 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory or GGUF file (default: the random SmolLM2-sized Llama)")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes to measure (comma-separated)")
    p.add_argument("--dp", default="1,2", help="data-parallel sizes to measure ('' for none)")
    p.add_argument("--batch", default="1,8", help="TP batch sizes")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def default_model() -> str:
    from asyncllm.toy.checkpoints import build_checkpoint

    root = Path(os.environ.get("ASYNCLLM_CACHE") or Path.home() / ".cache" / "asyncllm") / "scale-out-llama"
    if not (root / ".complete").exists():
        build_checkpoint("llama", root, **SCALE_OVERRIDES)
        (root / ".complete").write_text("ok\n")
    return str(root)


def _prompts(count: int, length: int, salt: int = 0) -> list[list[int]]:
    return [[5 + (i * 7919 + j * 104729 + salt) % 1000 for j in range(length)] for i in range(count)]


def measure_tp(model: str, size: int, batches: list[int], new_tokens: int) -> dict[str, Any]:
    from asyncllm import LLM, SamplingParams

    rows: dict[str, Any] = {}
    begin = time.perf_counter()
    with LLM(model, dtype="float32", tensor_parallel_size=size, max_model_len=256,
             kv_cache_memory=256 << 20) as llm:
        start_s = time.perf_counter() - begin
        llm.generate(_prompts(1, 8, 99), SamplingParams(max_tokens=2, temperature=0))  # warm-up
        for batch in batches:
            prompts = _prompts(batch, PROMPT_TOKENS)
            reset_prefix_cache(llm.engine)  # every batch size computes its prompts
            recorder = StepRecorder(llm.engine)
            t0 = time.perf_counter()
            with recorder.installed():
                outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
            total = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            prefill, decode_steps = recorder.step_s[0], recorder.step_s[1:]
            step_ms = 1000 * sum(decode_steps) / len(decode_steps) if decode_steps else 0.0
            rows[str(batch)] = {"prefill_s": prefill, "decode_step_ms": step_ms,
                                "total_s": total, "tokens": tokens, "tokens_per_s": tokens / total,
                                "tokens_ids": [o.outputs[0].token_ids for o in outs]}
    return {"start_s": start_s, "batches": rows}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(model: str, extra: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "asyncllm.cli", "serve", model, "--port", str(port),
                             "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", str(256 << 20),
                             *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"w_scale_out: the server ({' '.join(extra) or 'plain'}) did not start")


def _stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _load(base: str, clients: int, requests: int, new_tokens: int) -> dict[str, Any]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    tokens = 0
    replicas: dict[str, int] = {}

    async def client(http):
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            r = await http.post("/v1/completions", json={"prompt": _prompts(1, 32, 1000 + i)[0],
                                                         "max_tokens": new_tokens, "temperature": 0,
                                                         "ignore_eos": True})
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
            name = r.headers.get("x-asyncllm-replica", "-")
            replicas[name] = replicas.get(name, 0) + 1

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await http.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2})
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "requests_per_replica": replicas}


def measure_dp(model: str, size: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """``size`` replicas on Ray Serve, or (None) the plain single-process server."""
    session = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    env = dict(os.environ, RAY_ADDRESS="", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=session)
    extra = [] if size is None else ["--data-parallel-size", str(size)]
    proc, base = _start_server(model, extra, env)
    try:
        return asyncio.run(_load(base, args.clients, args.requests, args.new_tokens))
    finally:
        _stop_server(proc)


def print_report(report: dict[str, Any]) -> None:
    print("\nW-SCALE-OUT: tensor parallelism (CPU, gloo)")
    print("| TP | batch | prefill s | decode step ms | tokens/s | same tokens as TP=1 |")
    print("|---|---|---|---|---|---|")
    for size, r in report["tp"].items():
        for batch, row in r["batches"].items():
            print(f"| {size} | {batch} | {row['prefill_s']:.2f} | {row['decode_step_ms']:.1f} | "
                  f"{row['tokens_per_s']:.1f} | {row.get('same_as_tp1', '-')} |")
    if report["dp"]:
        print("\nW-SCALE-OUT: data-parallel replicas (Ray Serve), concurrent load")
        print("| server | completion tokens | wall s | tokens/s | requests per replica |")
        print("|---|---|---|---|---|")
        for name, r in report["dp"].items():
            print(f"| {name} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} | "
                  f"{r['requests_per_replica']} |")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = args.model or default_model()
    load_start = loadavg()
    report: dict[str, Any] = {
        "workload": "W-SCALE-OUT", "date": utc_now(),
        "command": "python -m benchmarks.w_scale_out " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {"tp": _ints(args.tp), "dp": _ints(args.dp), "batch": _ints(args.batch),
                   "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS, "clients": args.clients,
                   "requests": args.requests},
        "tp": {}, "dp": {},
    }
    for size in _ints(args.tp):
        report["tp"][str(size)] = measure_tp(model, size, _ints(args.batch), args.new_tokens)
    base = report["tp"].get("1")
    for size, r in report["tp"].items():
        for batch, row in r["batches"].items():
            if base is not None:
                row["same_as_tp1"] = row["tokens_ids"] == base["batches"][batch]["tokens_ids"]
    for r in report["tp"].values():
        for row in r["batches"].values():
            row.pop("tokens_ids")
    if _ints(args.dp):
        report["dp"]["plain serve"] = measure_dp(model, None, args)
        for size in _ints(args.dp):
            report["dp"][f"DP={size}"] = measure_dp(model, size, args)
    return publish_report(report, {"path": model, "dtype": "float32",
                                   "shape": SCALE_OVERRIDES if args.model is None else "see path"},
                          load_start, args.json, print_report)


if __name__ == "__main__":
    main()
