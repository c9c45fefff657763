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
# The CPU suite runs Triton's interpreter, which (triton 3.6) needs numpy < 2.4 (pyproject's `interpreter`
# extra); a GPU image may have a newer one: then that numpy goes into .interpreter_numpy/, first on the
# CPU suite's path only (pip's PIP_FIND_LINKS / PIP_NO_INDEX serve a node without network).
numpy_ok='import sys, numpy; sys.exit(numpy.lib.NumpyVersion(numpy.__version__) >= "2.4.0")'
cpu_path=$PYTHONPATH
if ! "$PYTHON" -c "$numpy_ok"; then
    cpu_path="$PWD/.interpreter_numpy:$PYTHONPATH"
    if ! PYTHONPATH="$cpu_path" "$PYTHON" -c "$numpy_ok" 2>/dev/null; then
        echo "[tests] installing numpy<2.4 into .interpreter_numpy/ for the CPU suite (Triton's interpreter)" >&2
        "$PYTHON" -m pip install -q --upgrade --target .interpreter_numpy "numpy<2.4" >&2 || {
            echo "[tests] cannot install numpy<2.4 (no network? set PIP_FIND_LINKS to a folder with its wheel)" >&2
            exit 1
        }
    fi
fi
echo "[tests] CPU suite (CUDA hidden)" >&2
CUDA_VISIBLE_DEVICES= PYTHONPATH="$cpu_path" "$PYTHON" -m pytest -q -p no:cacheprovider -m "not gpu" "$@"
cpu_rc=$?
echo "[tests] GPU tests" >&2
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu "$@"
gpu_rc=$?
# 5: no test collected, e.g. arguments that select CPU tests only (the CPU pass fails on it itself)
[ "$gpu_rc" -eq 5 ] && gpu_rc=0
echo "[tests] exit codes: CPU suite $cpu_rc, GPU tests $gpu_rc" >&2
[ "$cpu_rc" -eq 0 ] && [ "$gpu_rc" -eq 0 ]
