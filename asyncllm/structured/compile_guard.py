"""Compiling each new grammar in a child process first, so a grammar-engine crash costs one request.

llguidance compiles in native code; a grammar it cannot handle can overflow its stack (SIGSEGV)
or run for too long, and in the host that would take every request down with it. limits.py
refuses the shapes known to do that; this guard covers the ones nobody knows about yet. On a
cache miss the compiler hands the job to :meth:`CompileGuard.check`, which runs the same compile
(compile_child.py) in one of a few child processes: a compile error there is the request's 400;
a child that dies (a signal, end of file) or overruns ``time_limit`` is killed and replaced, and
the request is a 400 that says so; only a grammar that compiled there is compiled in the host
(compilation is deterministic, and the child compiles on half the host's stack, so what
overflows the host overflows the child first).

Children are fresh interpreters (``subprocess`` running compile_child.py by path): the host has
threads, so forking is unsafe, and multiprocessing's spawn would re-import the host's
``__main__`` and the asyncllm package (torch: seconds) in every child. They start lazily, on the
first job, and end with :meth:`close`, at interpreter exit, or when the host dies (their socket
reaches end of file). ``ASYNCLLM_GRAMMAR_GUARD=0`` turns the guard off (compiles stay in process),
for hosts that cannot start processes; a host where a child cannot start logs a warning and
compiles in process from then on.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from ..errors import InvalidRequestError

logger = logging.getLogger(__name__)

TIME_LIMIT_S = 10.0      # one compile in a child; far above any real grammar (tens of ms)
START_TIMEOUT_S = 60.0   # a child's start-up: interpreter, llguidance, tokenizer (large vocabularies: ~1 s)
MAX_CHILDREN = 2         # started as concurrent compiles need them
REFUSED_CACHE_SIZE = 64  # grammars that crashed or overran: refused again without a new child
ENV_SWITCH = "ASYNCLLM_GRAMMAR_GUARD"
_CHILD_SCRIPT = str(Path(__file__).with_name("compile_child.py"))
_CRASH = "the grammar engine crashed compiling it; the request was refused"
_TIMEOUT = "the grammar engine took longer than {:g} s compiling it; the request was refused"


def guard_enabled() -> bool:
    """False where ``ASYNCLLM_GRAMMAR_GUARD`` is 0 / false / off / no."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def tokenizer_json(hf_tokenizer: Any) -> str:
    """A fast Hugging Face tokenizer as the JSON that ``llguidance.LLTokenizer`` reads, without
    padding or truncation (they would change how llguidance tokenizes); ValueError for a slow one."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured output needs a fast (Rust) tokenizer")
    backend = copy.copy(backend)  # a new Rust tokenizer: the host's keeps its settings
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def child_stack_size() -> int:
    """Half the stack the host's threads get (``threading.stack_size()``, else the platform's
    default: on Linux the soft RLIMIT_STACK, glibc's rule), at least 256 KiB."""
    size = threading.stack_size()
    if not size:
        size = 1 << 20  # elsewhere, a conservative guess
        if sys.platform.startswith("linux"):
            import resource

            soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
            size = soft if 0 < soft != resource.RLIM_INFINITY else 2 << 20  # unlimited: glibc's 2 MiB
    return max(size // 2, 256 << 10)


class _Child:
    """One child process and the host's end of its socket; used by one thread at a time."""

    def __init__(self, init_message: tuple) -> None:
        if not sys.executable:
            raise OSError("sys.executable is not set (an embedded interpreter)")
        host_end, child_end = socket.socketpair()
        try:
            # a new session: a Ctrl-C in the terminal is for the host, not for its compiles
            self.proc = subprocess.Popen([sys.executable, _CHILD_SCRIPT, str(child_end.fileno())],
                                         pass_fds=(child_end.fileno(),), stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except BaseException:
            host_end.close()
            raise
        finally:
            child_end.close()
        self.conn = Connection(host_end.detach())
        self.ready = False
        try:
            self.conn.send(init_message)  # the child reads it as soon as it runs
        except BaseException:
            self.kill()
            raise

    def wait_ready(self, timeout: float) -> None:
        """Block until the child has built its tokenizer; OSError if it does not come up."""
        if self.ready:
            return
        if not self.conn.poll(timeout):
            raise OSError(f"no answer within {timeout:g} s")
        try:
            kind, _ = self.conn.recv()
        except (EOFError, OSError):
            raise OSError(f"it exited with status {self.proc.wait()}") from None
        if kind != "ready":
            raise OSError(f"unexpected first message {kind!r}")
        self.ready = True

    def kill(self) -> None:
        """Kill, reap (no zombie) and close the socket; safe to call twice."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.conn.close()


class CompileGuard:
    """A small pool of child processes that compile each new grammar before the host does.

    ``tokenizer_json``, ``n_vocab`` and ``eos`` build the host's llguidance tokenizer in each child.
    :meth:`check` is thread-safe and blocks its caller (AsyncLLM's input workers, never the event
    loop) for the compile's duration plus about a millisecond; a child's start-up, on first use.
    """

    def __init__(self, tokenizer_json: str, n_vocab: int, eos: list[int] | int | None,
                 time_limit: float = TIME_LIMIT_S, max_children: int = MAX_CHILDREN,
                 start_timeout: float = START_TIMEOUT_S) -> None:
        self.time_limit = time_limit
        self.max_children = max_children
        self.start_timeout = start_timeout
        self.crashes = 0      # children lost to a signal or an unexpected exit during a job
        self.timeouts = 0     # children killed for overrunning time_limit
        self.disabled = ""    # why the guard gave up (a child could not start); "" while it works
        self._init = ("init", list(sys.path), tokenizer_json, n_vocab, eos, child_stack_size())
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self._starting = 0  # children being started outside the lock
        self._cond = threading.Condition()
        self._closed = False
        self._refused: OrderedDict[bytes, str] = OrderedDict()

    def check(self, kind: str, args: tuple, field: str) -> None:
        """Compile ``(kind, args)`` (compile_child.build_grammar's jobs) in a child. Returns if it
        compiled; InvalidRequestError naming ``field`` if the grammar engine refused it, crashed
        on it or overran the time limit. Returns too once it is closed or disabled (no child could
        start): the host's own compile then decides, as without a guard."""
        error = self._run(pickle.dumps(("compile", kind, args)), field)
        if error:
            raise InvalidRequestError(f"{field}: {error}", field=field)

    def call(self, fn: Callable[..., Any], *args: Any, field: str = "grammar") -> Any:
        """Run ``fn(*args)`` in a child under the same rules (``fn`` must be importable there, e.g.
        from the standard library): the guard's own tests crash and hang children with it."""
        return self._run(pickle.dumps(("call", fn, args)), field)

    def children(self) -> list[int]:
        """Process ids of the live children (for tests and diagnostics)."""
        with self._cond:
            return [child.proc.pid for child in self._all]

    def close(self) -> None:
        """Kill every child and wait for it; later checks compile nothing here. Idempotent."""
        with self._cond:
            self._closed = True
            children, self._idle = list(self._all), []
            self._all.clear()
            self._cond.notify_all()
        for child in children:
            child.kill()

    # ---- internals ------------------------------------------------------------------------------
    def _run(self, payload: bytes, field: str) -> Any:
        key = hashlib.blake2b(payload, digest_size=16).digest()
        with self._cond:
            refused = self._refused.get(key)
        if refused is not None:
            raise InvalidRequestError(f"{field}: {refused}", field=field)
        for _ in range(3):
            child = self._acquire()
            if child is None:  # off, closed, or no child could start: the host compiles on its own
                return None
            # one that died while idle (killed from outside) is replaced, not blamed on this job; its
            # exit is checked first because the kernel may close its socket only a moment later
            try:
                if child.proc.poll() is None:
                    child.conn.send_bytes(payload)
                    break
            except OSError:
                pass
            self._drop(child)
        else:
            self._give_up("compile children keep dying while idle")
            return None
        start = time.monotonic()
        try:
            answered = child.conn.poll(self.time_limit)
            if answered:
                status, value = child.conn.recv()
        except (EOFError, OSError):
            if self._closed:  # close() killed it under us: not the grammar's doing
                return None
            self._lose(child, key, "crash", time.monotonic() - start)
            raise InvalidRequestError(f"{field}: {_CRASH}", field=field) from None
        except BaseException:  # (KeyboardInterrupt in a caller's thread) its slot must not stay taken
            self._drop(child)
            raise
        if not answered:
            self._lose(child, key, "timeout", time.monotonic() - start)
            raise InvalidRequestError(f"{field}: {_TIMEOUT.format(self.time_limit)}", field=field)
        self._release(child)
        if status == "raised":  # a Python exception: the host's compile raises it too, as without the guard
            logger.debug("grammar guard: the child raised %s", value)
            return None
        return value

    def _acquire(self) -> _Child | None:
        """An idle child, a new one while fewer than ``max_children`` exist, else wait for one."""
        with self._cond:
            while True:
                if self._closed or self.disabled:
                    return None
                if self._idle:
                    return self._idle.pop()
                if len(self._all) + self._starting < self.max_children:
                    self._starting += 1
                    break
                self._cond.wait()
        child = None
        try:  # outside the lock: other threads keep using the children that are up
            child = _Child(self._init)
            child.wait_ready(self.start_timeout)
        except (OSError, ValueError) as exc:  # (ValueError: a platform without pass_fds)
            if child is not None:
                child.kill()
            self._give_up(f"a compile child could not start ({exc})")
            return None
        finally:
            with self._cond:
                self._starting -= 1
                if child is not None and child.ready and not self._closed:
                    self._all.add(child)
                self._cond.notify_all()
        if self._closed:
            child.kill()
            return None
        return child

    def _release(self, child: _Child) -> None:
        with self._cond:
            if self._closed or child not in self._all:
                closed = True
            else:
                closed = False
                self._idle.append(child)
                self._cond.notify()
        if closed:
            child.kill()

    def _drop(self, child: _Child) -> None:
        child.kill()
        with self._cond:
            self._all.discard(child)
            self._cond.notify_all()

    def _lose(self, child: _Child, key: bytes, why: str, seconds: float) -> None:
        """A child that crashed or overran: killed and reaped, its job remembered as refused; the
        next job starts a new child in its place."""
        self._drop(child)
        with self._cond:
            if why == "timeout":
                self.timeouts += 1
                self._refused[key] = _TIMEOUT.format(self.time_limit)
            else:
                self.crashes += 1
                self._refused[key] = _CRASH
            while len(self._refused) > REFUSED_CACHE_SIZE:
                self._refused.popitem(last=False)
        status = child.proc.returncode
        logger.warning("grammar guard: compile child %d %s after %.2f s (exit status %s, %s); the request was "
                       "refused and a new child will take its place", child.proc.pid,
                       "overran the time limit" if why == "timeout" else "died", seconds, status,
                       _describe_status(status))

    def _give_up(self, reason: str) -> None:
        with self._cond:
            if not self.disabled:
                self.disabled = reason
                logger.warning("grammar guard: %s; grammars are compiled in this process from now on "
                               "(set %s=0 to skip the guard)", reason, ENV_SWITCH)
            self._cond.notify_all()


def _describe_status(status: int | None) -> str:
    if status is not None and status < 0:
        try:
            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return "exited" if status is not None else "running"
