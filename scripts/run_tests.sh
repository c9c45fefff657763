#!/usr/bin/env bash
# README's test command: installs what it needs (see scripts/python_env.sh), then runs every test.
# Without a GPU: one pytest run; Triton kernels run under Triton's interpreter and GPU-only tests are
# skipped. With a GPU: the tests not marked `gpu` first, with CUDA hidden (they are the CPU suite: CPU
# tensors through the interpreter, exact float32 comparisons; Triton decides per process whether it
# interprets, so they cannot share a process with the GPU), then the `gpu` tests on the GPU. The
# kernel files' GPU runs beyond the `gpu` tests: scripts/gpu_checks.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh "hf,test,tilelang,interpreter" || exit 1
export PYTHONUNBUFFERED=1
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
fi
echo "[tests] CPU suite (CUDA hidden)" >&2
CUDA_VISIBLE_DEVICES= "$PYTHON" -m pytest -q -p no:cacheprovider -m "not gpu" "$@"
cpu_rc=$?
echo "[tests] GPU tests" >&2
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu "$@"
gpu_rc=$?
# 5: no test collected, e.g. arguments that select CPU tests only (the CPU pass fails on it itself)
[ "$gpu_rc" -eq 5 ] && gpu_rc=0
echo "[tests] exit codes: CPU suite $cpu_rc, GPU tests $gpu_rc" >&2
[ "$cpu_rc" -eq 0 ] && [ "$gpu_rc" -eq 0 ]
