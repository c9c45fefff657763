import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import engine.h20_ops  # noqa: F401  (sets TRITON_INTERPRET=1 before any kernel module on CPU-only machines)
from engine import kernel_source, ops
from engine.h20_ops import backend_select
from engine.h20_ops import sampling
from engine.h20_ops.attention import dispatch

HAS_CUDA = torch.cuda.is_available()

# TileLang registers global FFI functions when it is imported and cannot be imported twice in one
# process. Import it (when installed) before any test, so that the per-test cleanup below, which
# drops modules a test added, never drops a genuine TileLang import.
try:
    import tilelang  # noqa: F401
except ModuleNotFoundError:
    pass


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


def _tilelang_modules() -> dict:
    return {name: mod for name, mod in sys.modules.items()
            if name == "tilelang" or name.startswith("tilelang.") or name in backend_select._TILELANG_KERNEL_MODULES}


@pytest.fixture(autouse=True)
def isolated_backend_selection():
    """A test that resolves with DEEPINFER_SIMULATE_NO_TILELANG=1 installs a process-wide import hook
    and drops tilelang's modules: undo that (and forget every resolution, the kernel source's op table
    included) so that no later test inherits a TileLang-less process or another kernel source."""
    meta_path = list(sys.meta_path)
    modules = _tilelang_modules()
    yield
    sys.meta_path[:] = meta_path
    for name in _tilelang_modules():
        if name not in modules:
            del sys.modules[name]
    sys.modules.update(modules)
    dispatch.reset_resolution_for_tests()
    sampling.reset_resolution_for_tests()
    kernel_source.reset()


@pytest.fixture
def launch_batches(monkeypatch):
    """record(module, name): from now on every call of module.name also appends its first
    argument's size(0) (the rows of one launch) to the returned list."""
    def record(module, name: str) -> list[int]:
        sizes: list[int] = []
        real = getattr(module, name)

        def recording(first, *args, **kwargs):
            sizes.append(first.size(0))
            return real(first, *args, **kwargs)

        monkeypatch.setattr(module, name, recording)
        return sizes

    return record


@pytest.fixture(scope="session")
def built_kernel_repo(tmp_path_factory) -> Path:
    """The kernel repository built from this checkout (scripts/build_kernel_repo.py), once per session: its
    package name carries a digest of its files, so two builds of one checkout are one module to Python and
    the second one loaded would be refused as another copy of an imported kernel."""
    pytest.importorskip("kernels", reason="needs the kernels package (pyproject's test / hf-kernels extras)")
    spec = importlib.util.spec_from_file_location(
        "build_kernel_repo", Path(__file__).resolve().parents[1] / "scripts" / "build_kernel_repo.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    root = tmp_path_factory.mktemp("kernel_repo") / "repo"
    builder.build(root)
    return root


ENGINE_ENV = ("DEEPINFER_SPARSE_MLA_BACKEND", "DEEPINFER_KERNELS", "DEEPINFER_OPS_STRICT", "DEEPINFER_USE_NEXTN_DECODE",
              "DEEPINFER_SIMULATE_NO_TILELANG")


def set_engine_env(monkeypatch, **values) -> None:
    """Exactly `values` of the engine's DEEPINFER_* choices (ENGINE_ENV) from now on, resolved afresh (the
    dispatchers' per-process resolutions and the op fallback counts reset)."""
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    dispatch.reset_resolution_for_tests()
    sampling.reset_resolution_for_tests()
    ops.reset_fallback_counts()


@pytest.fixture
def engine_env(monkeypatch):
    """set_engine_env for one test: engine_env(DEEPINFER_KERNELS="ref", ...)."""
    return functools.partial(set_engine_env, monkeypatch)
