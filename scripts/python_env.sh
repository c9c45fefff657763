# Sourced by the user-facing scripts: sets PYTHON to an interpreter that has what the project needs.
#  - If python3 already imports torch, triton, transformers and safetensors (a GPU image, an offline
#    node), use it with the repository on PYTHONPATH: nothing is installed.
#  - Otherwise (a fresh CPU machine) create .venv once and install torch==2.13.0 explicitly (the
#    project's CPU machines hold its CPU build on disk, which pip takes; an unpinned torch would
#    resolve to a multi-GB CUDA build), then the project with the extras given as the first argument
#    (default "hf,interpreter"; a sourcing script must pass it: otherwise $1 is that script's own).
_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_extras="${1:-hf,interpreter}"
if python3 -c "import torch, triton, transformers, safetensors" >/dev/null 2>&1; then
    PYTHON=python3
    export PYTHONPATH="$_repo_root${PYTHONPATH:+:$PYTHONPATH}"
else
    if [ ! -x "$_repo_root/.venv/bin/python" ]; then
        echo "[setup] creating $_repo_root/.venv (torch 2.13.0 CPU build + project[$_extras])" >&2
        python3 -m venv "$_repo_root/.venv" || return 1
    fi
    PYTHON="$_repo_root/.venv/bin/python"
    _stamp="$_repo_root/.venv/.deepinfer-installed-$_extras"
    if [ ! -f "$_stamp" ] || [ "$_repo_root/pyproject.toml" -nt "$_stamp" ]; then
        "$PYTHON" -m pip install -q --upgrade pip >&2 || return 1
        "$PYTHON" -m pip install -q torch==2.13.0 >&2 || return 1
        "$PYTHON" -m pip install -q -e "$_repo_root[$_extras]" >&2 || return 1
        touch "$_stamp"
    fi
fi
export PYTHON
