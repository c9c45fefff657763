"""Backend resolution (auto, explicit, simulated absence, broken installs) and the lse convention."""

import importlib.abc
import logging
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

from engine import config
from engine.h20_ops import backend_select
from engine.h20_ops.attention import dispatch
from engine.h20_ops.attention.reference import sparse_mla_prefill_ref

KERNEL_MODULE = dispatch.TILELANG_KERNEL_MODULE
ROOT = Path(__file__).resolve().parents[1]


def _is_tilelang_module(name):
    return name == "tilelang" or name.startswith("tilelang.") or name == KERNEL_MODULE


@pytest.fixture
def fresh_process(monkeypatch):
    """A process state with no resolution, no tilelang modules and no import hooks; restored after."""
    for var in config.ALL_VARIABLES:
        monkeypatch.delenv(var.name, raising=False)
    saved_modules = {n: m for n, m in sys.modules.items() if _is_tilelang_module(n)}
    for name in saved_modules:
        del sys.modules[name]
    saved_meta_path = list(sys.meta_path)
    dispatch.reset_resolution_for_tests()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolution as on a GPU node
    yield monkeypatch
    dispatch.reset_resolution_for_tests()
    sys.meta_path[:] = saved_meta_path
    for name in [n for n in sys.modules if _is_tilelang_module(n)]:
        del sys.modules[name]
    sys.modules.update(saved_modules)


class _RaiseOnModule(importlib.abc.MetaPathFinder):
    """Importing a module (not yet imported) that `matches` raises `exc`."""

    def __init__(self, matches, exc):
        self.matches, self.exc = matches, exc

    def find_spec(self, fullname, path=None, target=None):
        if self.matches(fullname):
            raise self.exc
        return None


def _raise_on_tilelang(exc):
    return _RaiseOnModule(lambda name: name == "tilelang" or name.startswith("tilelang."), exc)


def _probe_with_simulation(tmp_path, code: str) -> str:
    """stdout of `code` run by a new interpreter with DEEPINFER_SIMULATE_NO_TILELANG=1, CUDA hidden and
    no backend pinned (it must exit 0)."""
    return _probe(tmp_path, code, DEEPINFER_SIMULATE_NO_TILELANG="1")


def _probe(tmp_path, code: str, **env_vars) -> str:
    """stdout of `code` run by a new interpreter with CUDA hidden, no backend pinned and env_vars set
    (it must exit 0)."""
    import subprocess

    script = tmp_path / "probe.py"
    script.write_text(code)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env_vars}
    env.pop("DEEPINFER_SPARSE_MLA_BACKEND", None)
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _fake_kernel_module():
    return types.ModuleType(KERNEL_MODULE)


def test_unset_with_tilelang_importable_picks_tilelang(fresh_process):
    """The import decides, not the package's name: the kernel module imports while `tilelang` itself
    cannot even be looked up by name -> tilelang."""
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    sys.meta_path.insert(0, _raise_on_tilelang(ModuleNotFoundError("No module named 'tilelang'", name="tilelang")))
    res = dispatch.backend_resolution()
    assert (res.backend, res.tilelang_missing) == ("tilelang", None)


def test_unset_with_tilelang_failing_inside_the_kernel_module_picks_triton(fresh_process):
    """`tilelang` is found by name, but the kernel module's import of it fails as a missing TileLang
    does -> triton (a lookup by name would pick tilelang)."""
    fresh_process.setitem(sys.modules, "tilelang", types.ModuleType("tilelang"))
    missing = ModuleNotFoundError("No module named 'tilelang'", name="tilelang")
    sys.meta_path.insert(0, _RaiseOnModule(lambda name: name == KERNEL_MODULE, missing))
    res = dispatch.backend_resolution()
    assert res.backend == "triton" and "No module named 'tilelang'" in res.tilelang_missing


def test_missing_tilelang_submodule_is_a_broken_install_not_absence(fresh_process):
    """A partial install (the package imports, one of its submodules is missing) must surface."""
    partial = ModuleNotFoundError("No module named 'tilelang.jit'", name="tilelang.jit")
    sys.meta_path.insert(0, _RaiseOnModule(lambda name: name == KERNEL_MODULE, partial))
    with pytest.raises(ImportError, match="tilelang.jit") as err:
        dispatch.resolve_backend()
    assert not isinstance(err.value, ModuleNotFoundError)


