"""Preflight of scripts/gpu_check.sh: is this environment able to run the GPU checks? In seconds.

    python scripts/gpu_preflight.py OUT_DIR [--no-gpu]

Writes OUT_DIR/env.json (versions, device, every check's result) and exits 0 when every check
passed, else 2 after printing the first failure's reason on one line. ``--no-gpu`` skips the
checks that need a CUDA device (the GPU-image rehearsal on a CPU machine runs it so).

Checks, in order: torch, triton and transformers import; asyncllm imports from this checkout
(``import asyncllm`` and the modules the CUDA tests use); pytest is importable; a CUDA device is
there; one tiny Triton kernel compiles and runs on it and matches torch; the output directory is
writable with room for the results.
"""

from __future__ import annotations

import importlib
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ["asyncllm", "asyncllm.kernels.triton_attention", "asyncllm.kernels.elementwise",
           "asyncllm.model.cuda_graphs", "asyncllm.toy.checkpoints", "benchmarks.w_gpu", "benchmarks.gpu_kernels"]


def _versions() -> dict:
    info = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers", "pytest", "numpy", "safetensors", "tokenizers"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            info[name] = f"missing: {type(exc).__name__}: {exc}"
    for name in ("llguidance", "pydantic", "starlette"):  # optional on the GPU image
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception:  # noqa: BLE001
            info[name] = "absent (optional here)"
    return info


def _check_imports() -> str:
    sys.path.insert(0, str(REPO))
    for name in MODULES:
        importlib.import_module(name)
    return f"{len(MODULES)} modules"


def _check_pytest() -> str:
    import pytest

    return pytest.__version__


def _check_cuda() -> str:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device (cuda build: {torch.version.cuda})")
    p = torch.cuda.get_device_properties(0)
    return f"{p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"


def _check_triton_kernel() -> str:
    import torch

    from asyncllm.kernels.elementwise import silu_and_mul

    gate, up = torch.randn(2, 8, 64, device="cuda", dtype=torch.bfloat16).unbind(0)
    t0 = time.perf_counter()
    out = silu_and_mul(gate, up)
    torch.cuda.synchronize()
    expected = torch.nn.functional.silu(gate.float()) * up.float()
    error = (out.float() - expected).abs().max().item()
    if error > 0.05:
        raise RuntimeError(f"silu_and_mul differs from torch by {error}")
    return f"compiled and ran in {time.perf_counter() - t0:.1f}s, max error {error:.3g}"


def _check_output(out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    probe = out / ".write-test"
    probe.write_text("ok")
    probe.unlink()
    free = shutil.disk_usage(out).free / 2**30
    if free < 1:
        raise RuntimeError(f"only {free:.1f} GiB free under {out}")
    return f"{free:.0f} GiB free"


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__)
        return 2
    out, no_gpu = Path(argv[0]), "--no-gpu" in argv
    checks = [("output", lambda: _check_output(out)), ("imports", _check_imports), ("pytest", _check_pytest)]
    if not no_gpu:
        checks += [("cuda", _check_cuda), ("triton_kernel", _check_triton_kernel)]
    info = {"versions": _versions(), "checks": {}}
    failure = None
    for name, check in checks:
        try:
            info["checks"][name] = {"ok": True, "detail": check()}
        except Exception as exc:  # noqa: BLE001 - every failure becomes a one-line reason
            info["checks"][name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()[-3000:]}
            failure = f"preflight failed at {name}: {type(exc).__name__}: {exc}"
            break
    out.mkdir(parents=True, exist_ok=True)
    (out / "env.json").write_text(json.dumps(info, indent=2))
    print(json.dumps({k: v for k, v in info["versions"].items()}))
    for name, result in info["checks"].items():
        print(f"[preflight] {name}: {'ok' if result['ok'] else 'FAILED'} ({result['detail']})")
    if failure:
        print(f"[preflight] {failure}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
