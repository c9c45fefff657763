"""The dispatcher: backend resolution (auto, explicit, simulated absence, broken installs), every kernel
choice (prefill kernel, decode path) with its reason, recorded and logged once, and the lse convention."""

import importlib.abc
import logging
import math
import os
import sys
import types
from pathlib import Path

import pytest
import torch

import engine.h20_ops as ops
from engine import config
from engine.h20_ops import backend_select, kv_cache, testing
from engine.h20_ops.attention import dispatch
from engine.h20_ops.vendor.flashmla_sparse import flash_mla_sparse_fwd

KERNEL_MODULE = dispatch.TILELANG_KERNEL_MODULE
ROOT = Path(__file__).resolve().parents[1]
# the test device, read at import: fixtures below make torch.cuda.is_available() answer True on a CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolution as on an SM90 GPU node
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
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
    backend='tilelang' argument (prefill, decode over dense rows, the paged fp8 path, sampling) is a clear
    error, and every TileLang import after it fails."""
    stdout = _probe_with_simulation(
        tmp_path,
        "import importlib, torch\n"
        "import engine.h20_ops as ops\n"
        "from engine.h20_ops import kv_cache\n"
        "from engine.h20_ops.attention import dispatch\n"
        "from engine.h20_ops.sampling import dispatch as sampling\n"
        "from engine.h20_ops.backend_select import TileLangUnavailableError\n"
        "bf16 = dict(dtype=torch.bfloat16)\n"
        "q, idx = torch.zeros(1, 1, 64, 512, **bf16), torch.zeros(1, 1, 1, dtype=torch.int32)\n"
        "def decode(cache):\n"
        "    plan = ops.plan_sparse_decode(cache, batch=1, s_q=1, h_q=64, topk=1, q_dtype=torch.bfloat16,\n"
        "                                  backend='tilelang')\n"
        "    return ops.sparse_mla_decode(q, cache, idx, 0.1, plan=plan)\n"
        "calls = {\n"
        "    'prefill': lambda: ops.sparse_mla_prefill(q[0], torch.zeros(1, 1, 512, **bf16), idx[0], 0.1,\n"
        "                                              backend='tilelang'),\n"
        "    'decode': lambda: decode(torch.zeros(1, 1, 512, **bf16)),\n"
        "    'paged': lambda: decode(kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 1, 16, 'cpu')),\n"
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
        "prefill unavailable True", "decode unavailable True", "paged unavailable True", "sample unavailable True",
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
    with pytest.raises(ValueError, match="^backend: expected one of ref, triton, tilelang or None, got 'cuda'"):
        ops.sparse_mla_prefill(torch.zeros(1, 64, 512), torch.zeros(1, 1, 512), torch.zeros(1, 1, dtype=torch.int32),
                               0.1, backend="cuda")


def test_no_cuda_resolves_to_the_triton_interpreter(fresh_process):
    fresh_process.setattr(torch.cuda, "is_available", lambda: False)
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    assert dispatch.backend_resolution().backend == "triton"


_INTERPRETER_PROBE = """
import torch
import engine.h20_ops as ops
from engine.h20_ops import sampling, testing
from engine.h20_ops.attention import dispatch

print(dispatch.backend_resolution().reason)
q, kv = 0.1 * torch.randn(2, 64, 512), 0.1 * torch.randn(8, 1, 512)
idx = torch.tensor([[0, 3], [5, -1]], dtype=torch.int32)
try:
    out = ops.sparse_mla_prefill(q, kv, idx, 0.05, backend="triton")
    ref = ops.sparse_mla_prefill(q, kv, idx, 0.05, backend="ref")
    testing.assert_close("out", out.out, ref.out, testing.EXACT_FP32)
    print("attention", True)
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


