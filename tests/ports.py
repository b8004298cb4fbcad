"""A free local port for a child process to bind (no server imports: the GPU image's tests use it too)."""

from __future__ import annotations

import random
import socket


def free_port() -> int:
    """A free port outside both the kernel's ephemeral range (32768-60999) and Ray's worker ports
    (10002-19999): a port the OS hands out for port 0 can be taken again by any process's outgoing
    connection, or by one of Ray's workers, before the child binds it."""
    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")
