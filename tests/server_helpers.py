"""Helpers of the server tests: uvicorn in a background thread, a small PEFT adapter."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import uvicorn


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
