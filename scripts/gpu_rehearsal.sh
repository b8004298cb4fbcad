#!/usr/bin/env bash
# Rehearse scripts/gpu_check.sh on a CPU machine, in a venv that matches the GPU machine's image:
# python 3.12, torch 2.11, triton 3.6, transformers 5.17, and no package that image lacks
# (scripts/gpu_image_packages.txt; pydantic and llguidance are not there). Then:
#   1. the preflight without its GPU checks (imports, pytest);
#   2. every CUDA test collects (scripts/gpu_tests.txt, and the TP=2 tests gpu_check.sh runs on two GPUs);
#   3. those tests run, the Triton kernels in triton 3.6's interpreter, and the kernels compile for
#      sm_90 with triton 3.6's compiler (tests/test_kernels_compile.py);
#   4. W-GPU's driver end to end (`benchmarks.w_gpu --smoke`), its transformers 5.17 peer included.
#
# Usage: scripts/gpu_rehearsal.sh [RESULTS_DIR]     (default: a temporary directory)
# The venv is built once (about 5 GB: PyPI's torch 2.11 is a CUDA build, with its CUDA libraries)
# under $GPU_REHEARSAL_VENV (default ~/.cache/asyncllm/gpu-image-venv), outside the repository;
# later runs reuse it. Needs a python3.12 (found on PATH or under pyenv) and PyPI. Exit status:
# 0 passed; 1 a step failed; 3 could not run here (no python3.12, no room, no PyPI), with the reason.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
VENV=${GPU_REHEARSAL_VENV:-$HOME/.cache/asyncllm/gpu-image-venv}
PINS="torch==2.11.0 triton==3.6.0 transformers==5.17.0"
# what asyncllm and its tests import, all of them on the image (versions as pip picks them). numpy
# below 2.4: the image has 2.5.2, where the kernels are compiled, but triton 3.6's interpreter (used
# here) turns 1-element arrays into ints, which numpy 2.4 and later refuse ("only 0-dimensional arrays ...").
EXTRA="numpy<2.4 safetensors tokenizers huggingface-hub anyio httpx tqdm jinja2 pytest pytest-timeout hypothesis
prometheus-client psutil pyyaml regex"
START=$SECONDS

skip() { echo "[gpu_rehearsal] CANNOT RUN HERE: $*"; exit 3; }
step() { echo "[gpu_rehearsal] $* (${SECONDS}s)"; }

find_python312() {
    local candidate
    for candidate in "${GPU_REHEARSAL_PYTHON:-}" "$(command -v python3.12 2>/dev/null)" \
                     "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
        [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' \
            2>/dev/null && { echo "$candidate"; return 0; }
    done
    return 1
}

STAMP="$VENV/.rehearsal-$(echo "$PINS $EXTRA" | md5sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
    PY312=$(find_python312) || skip "no python3.12 on this machine (set GPU_REHEARSAL_PYTHON)"
    mkdir -p "$(dirname "$VENV")"
    free_gb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')
    [ "$free_gb" -ge 12 ] || skip "only ${free_gb} GB free under $(dirname "$VENV"); the venv needs about 12 GB while it installs"
    step "building $VENV with $PY312 ($PINS)"
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV" || skip "python3.12 cannot make a venv"
    # shellcheck disable=SC2086
    if ! "$VENV/bin/pip" install -q --no-cache-dir --disable-pip-version-check $PINS $EXTRA >"$OUT/install.log" 2>&1; then
        tail -5 "$OUT/install.log"
        rm -rf "$VENV"
        skip "pip could not install the GPU image's versions (see $OUT/install.log)"
    fi
    # Prune to the image: whatever the three pulled in that the image lacks (pydantic, ...) goes.
    # (-I: not this checkout's asyncllm.egg-info, which is not a package of the venv)
    extras=$("$VENV/bin/python" -I - "$PWD/scripts/gpu_image_packages.txt" <<'PYEOF'
import re, sys
from importlib.metadata import distributions
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
allowed = {norm(line.strip()) for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")}
allowed |= {"pip", "setuptools", "wheel"}
print(" ".join(sorted({norm(d.metadata["Name"]) for d in distributions()} - allowed)))
PYEOF
)
    if [ -n "$extras" ]; then
        step "removing packages the GPU image does not have: $extras"
        # shellcheck disable=SC2086
        (cd / && "$VENV/bin/pip" uninstall -q -y $extras) >>"$OUT/install.log" 2>&1
    fi
    touch "$STAMP"
fi
PY="$VENV/bin/python"
"$PY" -c "import torch, triton, transformers; print('[gpu_rehearsal] python', __import__('platform').python_version(), \
'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

export PYTHONPATH="$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mapfile -t TESTS < <(grep -v '^#' scripts/gpu_tests.txt)
failed=()

step "1. preflight (no GPU checks)"
"$PY" scripts/gpu_preflight.py "$OUT" --no-gpu || failed+=(preflight)

step "2. the CUDA tests collect"
if "$PY" -m pytest -q -p no:cacheprovider --collect-only "${TESTS[@]}" tests/test_tensor_parallel.py \
        >"$OUT/collect.log" 2>&1; then
    tail -1 "$OUT/collect.log"
else
    tail -20 "$OUT/collect.log"; failed+=(collect)
fi

step "3. the CUDA tests, interpreted, and the sm_90 compile check"
if TRITON_INTERPRET=1 timeout -s INT -k 20 1200 "$PY" -m pytest -q -p no:cacheprovider -rs --timeout=600 \
        "${TESTS[@]}" tests/test_kernels_compile.py --junitxml="$OUT/pytest.xml" >"$OUT/pytest.log" 2>&1; then
    tail -1 "$OUT/pytest.log"
else
    tail -30 "$OUT/pytest.log"; failed+=(tests)
fi

step "4. W-GPU --smoke on transformers $("$PY" -c 'import transformers; print(transformers.__version__)')"
if timeout -k 10 600 "$PY" -m benchmarks.w_gpu --smoke --out "$OUT" >"$OUT/w_gpu.log" 2>&1 &&
        "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); assert 'errors' not in d, d['errors']; \
assert d['hf_continuous_batching']['tokens'] > 0 and d['asyncllm']['tokens_per_s'] > 0" "$OUT/w_gpu.json"; then
    tail -1 "$OUT/w_gpu.log"
else
    tail -20 "$OUT/w_gpu.log"; failed+=(w_gpu_smoke)
fi

if [ ${#failed[@]} -eq 0 ]; then
    echo "[gpu_rehearsal] SUMMARY: passed in $((SECONDS - START))s (results in $OUT)"
    exit 0
fi
echo "[gpu_rehearsal] SUMMARY: FAILED: ${failed[*]} ($((SECONDS - START))s; logs in $OUT)"
exit 1
