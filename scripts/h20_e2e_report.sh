#!/usr/bin/env bash
# The end-to-end report in one command: the embedded tiny DeepSeek-V4 served by 8 data-parallel ranks
# and checked against transformers' eager model. Flags go to scripts/e2e_report.py (--help lists them).
# The DEEPINFER_* variables (SPARSE_MLA_BACKEND, SIMULATE_NO_TILELANG, KERNELS, OPS_STRICT,
# USE_NEXTN_DECODE) pass through the environment to every rank unchanged.
# PYTHON, when set, is the interpreter to use as is; otherwise scripts/python_env.sh picks (and on a
# fresh CPU machine sets up) one.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    source scripts/python_env.sh "hf,interpreter"  # explicit: a sourced script would see this one's flags as $1
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/e2e_report.py "$@"