def test_decode_entry_validates_its_backend():
    """An unknown backend is named as such (not as a backend without a paged kernel), and only a
    paged fp8 kernel the dispatcher knows runs."""
    cache = kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 1, 16, "cpu")
    for call in (lambda: ops.plan_sparse_decode(cache, batch=1, s_q=1, h_q=64, topk=1, q_dtype=torch.bfloat16,
                                                backend="TileLang"),
                 lambda: dispatch.decode_path(torch.bfloat16, cache.device, kv_cache.MODEL1, False, "bogus", h_q=64)):
        with pytest.raises(ValueError, match="^backend: expected one of ref, triton, tilelang or None, got"):
            call()
    with pytest.raises(ValueError, match="^kernel: no paged fp8 kernel named 'triton_portable'"):
        dispatch.run_paged_fp8_kernel("triton_portable", None, cache, None, None, 0.1, None, None,
                                      cache_names=("cache", "extra_cache"))


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
    """Engine lse / the kernel's own natural lse == log2(e) exactly (up to fp32 rounding): a missing
    conversion (ratio 1) or an inverted one (ln 2) fails."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = testing.prefill_case(7, s_q=3, h_q=64, d_qk=512, s_kv=40, topk=16, device=device)
    case.indices[2] = -1  # empty row: +inf in both bases
    res = ops.sparse_mla_prefill(case.q, case.kv, case.indices, case.sm_scale, backend=backend)
    if backend == "triton":
        kernel = dispatch.prefill_kernel(case.q, case.kv, backend).kernel.removeprefix("triton_")
        natural = flash_mla_sparse_fwd(case.q, case.kv, case.indices, case.sm_scale, kernel=kernel)[2]
    else:
        natural = case.oracle().lse
    assert res.out.dtype == torch.bfloat16 and res.lse_log2.dtype == torch.float32
    assert natural[:2].abs().min() > 1.0  # a ratio far from 0/0
    ratio = res.lse_log2[:2] / natural[:2]
    testing.assert_close("lse_log2 / natural lse", ratio, torch.full_like(ratio, 1 / math.log(2)),
                         testing.FP32_RELATIVE)
    assert torch.all(res.lse_log2[2] == math.inf)
    testing.assert_matches_oracle(res, case.oracle(), decode=False)


def test_missing_tilelang_dependency_is_a_broken_install_not_absence(fresh_process):
    missing_dep = ModuleNotFoundError("No module named 'tvm_ffi'", name="tvm_ffi")
    sys.meta_path.insert(0, _raise_on_tilelang(missing_dep))
    with pytest.raises(ImportError, match="tvm_ffi") as err:
        dispatch.resolve_backend()
    assert not isinstance(err.value, ModuleNotFoundError)


# ---------------------------------------------------------------------------------------------
# kernel choices: each with its reason, recorded and logged once per process
# ---------------------------------------------------------------------------------------------

def _choice_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == dispatch.__name__]


@cpu_suite_only  # the kernels it expects are the interpreter's (a GPU's: the tests below with stand-ins)
def test_every_choice_is_recorded_once_with_its_reason(caplog):
    """Several calls of each kind: kernel_choices() lists each distinct choice once, in order, with its
    reason, and each is logged once (the CPU's kernels: the portable Triton kernel under the interpreter)."""
    dispatch.reset_resolution_for_tests()
    prefill = testing.prefill_case(1, s_q=2, h_q=64, d_qk=512, s_kv=16, topk=8)
    dense = testing.decode_case(2, batch=1, s_q=1, h_q=64, topk=8)
    two = testing.decode_case(3, batch=1, s_q=1, h_q=64, topk=8, extra_topk=4)
    fp8 = testing.decode_case(4, batch=1, s_q=1, h_q=64, topk=8, extra_topk=4, layout=kv_cache.MODEL1)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        for _ in range(2):
            ops.sparse_mla_prefill(prefill.q, prefill.kv, prefill.indices, prefill.sm_scale, backend="triton")
            for case in (dense, two, fp8):
                case.run(case.plan(backend="triton"))
            ops.sparse_mla_prefill(prefill.q, prefill.kv, prefill.indices, prefill.sm_scale, backend="ref")
    interpreter = "Triton's interpreter (no CUDA device)"
    want = [
        dict(op="prefill", kernel="triton_portable", reason=interpreter),
        dict(op="decode", kernel="direct: triton_portable", reason="one dense cache, read in place"),
        dict(op="decode", kernel="gathered: triton_portable", reason="two dense caches: rows gathered into one buffer"),
        dict(op="decode", kernel="paged_fp8: triton_paged_fp8", reason="backend triton, MODEL1 fp8 caches"),
        dict(op="prefill", kernel="ref", reason="backend='ref'"),
    ]
    assert ops.kernel_choices() == want
    assert _choice_lines(caplog) == [f"sparse MLA {c['op']} kernel: {c['kernel']} ({c['reason']})" for c in want]


class _CudaTensorStandIn:
    """What the dispatcher reads of a CUDA tensor to choose a prefill kernel (no GPU needed)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, dtype, strides, data_ptr=0, h_q=64):
        self.dtype, self._strides, self._data_ptr = dtype, strides, data_ptr
        self.shape = (1, h_q, strides[1])

    def stride(self, dim):
        return self._strides[dim]

    def data_ptr(self):
        return self._data_ptr


def test_prefill_kernel_for_the_tensors_at_hand(monkeypatch, caplog):
    """On an SM90 GPU bf16 with 16-byte aligned rows gets the Gluon kernel; float32, another GPU, and rows
    16-byte cp.async cannot read (a start or a row stride off 16 bytes) get the portable Triton kernel,
    each reason logged once however often it recurs."""
    from engine.h20_ops.vendor import flashmla_sparse_gluon_sm90 as gluon

    dispatch.reset_resolution_for_tests()
    monkeypatch.setattr(gluon, "triton_interprets", lambda: False)
    capability = {"value": (9, 0)}
    monkeypatch.setattr(gluon, "cuda_capability", lambda device: capability["value"])
    bf16, fp32 = torch.bfloat16, torch.float32
    cost = "the portable kernel takes them, ~1.5x slower"
    kv = _CudaTensorStandIn(bf16, (576, 576, 1))
    cases = [  # q, kv, (9, 0) or another capability -> kernel, reason
        (_CudaTensorStandIn(bf16, (64 * 576, 576, 1)), kv, (9, 0), "triton_gluon_sm90",
         "bf16 on SM90, 16-byte aligned rows"),
        (_CudaTensorStandIn(fp32, (64 * 576, 576, 1)), kv, (9, 0), "triton_portable",
         "q is float32 (the Gluon kernel is bf16 only)"),
        (_CudaTensorStandIn(bf16, (64 * 576, 576, 1)), kv, (8, 0), "triton_portable", "GPU sm_80 is not SM90"),
        (_CudaTensorStandIn(bf16, (64 * 584, 584, 1)), kv, (9, 0), "triton_portable",
         f"q / kv rows not 16-byte aligned (row strides (37376, 584, 576) elements, data_ptr % 16 = 0 / 0; {cost})"),
        (_CudaTensorStandIn(bf16, (64 * 576, 576, 1), data_ptr=8), kv, (9, 0), "triton_portable",
         f"q / kv rows not 16-byte aligned (row strides (36864, 576, 576) elements, data_ptr % 16 = 8 / 0; {cost})"),
        (_CudaTensorStandIn(bf16, (64 * 576, 576, 1)), _CudaTensorStandIn(bf16, (584, 584, 1)), (9, 0),
         "triton_portable", f"q / kv rows not 16-byte aligned (row strides (36864, 576, 584) elements, "
                            f"data_ptr % 16 = 0 / 0; {cost})"),
        (_CudaTensorStandIn(bf16, (16 * 576, 576, 1), h_q=16), kv, (9, 0), "triton_portable",
         "h_q 16: the Gluon kernel takes 64 or 128 heads (64 per CTA)"),
        (_CudaTensorStandIn(bf16, (32 * 576, 576, 1), h_q=32), kv, (9, 0), "triton_portable",
         "h_q 32: the Gluon kernel takes 64 or 128 heads (64 per CTA)"),
    ]
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        for _ in range(2):
            for q, kv_, cap, kernel, reason in cases:
                capability["value"] = cap
                assert dispatch.prefill_kernel(q, kv_, "triton") == dispatch.KernelChoice("prefill", kernel, reason)
    want = [f"sparse MLA prefill kernel: {kernel} ({reason})" for _, _, _, kernel, reason in cases]
    assert _choice_lines(caplog) == want
    assert [c["reason"] for c in ops.kernel_choices()] == [reason for *_, reason in cases]


@pytest.mark.parametrize("capability,backend,reason", [
    ((8, 0), "triton", "auto: GPU sm_80 is not SM90 (the TileLang kernels are built for sm_90a)"),
    ((10, 0), "triton", "auto: GPU sm_100 is not SM90 (the TileLang kernels are built for sm_90a)"),
    ((9, 0), "tilelang", "auto: TileLang kernel module imported"),
])
def test_auto_is_triton_on_a_gpu_that_is_not_sm90(fresh_process, capability, backend, reason):
    """TileLang importable (its kernel module is): auto takes it on an SM90 only."""
    fresh_process.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    res = dispatch.backend_resolution()
    assert (res.backend, res.reason, res.tilelang_missing) == (backend, reason, None)


def test_decode_path_reasons(monkeypatch):
    """Each decode path with the reason it is chosen (paged fp8 kernels: Triton's for any q dtype and
    cache alignment, TileLang's for bf16 q and 16-byte aligned caches; either fp8 layout), the buffer
    kernel that goes with it, and the q dtypes a backend has no kernel for, refused."""
    dispatch.reset_resolution_for_tests()
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.setattr(dispatch, "triton_interprets", lambda: False)
    monkeypatch.setattr(dispatch, "cuda_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    bf16, fp32, m1, v32 = torch.bfloat16, torch.float32, kv_cache.MODEL1, kv_cache.V32
    cases = [  # (q dtype, device, layout, extra cache, backend[, caches 16-byte aligned]) -> kernel, reason
        ((bf16, cpu, None, False, "triton"), "direct: triton_portable", "one dense cache, read in place"),
        ((bf16, cuda, None, False, "triton"), "direct: triton_gluon_sm90", "one dense cache, read in place"),
        ((fp32, cuda, None, True, "triton"), "gathered: triton_portable",
         "two dense caches: rows gathered into one buffer"),
        ((bf16, cuda, None, True, "ref"), "gathered: ref", "two dense caches: rows gathered into one buffer"),
        ((bf16, cuda, m1, True, "triton"), "paged_fp8: triton_paged_fp8", "backend triton, MODEL1 fp8 caches"),
        ((fp32, cpu, v32, False, "triton", False), "paged_fp8: triton_paged_fp8", "backend triton, V32 fp8 caches"),
        ((bf16, cuda, v32, False, "ref"), "gathered: ref",
         "fp8 rows dequantized into a buffer: backend ref has no paged fp8 kernel"),
        ((bf16, cuda, m1, True, "tilelang"), "paged_fp8: tilelang_sm90_paged_fp8", "backend tilelang, MODEL1 fp8 caches"),
        ((bf16, cuda, m1, False, "tilelang"), "paged_fp8: tilelang_sm90_paged_fp8",
         "backend tilelang, MODEL1 fp8 caches"),
        ((bf16, cuda, v32, True, "tilelang"), "paged_fp8: tilelang_sm90_paged_fp8", "backend tilelang, V32 fp8 caches"),
        ((bf16, cuda, m1, True, "tilelang", False), "gathered: tilelang_sm90",
         "fp8 rows dequantized into a buffer: tilelang_sm90_paged_fp8 needs 16-byte aligned cache bases and block "
         "strides"),
        ((bf16, cuda, None, False, "tilelang"), "direct: tilelang_sm90", "one dense cache, read in place"),
    ]
    for args, kernel, reason in cases:
        *args, aligned = args if len(args) == 6 else (*args, True)
        got = dispatch.decode_path(*args, h_q=64, caches_aligned16=aligned)
        assert got == dispatch.KernelChoice("decode", kernel, reason), args
    assert len(ops.kernel_choices()) == len({(k, r) for _, k, r in cases})
    # a q dtype no kernel of the backend takes is refused when the call is planned, naming the way out
    for dtype in (fp32, torch.float16):
        with pytest.raises(TypeError, match=r"^q_dtype: expected torch.bfloat16 on the tilelang backend \(the "
                                            r"tilelang backend's kernels are bf16 only; DEEPINFER_SPARSE_MLA_BACKEND"):
            dispatch.decode_path(dtype, cuda, m1, True, "tilelang", h_q=64)
    with pytest.raises(TypeError, match=r"^q_dtype: expected torch.bfloat16 or torch.float32 on the triton backend, "
                                        r"got torch.float16"):
        dispatch.decode_path(torch.float16, cuda, None, False, "triton", h_q=64)


# ---------------------------------------------------------------------------------------------
# head counts the TileLang kernels do not take (a tensor-parallel rank's h_q 8, 16, 32)
# ---------------------------------------------------------------------------------------------

HEADS_NOTE = "h_q {}: the TileLang kernels take 64 or 128 heads -> triton"
GLUON_HEADS = "h_q {}: the Gluon kernel takes 64 or 128 heads (64 per CTA)"


def test_auto_tilelang_runs_other_head_counts_on_triton_and_says_why(fresh_process, caplog):
    """Auto resolution picked tilelang (an SM90 with TileLang): an h_q its kernels do not take runs the
    triton backend, each choice with that reason (recorded and logged), and the results match the oracle;
    h_q 64 stays on TileLang."""
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    assert dispatch.resolve_backend() == "tilelang"
    prefill = testing.prefill_case(5, s_q=3, h_q=16, d_qk=512, s_kv=30, topk=16, topk_length=True, sink=True,
                                   device=DEVICE)
    fp8 = testing.decode_case(6, batch=2, s_q=1, h_q=8, topk=8, extra_topk=4, layout=kv_cache.MODEL1, device=DEVICE)
    with caplog.at_level(logging.INFO, logger=dispatch.__name__):
        res = ops.sparse_mla_prefill(prefill.q, prefill.kv, prefill.indices, prefill.sm_scale, **prefill.kwargs())
        testing.assert_matches_oracle(res, prefill.oracle(), decode=False)
        plan = fp8.plan()
        assert (plan.backend, plan.path, plan.kernel) == ("triton", "paged_fp8", "triton_paged_fp8")
        testing.assert_matches_oracle(fp8.run(), fp8.oracle(), decode=True)
        q64 = prefill.q.new_zeros(3, 64, 512)
        assert dispatch.prefill_kernel(q64, prefill.kv).kernel == "tilelang_sm90"
    want = [
        dict(op="prefill", kernel="triton_portable", reason=f"{HEADS_NOTE.format(16)}; {GLUON_HEADS.format(16)}"),
        dict(op="decode", kernel="paged_fp8: triton_paged_fp8",
             reason=f"{HEADS_NOTE.format(8)}; backend triton, MODEL1 fp8 caches"),
        dict(op="prefill", kernel="tilelang_sm90", reason="auto: TileLang kernel module imported"),
    ]
    assert ops.kernel_choices() == want
    assert _choice_lines(caplog) == [f"sparse MLA {c['op']} kernel: {c['kernel']} ({c['reason']})" for c in want]


def test_decode_paths_for_other_head_counts(fresh_process, monkeypatch):
    """The buffer kernel of the direct / gathered paths on an SM90: the Gluon kernel for h_q 64, the portable
    one (with the reason) for h_q 16 and 32, whichever way triton was reached."""
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    monkeypatch.setattr(dispatch, "triton_interprets", lambda: False)
    monkeypatch.setattr(dispatch, "cuda_capability", lambda device: (9, 0))
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    cases = [  # (backend, h_q, extra cache) -> kernel, reason
        (("triton", 64, False), "direct: triton_gluon_sm90", "one dense cache, read in place"),
        (("triton", 16, False), "direct: triton_portable", "one dense cache, read in place"),
        ((None, 32, True), "gathered: triton_portable",
         f"{HEADS_NOTE.format(32)}; two dense caches: rows gathered into one buffer"),
        ((None, 64, True), "gathered: tilelang_sm90", "two dense caches: rows gathered into one buffer"),
    ]
    for (backend, h_q, extra), kernel, reason in cases:
        got = dispatch.decode_path(bf16, cuda, None, extra, backend, h_q=h_q)
        assert got == dispatch.KernelChoice("decode", kernel, reason), (backend, h_q)


def test_tilelang_named_with_other_head_counts_is_refused(fresh_process):
    """DEEPINFER_SPARSE_MLA_BACKEND=tilelang (or backend='tilelang') asks for kernels that take 64 or 128
    heads: every entry point refuses h_q 16 under its argument's name, with both accepted sets, and runs
    nothing elsewhere in its place."""
    fresh_process.setitem(sys.modules, KERNEL_MODULE, _fake_kernel_module())
    fresh_process.setenv("DEEPINFER_SPARSE_MLA_BACKEND", "tilelang")
    from engine.h20_ops import flash_mla

    prefill = testing.prefill_case(7, s_q=2, h_q=16, d_qk=512, s_kv=16, topk=8)
    fp8 = testing.flashmla_decode_case(8, batch=1, s_q=1, h_q=16, layout=kv_cache.MODEL1, topk=8, s_kv=20,
                                       block_size=4)
    rest = (r" on the tilelang backend \((DEEPINFER_SPARSE_MLA_BACKEND=tilelang|backend='tilelang')\), got 16; "
            r"the triton backend runs h_q in \(8, 16, 32, 64, 128\)$")
    calls = [
        ("q", lambda: ops.sparse_mla_prefill(prefill.q, prefill.kv, prefill.indices, prefill.sm_scale)),
        ("q", lambda: flash_mla.flash_mla_sparse_fwd(prefill.q, prefill.kv, prefill.indices, prefill.sm_scale)),
        ("q", lambda: dispatch.prefill_kernel(prefill.q, prefill.kv, "tilelang")),
        ("q", lambda: fp8.run()),
        ("h_q", lambda: fp8.plan()),
        ("q", lambda: flash_mla.flash_mla_with_kvcache(fp8.q, fp8.main.cache, None, None, 512,
                                                       flash_mla.get_mla_metadata()[0],
                                                       **testing.flashmla_decode_kwargs(fp8))),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"^{name}: expected h_q in \\(64, 128\\){rest}"):
            call()
    assert ops.kernel_choices() == []
