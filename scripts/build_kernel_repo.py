"""Build this checkout's kernels as a kernel repository (the `kernels` library's layout), offline.

    python scripts/build_kernel_repo.py OUTDIR

Writes OUTDIR/build/torch-cpu/ and OUTDIR/build/torch-cuda/: noarch variants (Triton and TileLang kernels
compile at run time), the same files in both; kernels picks torch-cuda under a CUDA torch, torch-cpu
otherwise. Each variant holds
  metadata.json: id, name, version, license, backend, python-depends (none), and `digest`: the sha256 of every
    other file of the variant (kernels' format; scripts/kernel_offline_cache.py and engine/kernel_repo.py
    check it before anything is imported);
  deepinfer_sparse_mla/: copies of engine/config.py, engine/ops.py, engine/h20_ops/** and, when present,
    engine/integrations/** (every import inside them is relative: kernels imports the package under
    another name), plus two generated modules:
    __init__.py re-exports engine.h20_ops.__all__, the __all__ of engine/h20_ops/flash_mla.py (FlashMLA's
      flash_mla_sparse_fwd, get_mla_metadata, flash_mla_with_kvcache) when that module exists, and the
      ops of engine/ops.py; `kernel.layers` is imported on first access (the layers import transformers);
    layers.py re-exports the __all__ of every engine/integrations/*_layers.py: the kernel layers
      (kernels' rules: nn.Module subclasses without __init__ whose stateless forward has the signature
      of the module forward it replaces).
The names come from each module's literal __all__, read without importing anything. Prints the variants
and their digests (sha256 of metadata.json).
"""

from __future__ import annotations

import argparse
import ast
import base64
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"
NAME = "deepinfer-sparse-mla"  # kernels' rule: ^[a-z][-a-z0-9]*[a-z0-9]$; the package is its python name
PACKAGE = NAME.replace("-", "_")
VERSION = 1  # the repository's API version (the Hub's branch v1)
REPO_ID, REVISION = "deepinfer/sparse-mla", f"v{VERSION}"  # how LOCAL_KERNELS / the lock name it
VARIANTS = {"torch-cpu": "cpu", "torch-cuda": "cuda"}
# kernels requires a license string; the project states none, so the SPDX term for "not stated"
LICENSE = "NOASSERTION"
OPS = ("hyper_connection", "kv_gather_dequant", "kv_quantize", "rms_norm", "rope")  # engine/ops.py's ops
COPIED = ("config.py", "ops.py")
COPIED_TREES = ("h20_ops", "integrations")


def literal_all(path: Path) -> list[str]:
    """The module's `__all__`, which must be a literal list or tuple of strings."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            names = ast.literal_eval(node.value)
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
                break
            return list(names)
    raise SystemExit(f"build_kernel_repo: {path} has no literal __all__ (a list of names)")


def _import_lines(module: str, names: list[str]) -> list[str]:
    return [f"from {module} import (  # noqa: F401", *(f"    {n}," for n in names), ")"]


def package_init(engine: Path) -> str:
    exports = [(".h20_ops", literal_all(engine / "h20_ops" / "__init__.py"))]
    if (engine / "h20_ops" / "flash_mla.py").is_file():
        exports.append((".h20_ops.flash_mla", literal_all(engine / "h20_ops" / "flash_mla.py")))
    exports.append((".ops", list(OPS)))
    names = [n for _, ns in exports for n in ns]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"build_kernel_repo: names exported twice: {', '.join(duplicates)}")
    lines = [f'"""{NAME}: the kernels of the `engine` package (sparse MLA attention for DeepSeek-V4-class models',
             'on Hopper, FlashMLA\'s sparse interface, norms, RoPE, the fp8 KV cache, the hyper-connection) as a',
             'kernel repository.',
             'Built by scripts/build_kernel_repo.py; `layers` (kernel layers for transformers) loads on first use."""',
             ""]
    for module, ns in exports:
        lines += _import_lines(module, ns)
    lines += ["", f"__all__ = {sorted(names)!r}", "", "",
              "def __getattr__(name):",
              "    if name == \"layers\":  # imports transformers: only when a layer is asked for",
              "        import importlib",
              "",
              "        return importlib.import_module(f\"{__name__}.layers\")",
              "    raise AttributeError(f\"module {__name__!r} has no attribute {name!r}\")", ""]
    return "\n".join(lines)


def layers_module(engine: Path) -> str:
    sources = sorted((engine / "integrations").glob("*_layers.py")) if (engine / "integrations").is_dir() else []
    if not sources:
        raise SystemExit(f"build_kernel_repo: no {engine / 'integrations'}/*_layers.py: the repository needs layers")
    exports = [(f".integrations.{p.stem}", literal_all(p)) for p in sources]
    names = [n for _, ns in exports for n in ns]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SystemExit(f"build_kernel_repo: layer names exported twice: {', '.join(duplicates)}")
    lines = ['"""Kernel layers of this repository: engine/integrations/*_layers.py."""', ""]
    for module, ns in exports:
        lines += _import_lines(module, ns)
    lines += ["", f"__all__ = {sorted(names)!r}", ""]
    return "\n".join(lines)


def package_files(engine: Path) -> dict[str, bytes]:
    """Relative path inside the package -> bytes."""
    files = {name: (engine / name).read_bytes() for name in COPIED}
    for tree in COPIED_TREES:
        top = engine / tree
        if not top.is_dir():
            continue
        for path in sorted(top.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                files[path.relative_to(engine).as_posix()] = path.read_bytes()
    files["__init__.py"] = package_init(engine).encode()
    files["layers.py"] = layers_module(engine).encode()
    return files


def file_digest(data: bytes) -> str:
    """kernels' digest of one file: base64 of its sha256."""
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def build(outdir: Path, engine: Path = ENGINE) -> dict[str, str]:
    """Write the repository into outdir (absent or empty); returns {variant: sha256 of its metadata.json}."""
    outdir = Path(outdir)
    if outdir.exists() and any(outdir.iterdir()):
        raise SystemExit(f"build_kernel_repo: {outdir} is not empty")
    files = {f"{PACKAGE}/{rel}": data for rel, data in package_files(engine).items()}
    digest = {rel: file_digest(data) for rel, data in sorted(files.items())}
    content = hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()
    written = {}
    for variant, backend in VARIANTS.items():
        root = outdir / "build" / variant
        for rel, data in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(data)
        metadata = {"id": f"_{PACKAGE}_{variant.replace('-', '_')}_{content[:12]}", "name": NAME, "version": VERSION,
                    "license": LICENSE, "backend": {"type": backend}, "python-depends": [],
                    "digest": {"algorithm": "sha256", "files": digest}}
        meta = (json.dumps(metadata, indent=2, sort_keys=True) + "\n").encode()
        (root / "metadata.json").write_bytes(meta)
        written[variant] = hashlib.sha256(meta).hexdigest()
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", type=Path, help="the repository's directory (absent or empty)")
    args = ap.parse_args(argv)
    for variant, digest in build(args.outdir).items():
        print(f"{args.outdir / 'build' / variant}: digest {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
