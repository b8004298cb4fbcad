"""The Triton kernels compile for a Hopper GPU (sm_90), GPU or not: the real compiler down to
ptxas (shipped with triton) catches what the interpreter cannot (typing, tensor-core shapes,
shared memory). It runs in a subprocess because this session's kernels are interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOPPER_SHARED_MEMORY = 227 * 1024  # per block


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "compile_kernels.py")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    kernels = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(kernels) == 15
    assert all(k["divisible_args"] >= 3 for k in kernels), kernels  # compiled as launched: aligned pointers
    assert all(k["shared"] <= HOPPER_SHARED_MEMORY for k in kernels), kernels
