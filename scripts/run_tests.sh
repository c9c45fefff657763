#!/usr/bin/env bash
# README's test command: installs what it needs (see scripts/python_env.sh), then runs every test.
# Without a GPU, Triton kernels run under Triton's interpreter and GPU-only tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh "hf,test,tilelang,interpreter"
export PYTHONUNBUFFERED=1
exec "$PYTHON" -m pytest -q -p no:cacheprovider "$@"
