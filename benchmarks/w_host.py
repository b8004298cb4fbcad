"""W-HOST: the host application's own routes, served by the same process and event loop while the engine streams.

    python -m benchmarks.w_host [--streams 32] [--prompt-len 128] [--gen-len 128] [--rate 50] [--work-ms 1.0]
                                [--seconds 10] [--repeats 2] [--loop auto] [--torch-threads N]
                                [--switch-interval-ms MS] [--no-freeze-gc] [--tiny] [--json out.json]

One Starlette app in one uvicorn server on 127.0.0.1 (uvicorn's defaults: ``--loop auto`` is uvloop when it is
installed, ``http`` auto is httptools), in this process: the host's route ``POST /host/work`` parses a small JSON
body, runs a pure-Python loop calibrated at start to take ``--work-ms`` alone (the median of 30 runs, engine
idle) and answers JSON; ``create_app(llm)`` mounted at the root serves ``/v1/...``. The ``AsyncLLM`` (``cpu-llama``,
float32, default engine settings) runs its engine in its background thread. A 10 ms ticker on the server's loop
records how late each tick wakes (event-loop lag; ``loop_stalls_over_100ms`` counts ticks over 100 ms late: in a
host-alone phase those are the machine's stalls, not the engine's, and they set its p99); the host route records
its time in the app (``server_ms``: request in -> answer sent) and its own work (``work_ms``, and ``work_cpu_ms``,
the loop thread's CPU time in it: wall well above CPU means the thread was off the CPU or waiting for the GIL).

The load comes from separate processes (``--driver host`` / ``--driver engine``: asyncio and a minimal keep-alive
HTTP/1.1 client, so that a driver's own cost per request stays small), so the clients' work is not on the server's
loop; they run at ``--driver-nice`` (-10 where allowed), as clients on machines of their own would get the CPU when
they need it. The host driver sends ``POST /host/work`` at a fixed ``--rate``, open loop (request ``i`` starts at
``t0 + i / rate`` whatever the earlier ones do) over at most ``--connections`` connections; host latency runs from
the scheduled start to the end of the answer (within it, ``driver_late_ms``: how late the driver started the
request, and ``connection_wait_ms``: how long it then waited for a free connection; then ``inbound_ms``, from the
driver's send to the request's arrival in the app, ``in_app_ms``, and ``outbound_ms``, from the answer leaving the
route to the driver having read it, from the times the route puts in its answer). The engine driver runs
``--streams`` closed-loop clients, each streaming ``/v1/completions`` (``--prompt-len`` random token ids,
``--gen-len`` tokens, greedy, ``ignore_eos``, ``stream_options.include_usage``) back to back until ``--seconds``
have passed; output tokens/s = the usage's completion tokens / (last answer's end - first request's start); TTFT
and the gaps between a stream's SSE chunks are the client's. The server's threads' CPU seconds per phase (loop,
engine thread, the rest: torch's OpenMP workers and pools) come from /proc (``server_cpu``).

Phases, each ``--repeats`` times (order host, engine, both; then both, engine, host; ...): host alone for
``--seconds``; engine alone; both at once (the host driver starts first, the engine driver's window is the
phase: host requests scheduled inside it count). Figures pool a condition's runs (percentiles over every request,
tokens/s = all tokens / all wall time). Timestamps are ``time.monotonic()``, one clock for all the processes.

Targets (the W-HOST issue): host p99 <= 2x alone and engine tokens/s >= 0.85x alone, or the figures and what
bounds them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.measure import REPO_ROOT, fmt_ms, loadavg, model_config, percentile, summarize_ms, utc_now

TARGETS = {"host_p99_ratio_max": 2.0, "engine_tokens_per_s_ratio_min": 0.85}
TICK_S = 0.01
TINY_ARGS = ["--streams", "4", "--prompt-len", "16", "--gen-len", "16", "--seconds", "2", "--repeats", "1"]
SIZES = {"full": [], "quick": ["--seconds", "5", "--repeats", "1"], "tiny": ["--tiny"]}
PHASES = ("host", "engine", "both")
SETTINGS = ("streams", "prompt_len", "gen_len", "rate", "connections", "work_ms", "seconds", "repeats", "loop", "http",
            "driver_nice", "torch_threads", "switch_interval_ms", "no_freeze_gc", "tiny")


# ---------------------------------------------------------------------------------------------------------------
# The host's own work
# ---------------------------------------------------------------------------------------------------------------


def spin(iterations: int) -> int:
    """Pure-Python work that holds the GIL throughout (what a host's route does: dicts, ints, calls)."""
    acc = 0
    for i in range(iterations):
        acc = (acc * 31 + i) % 1_000_003
    return acc


def calibrate(target_s: float, runs: int = 30) -> dict[str, Any]:
    """The ``spin`` size that takes ``target_s`` alone (median of ``runs``), and what it then measured."""
    iterations = 2000
    for _ in range(4):
        samples = []
        for _ in range(runs):
            t0 = time.perf_counter()
            spin(iterations)
            samples.append(time.perf_counter() - t0)
        iterations = max(1, round(iterations * target_s / percentile(samples, 50)))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        spin(iterations)
        samples.append(time.perf_counter() - t0)
    return {"iterations": iterations, "work_ms": summarize_ms(samples)}


# ---------------------------------------------------------------------------------------------------------------
# The load drivers (separate processes)
# ---------------------------------------------------------------------------------------------------------------


class Connection:
    """A keep-alive HTTP/1.1 connection that POSTs JSON: a few lines of asyncio streams, so that what the drivers
    spend per request (a process on the same cores as the server) stays small beside the server's own work."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host.encode()

    @classmethod
    async def open(cls, url: str) -> "Connection":
        host, port = url.split("//", 1)[1].rstrip("/").split(":")
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 22)
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, payload: Any) -> tuple[int, dict[str, str]]:
        """Send the request and read the status line and headers."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (path.encode(), self.host, len(body), body))
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            if line:
                key, _, value = line.partition(":")
                headers[key.strip().lower()] = value.strip()
        return int(head[0].split()[1]), headers

    async def pieces(self, headers: dict[str, str]) -> Any:
        """The body, as it arrives (chunked transfer encoding decoded)."""
        if "content-length" in headers:
            yield await self.reader.readexactly(int(headers["content-length"]))
            return
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await self.reader.readuntil(b"\r\n")
                return
            data = await self.reader.readexactly(size + 2)
            yield data[:-2]

    async def body(self, headers: dict[str, str]) -> bytes:
        return b"".join([piece async for piece in self.pieces(headers)])

    def close(self) -> None:
        self.writer.close()


async def _stdin_closed() -> None:
    """Returns when a line arrives on stdin or it closes (the orchestrator's "stop")."""
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


class Pool:
    """At most ``size`` keep-alive connections, opened as needed; a request waits for one when all are busy (its
    latency still runs from its scheduled start, as an open-loop load generator's must)."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.opened = url, size, 0
        self.idle: asyncio.Queue[Connection] = asyncio.Queue()

    async def get(self) -> Connection:
        if self.idle.empty() and self.opened < self.size:
            self.opened += 1
            try:
                return await Connection.open(self.url)
            except OSError:
                self.opened -= 1
                raise
        return await self.idle.get()

    def put(self, conn: Connection, reusable: bool) -> None:
        if reusable:
            self.idle.put_nowait(conn)
        else:
            conn.close()
            self.opened -= 1

    def close(self) -> None:
        while not self.idle.empty():
            self.idle.get_nowait().close()


async def host_driver(url: str, rate: float, seconds: float | None, connections: int) -> dict[str, Any]:
    """``POST /host/work`` at ``rate`` per second, open loop, for ``seconds`` (None: until stdin says stop), over at
    most ``connections`` keep-alive connections."""
    records: list[list[float]] = []
    pool = Pool(url, connections)

    async def one(i: int, target: float) -> None:
        started = time.monotonic()
        conn, status = await pool.get(), -1
        sent = time.monotonic()
        arrived = answered = None
        try:
            status, headers = await conn.post("/host/work", {"item": i})
            answer = json.loads(await conn.body(headers))
            arrived, answered = answer.get("arrived"), answer.get("answered")
            pool.put(conn, headers.get("connection", "").lower() != "close")
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status = -1
            pool.put(conn, False)
        records.append([target, started, sent, time.monotonic(), status, arrived, answered])

    for i in range(10):  # the route's first calls
        await one(-1 - i, time.monotonic())
    records.clear()
    stop = asyncio.ensure_future(_stdin_closed()) if seconds is None else None
    print("ready", flush=True)
    t0 = time.monotonic() + 0.05
    tasks, i = [], 0
    while True:
        target = t0 + i / rate
        if seconds is not None and target - t0 >= seconds:
            break
        if stop is not None and stop.done():
            break
        delay = target - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i, target)))
        i += 1
    await asyncio.gather(*tasks)
    if stop is not None:
        stop.cancel()
    pool.close()
    return {"records": records, "connections_opened": pool.opened}


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(length)]


async def engine_driver(url: str, streams: int, prompt_len: int, gen_len: int, seconds: float, vocab: int,
                        seed: int) -> dict[str, Any]:
    """``streams`` closed-loop clients streaming /v1/completions back to back until ``seconds`` have passed, each on
    its own keep-alive connection."""
    requests: list[dict[str, Any]] = []
    start = time.monotonic()

    async def stream_once(conn: Connection, rng: random.Random) -> None:
        body = {"prompt": _prompt(rng, prompt_len, vocab), "max_tokens": gen_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        began = time.monotonic()
        chunk_times: list[float] = []
        tokens, buffer = None, b""
        status, headers = await conn.post("/v1/completions", body)
        async for piece in conn.pieces(headers):
            now = time.monotonic()
            *lines, buffer = (buffer + piece).split(b"\n")
            for line in lines:
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("choices"):
                    chunk_times.append(now)
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
        end = time.monotonic()
        gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
        requests.append({"start": began, "end": end, "status": status, "tokens": tokens or 0,
                         "ttft": chunk_times[0] - began if chunk_times else None, "gaps": gaps})

    async def client_loop(index: int) -> None:
        rng = random.Random(seed * 100_003 + index)
        conn = await Connection.open(url)
        try:
            while True:
                await stream_once(conn, rng)
                if time.monotonic() - start >= seconds:
                    break
        finally:
            conn.close()

    await asyncio.gather(*(client_loop(i) for i in range(streams)))
    return {"requests": requests}


def driver_main(args: argparse.Namespace) -> None:
    nice = 0
    if args.driver_nice:
        try:
            nice = os.nice(args.driver_nice)  # the drivers stand for clients on machines of their own
        except OSError:
            nice = os.nice(0)
    print(f"nice {nice}", flush=True)
    if args.driver == "host":
        coro = host_driver(args.url, args.rate, args.seconds if args.seconds > 0 else None, args.connections)
    else:
        coro = engine_driver(args.url, args.streams, args.prompt_len, args.gen_len, args.seconds, args.vocab,
                             args.seed)
    result = _run_loop(coro, args.loop)
    sys.stdout.write("result " + json.dumps(result) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------------------
# The server process: app, ticker, phases
# ---------------------------------------------------------------------------------------------------------------


class Ticker:
    """A ``TICK_S`` ticker on the loop: ``samples`` = (when it woke, how late)."""

    def __init__(self, samples: list[tuple[float, float]]) -> None:
        self.samples = samples
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            self.samples.append((now, now - before - TICK_S))

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


class ServerLog:
    """What the server process records, as (monotonic time, seconds): the ticker's lateness (``ticks``), the host
    route's own work (``works``; ``work_cpus``: the loop thread's CPU time in it), and the host route's time from
    the request's arrival in the app to its answer sent (``served``, keyed by arrival)."""

    def __init__(self) -> None:
        self.ticks: list[tuple[float, float]] = []
        self.works: list[tuple[float, float]] = []
        self.work_cpus: list[tuple[float, float]] = []
        self.served: list[tuple[float, float]] = []
        # the cyclic garbage collector's pauses, any thread's (each holds the GIL: every thread waits), by generation
        self.gc_pauses: list[tuple[float, float]] = []
        self.gc_full_pauses: list[tuple[float, float]] = []
        self._gc_started = 0.0

    def window(self, lo: float, hi: float) -> dict[str, list[float]]:
        return {name: [v for t, v in getattr(self, name) if lo <= t <= hi]
                for name in ("ticks", "works", "work_cpus", "served", "gc_pauses", "gc_full_pauses")}

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` hook: times each collection."""
        now = time.monotonic()
        if phase == "start":
            self._gc_started = now
        elif self._gc_started:
            (self.gc_full_pauses if info.get("generation") == 2 else self.gc_pauses).append(
                (self._gc_started, now - self._gc_started))


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) this process's threads have used: the loop's (the main thread), the engine
    thread's, and all the others' (torch's OpenMP workers, the input and response pools); from /proc, Linux only."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    loop_id = threading.main_thread().native_id
    engine_ids = {t.native_id for t in threading.enumerate() if t.name == "asyncllm-engine"}
    out = {"loop": 0.0, "engine": 0.0, "other": 0.0}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        key = "loop" if int(tid) == loop_id else "engine" if int(tid) in engine_ids else "other"
        out[key] += seconds
    return out


def _cpu_since(before: dict[str, float]) -> dict[str, float]:
    now = thread_cpu()
    return {k: round(now[k] - before.get(k, 0.0), 3) for k in now}


def build_app(llm: Any, iterations: int, log: ServerLog) -> Any:
    """The host app: its own JSON route, and the engine's OpenAI-style app mounted at the root (``/v1/...``),
    wrapped in a timer of the host route."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Mount, Route

    from asyncllm.server import create_app

    async def host_work(request: Request) -> JSONResponse:
        body = await request.json()
        t0, c0 = time.perf_counter(), time.thread_time()
        value = spin(iterations)
        took, cpu = time.perf_counter() - t0, time.thread_time() - c0
        now = time.monotonic()
        log.works.append((now, took))
        log.work_cpus.append((now, cpu))
        # when the request reached the app and when its answer left the route (monotonic, the drivers' clock too):
        # the driver splits its latency into the way in, the app and the way back
        return JSONResponse({"item": body.get("item"), "value": value, "work_ms": round(took * 1000, 3),
                             "arrived": request.scope.get("state", {}).get("arrived"), "answered": time.monotonic()})

    app = Starlette(routes=[Route("/host/work", host_work, methods=["POST"]),
                            Mount("", app=create_app(llm, model_name="model"))])

    async def timed(scope, receive, send):  # the host route's server-side time: request in -> answer sent
        if scope["type"] != "http" or scope["path"] != "/host/work":
            return await app(scope, receive, send)
        t0 = time.monotonic()
        scope.setdefault("state", {})["arrived"] = t0

        async def sending(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                log.served.append((t0, time.monotonic() - t0))

        await app(scope, receive, sending)

    return timed


class Driver:
    """One load-driver subprocess."""

    niceness: set[int] = set()  # what the drivers ran at

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls, *argv: str) -> "Driver":
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                                        os.environ.get("PYTHONPATH")])))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "benchmarks.w_host", *argv,
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    cwd=str(REPO_ROOT), env=env, limit=1 << 26)
        return cls(proc)

    async def line(self) -> str:
        raw = await self.proc.stdout.readline()
        if not raw:
            code = await self.proc.wait()
            raise RuntimeError(f"a load driver exited ({code}) without its result")
        text = raw.decode().rstrip("\n")
        if text.startswith("nice "):
            Driver.niceness.add(int(text[5:]))
        return text

    async def ready(self) -> None:
        while (await self.line()) != "ready":
            pass

    async def stop(self) -> None:
        self.proc.stdin.write(b"stop\n")
        await self.proc.stdin.drain()

    async def result(self) -> dict[str, Any]:
        while True:
            text = await self.line()
            if text.startswith("result "):
                await self.proc.wait()
                return json.loads(text[len("result "):])


def _host_run(records: list[list[float]], lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    kept = [r for r in records if (lo is None or r[0] >= lo) and (hi is None or r[0] <= hi)]
    ok = [r for r in kept if r[4] == 200]
    timed = [r for r in ok if len(r) > 6 and r[5] is not None and r[6] is not None]
    return {"latencies": [r[3] - r[0] for r in ok], "lates": [r[1] - r[0] for r in kept],
            "connection_waits": [r[2] - r[1] for r in kept],
            # sent -> in the app (the driver's write, loopback TCP, uvicorn reading and parsing it), in the app, and
            # answer built -> read by the driver (uvicorn's write, TCP, the driver reading it)
            "inbound": [r[5] - r[2] for r in timed], "in_app": [r[6] - r[5] for r in timed],
            "outbound": [r[3] - r[6] for r in timed],
            "errors": len(kept) - len(ok), "window": [min(r[0] for r in kept), max(r[0] for r in kept)]
            if kept else None}


def _engine_run(requests: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in requests if r["status"] == 200]
    start, end = min(r["start"] for r in requests), max(r["end"] for r in requests)
    return {"tokens": sum(r["tokens"] for r in ok), "requests": len(ok), "errors": len(requests) - len(ok),
            "wall_s": end - start, "window": [start, end], "ttfts": [r["ttft"] for r in ok if r["ttft"] is not None],
            "gaps": [g for r in ok for g in r["gaps"]]}


def _ms_max(values: list[float]) -> float | None:
    return round(1000 * max(values), 3) if values else None


def _summary(values: list[float]) -> dict[str, Any]:
    out = summarize_ms(values)
    out["max"] = _ms_max(values)
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, url: str, vocab: int, llm: Any, log: ServerLog) -> None:
        self.args, self.url, self.vocab, self.llm, self.log = args, url, vocab, llm, log
        self.seed = 0

    def _engine_argv(self, seconds: float, streams: int | None = None, gen_len: int | None = None) -> list[str]:
        self.seed += 1
        a = self.args
        return ["--driver", "engine", "--url", self.url, "--streams", str(streams or a.streams),
                "--prompt-len", str(a.prompt_len), "--gen-len", str(gen_len or a.gen_len), "--seconds",
                str(seconds), "--vocab", str(self.vocab), "--seed", str(self.seed), "--loop", a.loop,
                "--driver-nice", str(a.driver_nice)]

    def _host_argv(self, seconds: float) -> list[str]:
        return ["--driver", "host", "--url", self.url, "--rate", str(self.args.rate), "--seconds", str(seconds),
                "--loop", self.args.loop, "--connections", str(self.args.connections),
                "--driver-nice", str(self.args.driver_nice)]

    def _server_side(self, lo: float, hi: float) -> dict[str, Any]:
        return self.log.window(lo, hi)

    async def warm_up(self) -> None:
        """The HTTP paths and the engine's batch shapes, before anything is timed."""
        engine = await Driver.start(*self._engine_argv(0.001, gen_len=8))
        host = await Driver.start(*self._host_argv(0.5))
        await engine.result()
        await host.result()

    def _reset_prefix_cache(self) -> None:
        from benchmarks.measure import reset_prefix_cache

        reset_prefix_cache(self.llm.engine)  # the engine is idle between phases

    async def host_alone(self) -> dict[str, Any]:
        cpu = thread_cpu()
        driver = await Driver.start(*self._host_argv(self.args.seconds))
        run = _host_run((await driver.result())["records"])
        lo, hi = run["window"]
        run.update(self._server_side(lo, hi + 1.0))  # the last answers arrive after the last start
        run["cpu_s"] = _cpu_since(cpu)
        return run

    async def engine_alone(self) -> dict[str, Any]:
        self._reset_prefix_cache()
        cpu = thread_cpu()
        driver = await Driver.start(*self._engine_argv(self.args.seconds))
        run = _engine_run((await driver.result())["requests"])
        run.update(self._server_side(*run["window"]))
        run["cpu_s"] = _cpu_since(cpu)
        return run

    async def both(self) -> tuple[dict[str, Any], dict[str, Any]]:
        self._reset_prefix_cache()
        cpu = thread_cpu()
        host = await Driver.start(*self._host_argv(0))  # until told to stop
        await host.ready()
        await asyncio.sleep(0.2)
        engine = await Driver.start(*self._engine_argv(self.args.seconds))
        engine_run = _engine_run((await engine.result())["requests"])
        await host.stop()
        lo, hi = engine_run["window"]
        host_run = _host_run((await host.result())["records"], lo, hi)
        side = self._server_side(lo, hi)
        side["cpu_s"] = _cpu_since(cpu)
        engine_run.update(side)
        host_run.update(side)
        return host_run, engine_run

    async def run(self) -> dict[str, Any]:
        await self.warm_up()
        host: dict[str, list] = {"alone": [], "with_engine": []}
        engine: dict[str, list] = {"alone": [], "with_host": []}
        order_log = []
        for repeat in range(self.args.repeats):
            order = PHASES if repeat % 2 == 0 else tuple(reversed(PHASES))
            for phase in order:
                t0 = time.monotonic()
                if phase == "host":
                    host["alone"].append(await self.host_alone())
                elif phase == "engine":
                    engine["alone"].append(await self.engine_alone())
                else:
                    h, e = await self.both()
                    host["with_engine"].append(h)
                    engine["with_host"].append(e)
                order_log.append({"repeat": repeat, "phase": phase, "seconds": round(time.monotonic() - t0, 2)})
                print(f"[w_host] repeat {repeat} {phase}: {order_log[-1]['seconds']} s", file=sys.stderr,
                      flush=True)
                await asyncio.sleep(0.5)
        return {"host": {k: pool_host(v) for k, v in host.items()},
                "engine": {k: pool_engine(v) for k, v in engine.items()},
                "server_cpu": cpu_figures(host["alone"], engine["alone"], engine["with_host"]), "phases": order_log}


def pool_host(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A host condition's figures over its runs."""
    latencies = [x for r in runs for x in r["latencies"]]
    return {"runs": len(runs), "requests": len(latencies), "errors": sum(r["errors"] for r in runs),
            "latency_ms": _summary(latencies),
            "latency_p99_ms_each_run": [summarize_ms(r["latencies"])["p99"] for r in runs],
            "driver_late_ms": _summary([x for r in runs for x in r["lates"]]),
            "connection_wait_ms": _summary([x for r in runs for x in r["connection_waits"]]),
            "inbound_ms": _summary([x for r in runs for x in r.get("inbound", [])]),
            "in_app_ms": _summary([x for r in runs for x in r.get("in_app", [])]),
            "outbound_ms": _summary([x for r in runs for x in r.get("outbound", [])]),
            "server_ms": _summary([x for r in runs for x in r["served"]]),
            "work_ms": _summary([x for r in runs for x in r["works"]]),
            "work_cpu_ms": _summary([x for r in runs for x in r["work_cpus"]]),
            "loop_lag_ms": _summary([x for r in runs for x in r["ticks"]]),
            "loop_stalls_over_100ms": sum(x > 0.1 for r in runs for x in r["ticks"]),
            "gc_pause_ms": _summary([x for r in runs for x in r.get("gc_pauses", [])]),
            "gc_full_pause_ms": _summary([x for r in runs for x in r.get("gc_full_pauses", [])])}


def _cpu_total(runs: list[dict[str, Any]]) -> dict[str, float]:
    keys = {k for r in runs for k in r.get("cpu_s", {})}
    return {k: round(sum(r.get("cpu_s", {}).get(k, 0.0) for r in runs), 3) for k in sorted(keys)}


def cpu_figures(host_alone: list[dict[str, Any]], engine_alone: list[dict[str, Any]],
                both: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU the server process's threads spent in each condition (all its runs): per host request alone, per
    generated token alone, and together (where both kinds of work share the seconds)."""
    out: dict[str, Any] = {}
    h, e, b = _cpu_total(host_alone), _cpu_total(engine_alone), _cpu_total(both)
    requests = sum(len(r["latencies"]) for r in host_alone)
    if h and requests:
        out["host_alone"] = {"cpu_s": h, "loop_ms_per_request": round(1000 * h["loop"] / requests, 3)}
    for name, cpu, runs in (("engine_alone", e, engine_alone), ("both", b, both)):
        tokens = sum(r["tokens"] for r in runs)
        if cpu and tokens:
            out[name] = {"cpu_s": cpu, "per_token_us": {k: round(1e6 * v / tokens, 1) for k, v in cpu.items()}}
    return out


def pool_engine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """An engine condition's figures over its runs."""
    tokens, wall = sum(r["tokens"] for r in runs), sum(r["wall_s"] for r in runs)
    return {"runs": len(runs), "requests": sum(r["requests"] for r in runs), "errors": sum(r["errors"] for r in runs),
            "generated_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_s_each_run": [round(r["tokens"] / r["wall_s"], 1) for r in runs],
            "ttft_ms": _summary([x for r in runs for x in r["ttfts"]]),
            "itl_ms": _summary([x for r in runs for x in r["gaps"]]),
            "loop_lag_ms": _summary([x for r in runs for x in r["ticks"]]),
            "loop_stalls_over_100ms": sum(x > 0.1 for r in runs for x in r["ticks"])}


def compare(host: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """The issue's ratios, from the pooled figures."""
    alone, loaded = host["alone"]["latency_ms"], host["with_engine"]["latency_ms"]
    tokens = round(engine["with_host"]["tokens_per_s"] / engine["alone"]["tokens_per_s"], 3)
    ratios = {"host_p50_ratio": round(loaded["p50"] / alone["p50"], 3),
              "host_p99_ratio": round(loaded["p99"] / alone["p99"], 3), "engine_tokens_per_s_ratio": tokens}
    ratios["met"] = {"host_p99": ratios["host_p99_ratio"] <= TARGETS["host_p99_ratio_max"],
                     "engine_tokens_per_s": tokens >= TARGETS["engine_tokens_per_s_ratio_min"]}
    return ratios


async def serve_and_measure(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import torch
    import uvicorn

    from asyncllm import AsyncLLM

    loop = asyncio.get_running_loop()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    llm = AsyncLLM(model_dir, dtype="float32", device="cpu", freeze_gc=not args.no_freeze_gc)
    calibration = calibrate(args.work_ms / 1000)
    log = ServerLog()
    gc.callbacks.append(log.on_gc)
    app = build_app(llm, calibration["iterations"], log)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", http=args.http,
                            timeout_keep_alive=120)
    server = uvicorn.Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    ticker = Ticker(log.ticks)
    try:
        while not server.started:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.05)
        ticker.start()
        bench = Bench(args, url, model_config(model_dir)["vocab_size"], llm, log)
        figures = await bench.run()
    finally:
        ticker.stop()
        server.should_exit = True
        await serving
        sock.close()
        await llm.aclose()
    server_info = {"loop": f"{type(loop).__module__}.{type(loop).__name__}", "http": args.http,
                   "driver_niceness": sorted(Driver.niceness), "server_niceness": os.nice(0),
                   "uvicorn": uvicorn.__version__, "torch_threads": torch.get_num_threads(),
                   "switch_interval_s": sys.getswitchinterval(), "engine": {"max_itl_ms": llm.config.max_itl_ms,
                                                                            "max_num_seqs": llm.config.max_num_seqs}}
    return {"server": server_info, "calibration": calibration, **figures}


def tiny_model(work_dir: Path) -> Path:
    from asyncllm.toy.checkpoints import build_checkpoint

    target = work_dir / "w_host-tiny-llama"
    if not (target / "config.json").is_file():
        tmp = target.with_name(target.name + ".tmp")
        build_checkpoint("llama", tmp)
        tmp.rename(target)
    return target


def late_wait(host: dict[str, Any]) -> float | None:
    """The larger of the driver's p99 lateness and its p99 wait for a connection (ms)."""
    values = [v for v in (host["driver_late_ms"]["p99"], host["connection_wait_ms"]["p99"]) if v is not None]
    return max(values) if values else None


def print_table(report: dict[str, Any]) -> None:
    host, engine, c = report["host"], report["engine"], report["comparison"]
    s = report["settings"]
    print(f"\nW-HOST: POST /host/work ({s['work_ms']} ms of Python) at {s['rate']}/s beside {s['streams']} streams "
          f"({s['prompt_len']}+{s['gen_len']} tokens), one process and loop ({report['server']['loop']})")
    hdr = (f"{'host route':>12} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'late+wait p99':>13} {'server p99':>10} "
           f"{'in p99':>7} {'out p99':>7} {'work p99':>8} {'work cpu p99':>12} {'loop lag p99':>12} {'n':>6}")
    print(hdr)
    print("-" * len(hdr))
    for name, r in host.items():
        lat = r["latency_ms"]
        print(f"{name:>12} {fmt_ms(lat['p50']):>7} {fmt_ms(lat['p99']):>7} {fmt_ms(lat['max']):>7} "
              f"{fmt_ms(late_wait(r)):>13} {fmt_ms(r['server_ms']['p99']):>10} "
              f"{fmt_ms(r['inbound_ms']['p99']):>7} {fmt_ms(r['outbound_ms']['p99']):>7} "
              f"{fmt_ms(r['work_ms']['p99']):>8} {fmt_ms(r['work_cpu_ms']['p99']):>12} "
              f"{fmt_ms(r['loop_lag_ms']['p99']):>12} {r['requests']:>6}")
    for name, r in host.items():
        print(f"{name:>12} GC pauses: {r['gc_pause_ms']['count']} young (max {fmt_ms(r['gc_pause_ms']['max'])} ms), "
              f"{r['gc_full_pause_ms']['count']} full (max {fmt_ms(r['gc_full_pause_ms']['max'])} ms); inbound max "
              f"{fmt_ms(r['inbound_ms']['max'])} ms, loop lag max {fmt_ms(r['loop_lag_ms']['max'])} ms")
    hdr = f"{'engine':>12} {'tok/s':>8} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p99':>9} {'loop lag p99':>13} {'req':>6}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in engine.items():
        print(f"{name:>12} {r['tokens_per_s']:>8.1f} {fmt_ms(r['itl_ms']['p50']):>8} {fmt_ms(r['itl_ms']['p99']):>8} "
              f"{fmt_ms(r['ttft_ms']['p99']):>9} {fmt_ms(r['loop_lag_ms']['p99']):>13} {r['requests']:>6}")
    print(f"W-HOST: host p50 x{c['host_p50_ratio']}, p99 x{c['host_p99_ratio']} "
          f"({host['alone']['latency_ms']['p99']} -> {host['with_engine']['latency_ms']['p99']} ms; target <= "
          f"{TARGETS['host_p99_ratio_max']}x: {'met' if c['met']['host_p99'] else 'not met'}); engine tok/s "
          f"x{c['engine_tokens_per_s_ratio']} ({engine['alone']['tokens_per_s']} -> "
          f"{engine['with_host']['tokens_per_s']}; target >= {TARGETS['engine_tokens_per_s_ratio_min']}x: "
          f"{'met' if c['met']['engine_tokens_per_s'] else 'not met'})", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.w_host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32, help="concurrent engine streams (default 32)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per stream request (128)")
    parser.add_argument("--gen-len", type=int, default=128, help="generated tokens per stream request (128)")
    parser.add_argument("--rate", type=float, default=50.0, help="host requests per second, open loop (50)")
    parser.add_argument("--connections", type=int, default=32,
                        help="the host driver's keep-alive connections at most (32)")
    parser.add_argument("--work-ms", type=float, default=1.0, help="Python work per host request, alone (1 ms)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase (10)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each phase (2)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="the server's event loop: auto = uvloop when installed (uvicorn's default)")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto", help="uvicorn's HTTP")
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="torch threads in the server process (0: torch's default)")
    parser.add_argument("--switch-interval-ms", type=float, default=0,
                        help="the server process's sys.setswitchinterval, ms (0: Python's default, 5)")
    parser.add_argument("--no-freeze-gc", action="store_true",
                        help="AsyncLLM(freeze_gc=False): full collections walk the start-up heap (the A/B of gc_freeze.py)")
    parser.add_argument("--driver-nice", type=int, default=-10,
                        help="niceness increment of the load drivers where allowed (-10: they run when they need "
                             "to, as clients on their own machines would; 0: as the server)")
    parser.add_argument("--tiny", action="store_true", help="the toy llama, few streams, 2 s phases (the tests)")
    parser.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "asyncllm" / "w_host",
                        help="where --tiny builds its model")
    parser.add_argument("--model-dir", help="checkpoint to use instead of the cached cpu-llama")
    parser.add_argument("--json", metavar="PATH", help="write the figures to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="accepted for the suite runner")
    # the load drivers' own arguments (the benchmark starts them)
    parser.add_argument("--driver", choices=("host", "engine"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.tiny and not args.driver:
        args = parser.parse_args(TINY_ARGS + argv)  # explicit arguments still win
    if not args.driver and (args.streams < 1 or args.rate <= 0 or args.work_ms <= 0 or args.seconds <= 0
                            or args.repeats < 1 or args.prompt_len < 1 or args.gen_len < 1):
        parser.error("--streams, --repeats, --prompt-len, --gen-len >= 1; --rate, --work-ms, --seconds > 0")
    return args


def _run_loop(coro: Any, loop: str) -> Any:
    if loop == "asyncio":
        return asyncio.run(coro)
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.driver:
        driver_main(args)
        return None
    from benchmarks.common import build_cpu_llama
    from benchmarks.measure import finish_report

    load_start = loadavg()
    if args.model_dir:
        model_dir = args.model_dir
    elif args.tiny:
        model_dir = str(tiny_model(args.work_dir))
    else:
        model_dir = str(build_cpu_llama())
    report: dict[str, Any] = {"benchmark": "W-HOST", "date": utc_now(),
                              "command": "python -m benchmarks.w_host " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
                              "settings": {k: getattr(args, k) for k in SETTINGS}}
    report.update(_run_loop(serve_and_measure(args, model_dir), args.loop))
    report["comparison"] = compare(report["host"], report["engine"])
    report["targets"] = TARGETS
    report["measurement"] = " ".join(__doc__.split("\n\n")[2:5]).replace("\n", " ")
    return finish_report(report, model_dir, load_start, args.json, print_table)


if __name__ == "__main__":
    main()