def test_unset_with_simulated_absence_picks_triton_through_a_real_import(fresh_process):
    fresh_process.setenv("DEEPINFER_SIMULATE_NO_TILELANG", "1")
    res = dispatch.backend_resolution()
    assert res.backend == "triton"
    assert "DEEPINFER_SIMULATE_NO_TILELANG" in res.tilelang_missing
    with pytest.raises(ModuleNotFoundError):
        import tilelang  # noqa: F401  (the hook blocks every later import too)
    with pytest.raises(ModuleNotFoundError):
        importlib_import("tilelang.language")


def test_simulation_is_read_when_tilelang_is_imported_not_at_engine_import(tmp_path):
    """A DP rank inherits the launcher's environment, imports the engine, then applies its job's
    variables: DEEPINFER_SIMULATE_NO_TILELANG=0 set after the import must leave TileLang importable
    (the --compare report's "TileLang present" run)."""
    stdout = _probe_with_simulation(
        tmp_path,
        "import importlib.util, os\n"
        "import engine.h20_ops.attention.dispatch\n"
        "os.environ['DEEPINFER_SIMULATE_NO_TILELANG'] = '0'\n"
        "from engine.h20_ops import backend_select\n"
        "blocked = any(isinstance(f, backend_select._BlockTileLang) for f in __import__('sys').meta_path)\n"
        "print('hook', blocked)\n"
        "if importlib.util.find_spec('tilelang') is not None:\n"
        "    import tilelang  # noqa: F401\n"
        "    print('tilelang imported')\n")
    assert stdout.startswith("hook False\n")


def importlib_import(name):
    import importlib
    return importlib.import_module(name)


def test_simulation_also_hides_an_already_imported_tilelang(fresh_process):
    """TileLang and the kernel module imported before the variable is set (both as sys.modules entries
    and as the package's attribute): the simulation drops them, so the resolution, a plain import of
    a submodule and `from package import module` all fail as without TileLang."""
    import engine.h20_ops as package

    tilelang = types.ModuleType("tilelang")
    tilelang.__path__ = []  # a package: `import tilelang.language` would succeed from sys.modules
    fresh_process.setitem(sys.modules, "tilelang", tilelang)
    fresh_process.setitem(sys.modules, "tilelang.language", types.ModuleType("tilelang.language"))
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    attr = KERNEL_MODULE.rpartition(".")[2]
    saved_attr = package.__dict__.get(attr)
    package.__dict__[attr] = sys.modules[KERNEL_MODULE]
    fresh_process.setenv("DEEPINFER_SIMULATE_NO_TILELANG", "1")
    try:
        assert dispatch.resolve_backend() == "triton"
        with pytest.raises(ModuleNotFoundError):
            importlib_import("tilelang.language")
        with pytest.raises(ModuleNotFoundError) as err:
            from engine.h20_ops.attention import tilelang_sm90  # noqa: F401
        assert err.value.name == "tilelang"
    finally:
        package.__dict__.pop(attr, None)
        if saved_attr is not None:
            package.__dict__[attr] = saved_attr


def test_simulation_blocks_explicit_backends_too(tmp_path):
    """DEEPINFER_SIMULATE_NO_TILELANG=1 in a new process: with no resolution, an explicit
    backend='tilelang' argument (prefill, paged fp8, sampling) is a clear error, and every TileLang
    import after it fails."""
    stdout = _probe_with_simulation(
        tmp_path,
        "import importlib, torch\n"
        "from engine.h20_ops.attention import dispatch\n"
        "from engine.h20_ops.sampling import dispatch as sampling\n"
        "from engine.h20_ops.backend_select import TileLangUnavailableError\n"
        "bf16 = dict(dtype=torch.bfloat16)\n"
        "calls = {\n"
        "    'prefill': lambda: dispatch.sparse_mla_fwd(torch.zeros(1, 64, 512, **bf16),\n"
        "                                             torch.zeros(1, 1, 512, **bf16),\n"
        "                                             torch.zeros(1, 1, dtype=torch.int32), 0.1, backend='tilelang'),\n"
        "    'paged': lambda: dispatch.sparse_mla_paged_fp8_fwd(None, None, None, None, 0.1, backend='tilelang'),\n"
        "    'sample': lambda: sampling._implementation('tilelang', 'logits', torch.zeros(1, 4)),\n"
        "}\n"
        "for name, call in calls.items():\n"
        "    try:\n"
        "        call()\n"
        "        print(name, 'RAN')\n"
        "    except TileLangUnavailableError as exc:\n"
        "        print(name, 'unavailable', 'DEEPINFER_SIMULATE_NO_TILELANG=1' in str(exc))\n"
        "for name in ('tilelang', 'tilelang.language', dispatch.TILELANG_KERNEL_MODULE):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        print(name, 'IMPORTED')\n"
        "    except ModuleNotFoundError as exc:\n"
        "        print(name, 'blocked', exc.name)\n")
    assert stdout.split("\n")[:-1] == [
        "prefill unavailable True", "paged unavailable True", "sample unavailable True",
        "tilelang blocked tilelang", "tilelang.language blocked tilelang",
        f"{dispatch.TILELANG_KERNEL_MODULE} blocked tilelang"]


