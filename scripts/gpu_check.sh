#!/usr/bin/env bash
# The GPU checks of asyncllm in one run (under 8 minutes on an H100/H200-class machine):
#   1. the CUDA tests: Triton kernels against the torch reference on the GPU, the engine on the
#      kernels against transformers, CUDA-graph replays, greedy parity of every model family;
#   2. the W-GPU benchmark (benchmarks/w_gpu.py): asyncllm vs transformers continuous batching on
#      the same GPU, and the roofline ratio;
#   3. kernel micro-benchmarks (benchmarks/gpu_kernels.py), with whatever time is left;
#   with two GPUs or more, also TP=2 over NCCL (tests/test_tensor_parallel.py) after the CUDA tests.
#
# Usage: scripts/gpu_check.sh RESULTS_DIR
# Writes into RESULTS_DIR: env.json, pytest.log, pytest.xml, w_gpu.json, w_gpu.log,
# gpu_kernels.json, gpu_kernels.log and gpu_check.json (each phase's status and duration).
# Needs torch (CUDA), triton, transformers and pytest in $PYTHON (default python3); installs
# nothing: the repository is used in place through PYTHONPATH. No network is needed.
set -u -o pipefail

OUT=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOTAL_S=${GPU_CHECK_TOTAL_S:-470}    # hard ceiling for the whole script (the brief allows 480)
START=$SECONDS

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET   # the real kernels, not the interpreter

PHASES=()
record() {  # record NAME STATUS SECONDS
    PHASES+=("{\"phase\": \"$1\", \"status\": \"$2\", \"seconds\": $3}")
    echo "[gpu_check] $1: $2 (${3}s; ${SECONDS}s elapsed)"
}
left() { echo $((TOTAL_S - (SECONDS - START))); }

# 0. The machine and the versions in play; stop early without a GPU.
if ! "$PY" - >"$OUT/env.json" <<'EOF'
import json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
try:
    import triton; info["triton"] = triton.__version__
except ImportError as e:
    info["triton"] = f"missing: {e}"
try:
    import transformers; info["transformers"] = transformers.__version__
except ImportError as e:
    info["transformers"] = f"missing: {e}"
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                capability=f"{p.major}.{p.minor}")
print(json.dumps(info, indent=2))
raise SystemExit(0 if torch.cuda.is_available() else 3)
EOF
then
    cat "$OUT/env.json"
    echo "[gpu_check] no CUDA device (or torch missing): nothing to check" >&2
    exit 2
fi
cat "$OUT/env.json"

# run_logged LOG LINES OK_WORD KILL_S LIMIT_S CMD...: run CMD under a time limit with its output in LOG,
# show the log's last LINES lines, and set $status (OK_WORD, "timeout" or "failed (exit N)").
run_logged() {
    local log=$1 lines=$2 ok=$3 kill=$4 limit=$5 rc
    shift 5
    timeout -k "$kill" "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n "$lines" "$log"
    case $rc in 0) status=$ok ;; 124|137) status=timeout ;; *) status="failed (exit $rc)" ;; esac
}

# 1. CUDA tests. Without pytest in $PY, borrow the pure-Python test tools of a carried .venv.
if ! "$PY" -c "import pytest" 2>/dev/null; then
    for site in .venv/lib/python3*/site-packages; do
        [ -d "$site/_pytest" ] || continue
        deps=$(mktemp -d)
        for name in pytest _pytest pluggy iniconfig packaging pytest_timeout.py; do
            [ -e "$site/$name" ] && ln -s "$PWD/$site/$name" "$deps/$name"
        done
        export PYTHONPATH="$PYTHONPATH:$deps"
        break
    done
fi
t=$SECONDS
TESTS=(tests/test_kernels_attention.py tests/test_kernels_ops.py tests/test_triton_engine.py
       tests/test_cuda_graphs.py tests/test_parity.py)
if "$PY" -c "import pytest" 2>/dev/null; then
    run_logged "$OUT/pytest.log" 25 passed 10 170 \
        "$PY" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}" --junitxml="$OUT/pytest.xml"
else
    status="skipped: pytest is not installed in $PY"
fi
record tests "$status" $((SECONDS - t))

# 1b. Tensor parallelism over NCCL, on machines with two GPUs or more.
t=$SECONDS
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ] && "$PY" -c "import pytest" 2>/dev/null; then
    run_logged "$OUT/pytest_tp.log" 15 passed 10 120 \
        "$PY" -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py -k "tp2_greedy or shards"
else
    status="skipped: $gpus GPU(s); TP=2 over NCCL needs two"
fi
record tensor_parallel_nccl "$status" $((SECONDS - t))

# 2. W-GPU, keeping about 75 s for the kernel micro-benchmarks and the summary.
t=$SECONDS
budget=$(( $(left) - 75 ))
if [ "$budget" -gt 90 ]; then
    run_logged "$OUT/w_gpu.log" 15 ok 10 $((budget + 20)) \
        "$PY" -m benchmarks.w_gpu --out "$OUT" --budget-s "$budget"
else
    status="skipped: only ${budget}s left"
fi
record w_gpu "$status" $((SECONDS - t))

# 3. Kernel micro-benchmarks with the time that is left.
t=$SECONDS
budget=$(( $(left) - 10 ))
if [ "$budget" -gt 20 ]; then
    run_logged "$OUT/gpu_kernels.log" 30 ok 5 "$budget" "$PY" -m benchmarks.gpu_kernels --out "$OUT"
else
    status="skipped: only ${budget}s left"
fi
record gpu_kernels "$status" $((SECONDS - t))

joined=$(IFS=,; echo "${PHASES[*]}")
echo "{\"total_seconds\": $((SECONDS - START)), \"phases\": [$joined]}" >"$OUT/gpu_check.json"
cat "$OUT/gpu_check.json"
# Exit status: 0 only when the tests passed and W-GPU ran to the end.
grep -q '"phase": "tests", "status": "passed"' "$OUT/gpu_check.json" &&
    grep -q '"phase": "w_gpu", "status": "ok"' "$OUT/gpu_check.json"
