"""The GPU machine's image is a supported target (scripts/gpu_check.sh must work the first time).

That image has torch, triton and transformers but neither the grammar engine (llguidance) nor
pydantic. Here: asyncllm imports and generates without them, and structured output then fails
with a clear error instead of an ImportError at ``import asyncllm``. The full rehearsal, a venv
with the image's versions (scripts/gpu_rehearsal.sh), is marked ``gpu_image``: `make gpu-rehearsal`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Python run in a subprocess where importing llguidance or pydantic fails, as on the GPU image.
WITHOUT_OPTIONAL = r'''
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("llguidance", "pydantic", "pydantic_core"):
            raise ImportError(f"No module named {name!r} (absent on the GPU image)")
sys.meta_path.insert(0, Absent())

import asyncllm
from asyncllm import LLM, SamplingParams, InvalidRequestError
assert "pydantic" not in sys.modules and "llguidance" not in sys.modules
llm = LLM(sys.argv[1], dtype="float32", device="cpu")
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 3
for params in (dict(json_schema={"type": "object"}), dict(regex="[ab]+"), dict(grammar='start: "x"')):
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, **params))
    except InvalidRequestError as exc:
        assert "llguidance" in str(exc), exc
    else:
        raise AssertionError(f"{params} was accepted without a grammar engine")
print("OK")
'''


def test_asyncllm_runs_without_the_grammar_engine_and_pydantic(llama_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", WITHOUT_OPTIONAL, str(llama_dir)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


@pytest.mark.gpu_image
def test_gpu_image_rehearsal(tmp_path):
    """scripts/gpu_rehearsal.sh: import, collection, interpreted CUDA tests and W-GPU's smoke run on
    python 3.12 / torch 2.11 / triton 3.6 / transformers 5.17 with only the image's packages."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_rehearsal.sh"), str(tmp_path)], capture_output=True,
                          text=True, timeout=3000)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