def test_explicit_tilelang_when_missing_is_a_clear_error(fresh_process):
    fresh_process.setenv("DEEPINFER_SPARSE_MLA_BACKEND", "tilelang")
    sys.meta_path.insert(0, _raise_on_tilelang(ModuleNotFoundError("No module named 'tilelang'", name="tilelang")))
    with pytest.raises(dispatch.TileLangUnavailableError, match="DEEPINFER_SPARSE_MLA_BACKEND=tilelang"):
        dispatch.resolve_backend()


@pytest.mark.parametrize("exc", [ImportError("libtvm_ffi.so: undefined symbol: foo"),
                                 RuntimeError("CUDA driver too old")])
def test_broken_tilelang_install_surfaces(fresh_process, exc):
    sys.meta_path.insert(0, _raise_on_tilelang(exc))
    with pytest.raises(type(exc), match=str(exc).split(":")[0]):
        dispatch.resolve_backend()


@pytest.mark.parametrize("value", ["ref", "triton"])
def test_explicit_backends(fresh_process, value):
    fresh_process.setenv("DEEPINFER_SPARSE_MLA_BACKEND", value)
    assert dispatch.resolve_backend() == value


def test_bad_value_is_a_clear_error(fresh_process):
    fresh_process.setenv("DEEPINFER_SPARSE_MLA_BACKEND", "flashmla")
    with pytest.raises(config.ConfigError, match="DEEPINFER_SPARSE_MLA_BACKEND='flashmla'.*tilelang, triton, ref"):
        dispatch.resolve_backend()
    with pytest.raises(ValueError, match="^backend"):
        dispatch.sparse_mla_fwd(torch.zeros(1, 64, 512), torch.zeros(1, 1, 512),
                                  torch.zeros(1, 1, dtype=torch.int32), 0.1, backend="cuda")


def test_no_cuda_resolves_to_the_triton_interpreter(fresh_process):
    fresh_process.setattr(torch.cuda, "is_available", lambda: False)
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    assert dispatch.backend_resolution().backend == "triton"


_INTERPRETER_PROBE = """
import torch
from engine.h20_ops import sampling
from engine.h20_ops.attention import dispatch

print(dispatch.backend_resolution().reason)
q, kv = 0.1 * torch.randn(2, 64, 512), 0.1 * torch.randn(8, 1, 512)
idx = torch.tensor([[0, 3], [5, -1]], dtype=torch.int32)
try:
    out, _ = dispatch.sparse_mla_fwd(q, kv, idx, 0.05, backend="triton")
    ref, _ = dispatch.sparse_mla_fwd(q, kv, idx, 0.05, backend="ref")
    print("attention", float((out - ref).abs().max()) < 1e-4)
except ValueError as exc:
    print("attention error:", exc)
try:
    print("sampled", sampling.greedy_sample(torch.tensor([[0.0, 2.0, 1.0]]), backend="triton").tolist())
except ValueError as exc:
    print("sampling error:", exc)
"""


# Probes of Triton's CPU interpreter: the CPU suite's job (on a GPU node it runs with CUDA hidden and an
# interpreter-compatible numpy, scripts/run_tests.sh).
cpu_suite_only = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-interpreter probe: the CPU suite runs it")


@cpu_suite_only
def test_triton_interpret_is_read_as_triton_reads_it(tmp_path):
    """TRITON_INTERPRET=true makes Triton interpret as =1 does, and the launchers agree (they used to
    compare with "1", refusing CPU tensors or taking the GPU paths while Triton interpreted)."""
    lines = _probe(tmp_path, _INTERPRETER_PROBE, TRITON_INTERPRET="true").splitlines()
    assert lines == ["auto: no CUDA device (Triton interpreter)", "attention True", "sampled [1]"]


@cpu_suite_only
def test_interpreter_turned_off_without_cuda_is_named(tmp_path):
    """TRITON_INTERPRET=0 on a machine without CUDA: the resolution says why the Triton kernels cannot
    run, and each launcher stops with an error naming its tensor, not a driver error from Triton."""
    lines = _probe(tmp_path, _INTERPRETER_PROBE, TRITON_INTERPRET="0").splitlines()
    assert lines == [
        "auto: no CUDA device, and TRITON_INTERPRET turns Triton's interpreter off: its kernels cannot run",
        "attention error: q: expected a CUDA tensor (or Triton's interpreter: TRITON_INTERPRET=1), got device cpu",
        "sampling error: logits: expected a CUDA tensor for the triton backend (or Triton's interpreter: "
        "TRITON_INTERPRET=1), got device cpu"]


