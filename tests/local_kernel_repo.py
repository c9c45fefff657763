"""A minimal local kernel repository of this checkout for the transformers integration's tests and GPU
script (the kernels library's layout: build/<variant>/metadata.json + build/<variant>/<package>/,
the package a copy of engine/ whose `layers` module re-exports engine/integrations/hf_layers.py).
Variants torch-cpu and torch-cuda (noarch: the same files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO_ID = "deepinfer/sparse-mla"
REVISION = "v1"
PACKAGE = "deepinfer_sparse_mla"
ENGINE_DIR = Path(__file__).resolve().parent.parent / "engine"


def write_local_kernel_repo(root: Path) -> Path:
    """Lay the repository out under `root` (created); returns it. Point LOCAL_KERNELS at it:
    f"{REPO_ID}={root}"."""
    root = Path(root)
    for variant, backend in (("torch-cpu", "cpu"), ("torch-cuda", "cuda")):
        build = root / "build" / variant
        package = build / PACKAGE
        shutil.copytree(ENGINE_DIR, package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        (package / "layers.py").write_text("from .integrations.hf_layers import *  # noqa: F401,F403\n"
                                           "from .integrations.hf_layers import __all__  # noqa: F401\n")
        with open(package / "__init__.py", "a") as f:
            f.write("\nfrom . import layers  # noqa: E402,F401\n")
        metadata = {"id": f"_{PACKAGE}_{variant.replace('-', '_')}", "name": PACKAGE.replace("_", "-"),
                    "version": 1, "license": "Apache-2.0", "backend": {"type": backend}, "python-depends": []}
        (build / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return root
