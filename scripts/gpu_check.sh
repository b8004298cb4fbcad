#!/usr/bin/env bash
# The GPU checks of asyncllm in one run, under 8 minutes on an H100/H200-class machine:
#   0. preflight (scripts/gpu_preflight.py, seconds): versions, `import asyncllm`, pytest, the CUDA
#      device, one Triton kernel compiled and run; stops at once, with the reason, if any fails;
#   1. the CUDA tests: Triton kernels against the torch reference on the GPU, the engine on the
#      kernels against transformers, CUDA-graph replays, greedy parity, host syncs per step;
#   2. the W-GPU benchmark (benchmarks/w_gpu.py): asyncllm vs transformers continuous batching on
#      the same GPU, and the roofline ratio;
#   3. kernel micro-benchmarks (benchmarks/gpu_kernels.py), with whatever time is left;
#   with two GPUs or more, also TP=2 over NCCL (tests/test_tensor_parallel.py) after the CUDA tests.
#
# Usage: scripts/gpu_check.sh RESULTS_DIR
# Writes into RESULTS_DIR: env.json, pytest.log, pytest.xml, w_gpu.json, w_gpu.log,
# gpu_kernels.json, gpu_kernels.log and gpu_check.json (each phase's status and duration), each as
# soon as its phase ends (pytest.xml even when the phase runs out of time: pytest is interrupted,
# not killed; w_gpu.json after set-up and after every run). The last line is a one-line summary.
# Needs torch (CUDA), triton, transformers and pytest in $PYTHON (default python3); installs
# nothing: the repository is used in place through PYTHONPATH. No network is needed. A missing
# grammar engine (llguidance) or pydantic only disables what needs them (structured output, the
# server), which these checks do not use. scripts/gpu_rehearsal.sh replays this environment on a CPU.
set -u -o pipefail

OUT=${1:?usage: scripts/gpu_check.sh RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOTAL_S=${GPU_CHECK_TOTAL_S:-450}    # hard ceiling for the whole script (8 minutes allowed)
TESTS_S=${GPU_CHECK_TESTS_S:-200}    # the CUDA tests' phase
START=$SECONDS

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET   # the real kernels, not the interpreter
# CUDA test engines default to 16 sequences (5 graph buckets to capture, not 9: tests/conftest.py)
export ASYNCLLM_TEST_MAX_NUM_SEQS=${ASYNCLLM_TEST_MAX_NUM_SEQS:-16}

PHASES=()
record() {  # record NAME STATUS SECONDS
    PHASES+=("{\"phase\": \"$1\", \"status\": \"$2\", \"seconds\": $3}")
    echo "[gpu_check] $1: $2 (${3}s; ${SECONDS}s elapsed)"
    write_summary
}
write_summary() {
    local joined
    joined=$(IFS=,; echo "${PHASES[*]}")
    echo "{\"total_seconds\": $((SECONDS - START)), \"phases\": [$joined]}" >"$OUT/gpu_check.json"
}
left() { echo $((TOTAL_S - (SECONDS - START))); }

# run_logged LOG LINES OK_WORD LIMIT_S CMD...: run CMD under a time limit with its output in LOG,
# show the log's last LINES lines, and set $status (OK_WORD, "timeout" or "failed (exit N)").
# At the limit CMD gets SIGINT first (pytest then writes its junit file and summary), SIGKILL 20 s later.
run_logged() {
    local log=$1 lines=$2 ok=$3 limit=$4 rc
    shift 4
    timeout -s INT -k 20 "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n "$lines" "$log"
    case $rc in 0) status=$ok ;; 124|137|130) status=timeout ;; *) status="failed (exit $rc)" ;; esac
}

# Without pytest in $PY, borrow the pure-Python test tools of a carried .venv.
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

# 0. Preflight: seconds, not minutes, before anything long starts.
t=$SECONDS
if ! timeout -k 5 90 "$PY" scripts/gpu_preflight.py "$OUT"; then
    record preflight failed $((SECONDS - t))
    echo "[gpu_check] SUMMARY: preflight failed (see $OUT/env.json): nothing else ran"
    exit 2
fi
record preflight ok $((SECONDS - t))

# 1. CUDA tests.
t=$SECONDS
mapfile -t TESTS < <(grep -v '^#' scripts/gpu_tests.txt)
run_logged "$OUT/pytest.log" 25 passed "$TESTS_S" \
    "$PY" -m pytest -q -p no:cacheprovider -rs --timeout=120 "${TESTS[@]}" --junitxml="$OUT/pytest.xml"
test_status=$status
record tests "$status" $((SECONDS - t))

# 1b. Tensor parallelism over NCCL, on machines with two GPUs or more.
t=$SECONDS
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -ge 2 ]; then
    run_logged "$OUT/pytest_tp.log" 15 passed 120 \
        "$PY" -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py -k "tp2_greedy or shards"
else
    status="skipped: $gpus GPU(s); TP=2 over NCCL needs two"
fi
record tensor_parallel_nccl "$status" $((SECONDS - t))

# 2. W-GPU, keeping about 60 s for the kernel micro-benchmarks and the summary.
t=$SECONDS
budget=$(( $(left) - 60 ))
if [ "$budget" -gt 90 ]; then
    run_logged "$OUT/w_gpu.log" 15 ok $((budget + 20)) \
        "$PY" -m benchmarks.w_gpu --out "$OUT" --budget-s "$budget" --peer-reserve-s $((budget / 3))
else
    status="skipped: only ${budget}s left"
fi
wgpu_status=$status
record w_gpu "$status" $((SECONDS - t))

# 3. Kernel micro-benchmarks with the time that is left.
t=$SECONDS
budget=$(( $(left) - 10 ))
if [ "$budget" -gt 20 ]; then
    run_logged "$OUT/gpu_kernels.log" 30 ok "$budget" "$PY" -m benchmarks.gpu_kernels --out "$OUT"
else
    status="skipped: only ${budget}s left"
fi
record gpu_kernels "$status" $((SECONDS - t))

cat "$OUT/gpu_check.json"
counts=$(grep -oE '[0-9]+ (passed|failed|error|errors|skipped)' "$OUT/pytest.log" 2>/dev/null | tail -4 | paste -sd, -)
tokens=$("$PY" -c "import json,sys; s=json.load(open(sys.argv[1])).get('summary',{}); \
print(f\"asyncllm {s.get('asyncllm_tokens_per_s') or 0:,.0f} tok/s, x{s.get('x_peer') or 0:.2f} peer\")" \
    "$OUT/w_gpu.json" 2>/dev/null || echo "no figures")
echo "[gpu_check] SUMMARY: tests $test_status (${counts:-no counts}); w_gpu $wgpu_status ($tokens); $((SECONDS - START))s in all"
# Exit status: 0 only when the tests passed and W-GPU ran to the end.
[ "$test_status" = passed ] && [ "$wgpu_status" = ok ]