def test_paged_fp8_entry_validates_its_backend(fresh_process):
    """An unknown backend is named as such, not as a backend without a paged kernel."""
    for call in (lambda: dispatch.paged_fp8_supported("TileLang"),
                 lambda: dispatch.sparse_mla_paged_fp8_fwd(None, None, None, None, 0.1, backend="bogus")):
        with pytest.raises(ValueError, match="^backend: expected one of ref, triton, tilelang or None"):
            call()
    assert not dispatch.paged_fp8_supported("triton")
    with pytest.raises(ValueError, match="^backend: the paged fp8 kernel exists for tilelang only, got 'ref'"):
        dispatch.sparse_mla_paged_fp8_fwd(None, None, None, None, 0.1, backend="ref")


def test_log_line_names_the_dp_rank(fresh_process, caplog):
    fresh_process.setenv("DEEPINFER_SPARSE_MLA_BACKEND", "triton")
    fresh_process.setattr(torch.distributed, "is_initialized", lambda: True)
    fresh_process.setattr(torch.distributed, "get_rank", lambda: 3)
    fresh_process.setattr(torch.distributed, "get_world_size", lambda: 8)
    with caplog.at_level(logging.INFO, logger=backend_select.__name__):
        dispatch.resolve_backend()
    lines = [r.getMessage() for r in caplog.records if r.name == backend_select.__name__]
    assert lines == ["sparse MLA backend: triton (DEEPINFER_SPARSE_MLA_BACKEND=triton) [dp rank 3/8]"]


def test_logged_once_per_process(fresh_process, caplog):
    fresh_process.setenv("DEEPINFER_SPARSE_MLA_BACKEND", "ref")
    with caplog.at_level(logging.INFO, logger=backend_select.__name__):
        for _ in range(3):
            dispatch.resolve_backend()
    lines = [r.getMessage() for r in caplog.records if r.name == backend_select.__name__]
    assert lines == ["sparse MLA backend: ref (DEEPINFER_SPARSE_MLA_BACKEND=ref)"]


@pytest.mark.parametrize("backend", ["ref", "triton"])
def test_lse_is_base_2_whichever_backend(backend):
    """Engine lse / the backend's own natural lse == log2(e) exactly (up to fp32 rounding): a missing
    conversion (ratio 1) or an inverted one (ln 2) fails."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    q = (torch.randn(3, 64, 512, generator=gen) * 0.1).bfloat16().to(device)
    kv = (torch.randn(40, 1, 512, generator=gen) * 0.1).bfloat16().to(device)
    idx = torch.randint(0, 40, (3, 16), generator=gen, dtype=torch.int32).to(device)
    idx[2] = -1  # empty row: +inf in both bases
    out, lse2 = dispatch.sparse_mla_fwd(q, kv, idx, 3.0, backend=backend)
    if backend == "triton":
        from engine.h20_ops.vendor.flashmla_sparse import flash_mla_sparse_fwd
        natural = flash_mla_sparse_fwd(q, kv, idx, 3.0)[2]
    else:
        natural = sparse_mla_prefill_ref(q, kv, idx, 3.0).lse
    assert out.dtype == torch.bfloat16 and lse2.dtype == torch.float32
    assert natural[:2].abs().min() > 1.0  # a ratio far from 0/0
    ratio = (lse2[:2] / natural[:2]).double()
    assert torch.allclose(ratio, torch.full_like(ratio, 1 / math.log(2)), rtol=1e-6)
    assert torch.all(lse2[2] == math.inf)
    oracle = sparse_mla_prefill_ref(q, kv, idx, 3.0).lse[:2] / math.log(2)
    torch.testing.assert_close(lse2[:2], oracle, rtol=2.01 / 65536, atol=1e-6)


def test_missing_tilelang_dependency_is_a_broken_install_not_absence(fresh_process):
    missing_dep = ModuleNotFoundError("No module named 'tvm_ffi'", name="tvm_ffi")
    sys.meta_path.insert(0, _raise_on_tilelang(missing_dep))
    with pytest.raises(ImportError, match="tvm_ffi") as err:
        dispatch.resolve_backend()
    assert not isinstance(err.value, ModuleNotFoundError)
