"""One grammar compile, as the host does it and as the compile guard's child processes do it.

The host imports :func:`compile_grammar` for its own compile; a child process runs this file as a
script (``python compile_child.py FD``, see compile_guard.py) and calls the same function on the
jobs the host sends, so the child compiles exactly what the host is about to compile. The module
imports nothing from asyncllm: importing the package would bring torch into every child (seconds
of start-up); only the standard library and llguidance are needed here.

Protocol, over one socket (``multiprocessing.connection`` framing, pickled tuples):
``("init", sys_path, tokenizer_json, n_vocab, eos, stack_size)`` -> ``("ready", pid)``, then per job
``("compile", kind, args)`` or ``("call", fn, args)`` -> ``("ok", error_or_result)`` or
``("raised", text)``. The child exits when the host closes its end (or dies).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # run as a script, this file's directory is sys.path[0]: its neighbours (schema.py, state.py...)
    # must not shadow modules of the same name
    del sys.path[0]

import pickle
import queue
import threading
from typing import Any

KINDS = ("json_schema", "regex", "lark")


def build_grammar(kind: str, args: tuple) -> str:
    """llguidance's grammar for a job: ``("json_schema", (schema_json, options))``, ``("regex",
    (regex,))`` or ``("lark", (lark,))``. Raises ValueError/TypeError for a malformed source."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        schema, options = args
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(args[0])
    if kind == "lark":
        return LLMatcher.grammar_from_lark(args[0])
    raise ValueError(f"unknown grammar kind {kind!r}")


def compile_grammar(tokenizer: Any, kind: str, args: tuple) -> tuple[Any, str, str]:
    """``(matcher, grammar, "")`` for a grammar that compiles, ``(None, grammar, error)`` for one
    the grammar engine refuses (the error's first lines: its source excerpt is left out)."""
    from llguidance import LLMatcher

    try:
        grammar = build_grammar(kind, args)
    except (ValueError, TypeError) as exc:
        return None, "", str(exc)
    # llguidance compiles in the constructor (without the GIL) and reports errors, not raises
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return None, grammar, first_line(matcher.get_error())
    return matcher, grammar, ""


def first_line(message: str) -> str:
    """llguidance's errors end with a source excerpt; the first lines say what is wrong."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return " ".join(lines[:3]) if lines else "invalid grammar"


def _check(tokenizer: Any, kind: str, args: tuple) -> str:
    """The host's compile, and the first mask the host computes on the result (its emptiness
    check): native code on both, so both run here first. The error, or "" if it compiles."""
    matcher, _, error = compile_grammar(tokenizer, kind, args)
    if matcher is not None:
        matcher.compute_bitmask()
    return error


def _serve(conn, tokenizer: Any, jobs: "queue.Queue[bytes]") -> None:
    """The compile thread: one job at a time, each answered before the next is read."""
    while True:
        job = pickle.loads(jobs.get())
        try:
            if job[0] == "compile":
                reply = ("ok", _check(tokenizer, job[1], job[2]))
            else:  # ("call", fn, args): any importable callable (the guard's tests crash and hang with it)
                reply = ("ok", job[1](*job[2]))
        except BaseException as exc:  # noqa: BLE001 - a Python error is the host's to raise, not ours
            reply = ("raised", f"{type(exc).__name__}: {exc}")
        conn.send(reply)


def main(fd: int) -> None:
    """Read the init message, build the tokenizer, then compile until the host goes away."""
    from multiprocessing.connection import Connection

    conn = Connection(fd)
    _, sys_path, tokenizer_json, n_vocab, eos, stack_size = conn.recv()
    sys.path.extend(p for p in sys_path if p not in sys.path)  # where the host finds llguidance
    import llguidance

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
    jobs: queue.Queue[bytes] = queue.Queue()
    # compiles recurse on the native stack: give them a smaller one than the host's threads have,
    # so what would overflow the host overflows here first
    threading.stack_size(stack_size)
    threading.Thread(target=_serve, args=(conn, tokenizer, jobs), daemon=True).start()
    conn.send(("ready", os.getpid()))
    while True:  # this thread only reads: end of file (host closed or died) ends the process at once
        try:
            jobs.put(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
