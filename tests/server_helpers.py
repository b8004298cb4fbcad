"""Helpers of the server tests: in-process requests, uvicorn in a background thread, ``asyncllm serve``
in a child process, a small PEFT adapter."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import uvicorn
from ports import free_port  # noqa: F401 - the server tests import it from here


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    """One request to an ASGI app in this process (httpx's ASGI transport)."""
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    """The response is an OpenAI-shaped error with this status (and ``param``, when given)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def start_serve(model: str, *args: str, env: dict | None = None, timeout: float = 60) -> tuple[subprocess.Popen, str]:
    """``asyncllm serve MODEL --port P ARGS...`` in a child process, once /health answers 200;
    returns the process (stdout and stderr merged, as text) and its base URL. A child that lost its
    port to another process between our check and its bind is started again on another port."""
    for attempt in range(3):
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "asyncllm.cli", "serve", model, "--port", str(port), *args],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                output = proc.communicate()[0]
                if attempt < 2 and ("Failed to bind" in output or "address already in use" in output.lower()):
                    break
                raise AssertionError(f"server did not start: {output[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    return proc, base
            except httpx.TransportError:
                time.sleep(0.1)
    raise AssertionError("server did not start")  # unreachable: the last attempt raises above


@contextlib.contextmanager
def serve_in_thread(app, timeout: float = 10.0) -> Iterator[str]:
    """Yield the server's base URL (``http://127.0.0.1:PORT``); shut it down on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # port 0: the OS picks a free one, and we hold it from now on
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
        sock.close()


def build_test_adapter(base_dir: Path, out_dir: Path, seed: int = 3) -> Path:
    """A rank-4 PEFT LoRA adapter (q/v) for ``base_dir`` whose greedy text differs from the base."""
    import torch
    from peft import LoraConfig, get_peft_model

    from checkpoints import load_reference_model

    torch.manual_seed(seed)
    model = get_peft_model(load_reference_model(base_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.mul_(3.0)  # large enough to change greedy tokens
    model.save_pretrained(out_dir)
    return out_dir
