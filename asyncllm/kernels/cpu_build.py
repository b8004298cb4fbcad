"""Builds the CPU kernels in ``csrc/`` with the system C compiler, once per machine, and loads them.

Why not ``torch.utils.cpp_extension``: the kernels take raw pointers, so they need none of torch's
headers, and a plain C file compiles in well under a second instead of the half minute that
torch's headers cost. The library is loaded with ctypes.

The shared object is cached under ``$ASYNCLLM_CACHE_DIR`` (default ``~/.cache/asyncllm``), named by
a hash of the source, the compiler command and the CPU's feature flags (the code is built with
``-march=native``), so an edit or another machine gets a fresh build. Builds write to a temporary
file and rename it, so concurrent processes never load a half-written library.
If no compiler is found or the build fails, :func:`load_library` returns ``None`` (and says why in
the log once); callers fall back to the torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ENV_SWITCH = "ASYNCLLM_CPU_KERNELS"
# -ffp-contract=off: GCC would otherwise fuse a*b+c into one rounding where torch rounds twice (the
# explicit AVX-512 FMAs in paged_decode.c are deliberate: SDPA sums in its own order anyway).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
          "-shared", "-fPIC"]
_LIBS = ["-lmvec", "-lm"]


class BuildError(RuntimeError):
    """The C compiler could not build a CPU kernel library."""


def cache_dir() -> Path:
    root = os.environ.get("ASYNCLLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "asyncllm"


def enabled() -> bool:
    """False when ``ASYNCLLM_CPU_KERNELS=0`` asks for the torch reference path on CPU."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def build(name: str) -> Path:
    """Compile ``csrc/<name>.c`` into the cache (if not there yet) and return the library's path."""
    compiler = _compiler()
    if compiler is None:
        raise BuildError("no C compiler found (set CC, or install gcc)")
    source = CSRC / f"{name}.c"
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))  # headers too
    key = hashlib.sha256(b"\0".join([text, " ".join([compiler, *_FLAGS, *_LIBS]).encode(), _cpu_flags().encode()]))
    filename = f"{name}-{key.hexdigest()[:16]}.so"
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"asyncllm-kernels-{os.getuid()}"):
        target = folder / filename
        if target.exists():
            return target
        try:  # a read-only home (some containers) falls back to the temporary directory
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=folder)
            break
        except OSError as e:
            logger.info("cannot build CPU kernels in %s (%s)", folder, e)
    else:
        raise BuildError(f"no writable folder for the CPU kernels (tried {cache_dir()} and the temporary directory)")
    os.close(fd)
    command = [compiler, *_FLAGS, "-o", tmp, str(source), *_LIBS]
    try:
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except OSError as e:
            raise BuildError(f"cannot run the C compiler {compiler!r}: {e}") from e
        if done.returncode != 0:
            raise BuildError(f"{' '.join(command)} failed:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built CPU kernels %s", target)
    return target


# (function name, ctypes argument types, ctypes result type or None) for each exported function
Signatures = tuple[tuple[str, tuple[Any, ...], Any], ...]


@functools.lru_cache(maxsize=None)
def load_library(name: str, signatures: Signatures = ()) -> ctypes.CDLL | None:
    """The kernel library ``name``, built if needed, with its functions' ctypes ``signatures`` set;
    ``None`` when it cannot be built here."""
    if not enabled():
        return None
    import torch  # noqa: F401 - load torch's OpenMP runtime first, so the kernels share its thread pool

    try:
        lib = ctypes.CDLL(str(build(name)))
    except (BuildError, OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable, using the torch path instead: %s", e)
        return None
    return _with_signatures(lib, signatures)


def _with_signatures(lib: ctypes.CDLL, signatures: Signatures) -> ctypes.CDLL:
    for function, argtypes, restype in signatures:
        getattr(lib, function).argtypes = list(argtypes)
        getattr(lib, function).restype = restype
    return lib


def build_variant(name: str, flags: list[str], out: Path, signatures: Signatures = ()) -> ctypes.CDLL:
    """``csrc/<name>.c`` compiled with exactly ``flags`` into ``out`` (not cached) and loaded: how the
    tests build the ISA levels other machines get (no AVX-512, no AVX2). Raises BuildError."""
    compiler = _compiler()
    if compiler is None:
        raise BuildError("no C compiler found (set CC, or install gcc)")
    done = subprocess.run([compiler, *flags, "-o", str(out), str(CSRC / f"{name}.c"), *_LIBS],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise BuildError(f"cannot build {name} with {flags}: {done.stderr[-300:]}")
    return _with_signatures(ctypes.CDLL(str(out)), signatures)
