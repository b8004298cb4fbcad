"""Serve an ASGI app with uvicorn on 127.0.0.1 (a free port) in a background thread, for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
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
