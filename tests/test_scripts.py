"""The scripts that CI never runs still load: every scripts/*.py compiles, and the GPU benchmarks and checks
import what they use and parse their arguments (`--help`) on a CPU-only machine.

They run on an H200 only, in calls of a limited device budget: a syntax error or a name that moved in the
engine must show here, not in the middle of that call.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))

# GPU-only scripts whose argument parser comes before any device check (ab_fused_sample and
# bench_tilelang_paged_fp8 refuse a machine without CUDA first, naming it).
GPU_SCRIPTS = ("ab_vendored", "bench_flash_mla", "bench_sparse_mla", "bench_tp_heads", "bench_triton_paged_fp8",
               "engine_step_profile", "hf_integration_bench", "nextn_gpu_check")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_script_compiles(path):
    compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_scripts_import_and_parse_their_arguments(name):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), run.stderr[-2000:]
