"""Kernels from a kernel repository: the builder (scripts/build_kernel_repo.py), the offline cache and lock
(scripts/kernel_offline_cache.py), the verified loader (engine/kernel_repo.py), the op table
(engine/kernel_source.py) and the kernelize step (engine/layer_kernels.py).

- The built repository: noarch variants torch-cpu / torch-cuda, metadata.json with kernels' digest of
  every file, the package's exports (engine.h20_ops.__all__, FlashMLA's names when that module exists,
  the ops), the layers module; it loads through kernels (get_local_kernel, LOCAL_KERNELS + get_kernel,
  LocalLayerRepository) with the network blocked, and, from the offline cache and lock under
  HF_HUB_OFFLINE=1, through get_locked_kernel, load_kernel and LockedLayerRepository.
- An edited, added or deleted file (or no digest) is refused before anything is imported, naming it.
- DEEPINFER_KERNEL_SOURCE=hub: the hub ops return what the native ones do, bit for bit; a repository
  that cannot be used raises under DEEPINFER_OPS_STRICT=1 and otherwise runs native, counted per call;
  a user mapping by dotted path is used, and a bad one is an error; `import engine` needs no `kernels`.
- kernelize on transformers' DeepSeek-V4 model: the RMSNorm layer replaces every DeepseekV4RMSNorm
  forward (bit-equal logits with DEEPINFER_KERNELS=ref), SiLU keeps its own; fallbacks counted.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import config, kernel_repo, kernel_source
from engine import ops as native_ops
from engine.h20_ops import kv_cache, plan_sparse_decode, sparse_mla_decode, sparse_mla_prefill
from engine.h20_ops.testing import decode_case, normal_inputs, random_indices

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
REPO_ID = "deepinfer/sparse-mla"
FLASH_MLA_NAMES = {"flash_mla_sparse_fwd", "get_mla_metadata", "flash_mla_with_kvcache"}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


builder = _script("build_kernel_repo")


@pytest.fixture(scope="module")
def kernels_lib():
    return pytest.importorskip("kernels", reason="needs the kernels package (pyproject's test / hf-kernels extras)")


@pytest.fixture(scope="module")
def repo(built_kernel_repo, kernels_lib):
    return built_kernel_repo


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network access in a test that must run offline")

    for name in ("create_connection", "getaddrinfo"):
        monkeypatch.setattr(socket, name, refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


# A prefix for subprocesses that must run offline: every connection attempt raises.
NO_NETWORK = ("import socket\n"
              "def _refuse(*a, **k):\n    raise OSError('network access in a test that must run offline')\n"
              "socket.create_connection = socket.getaddrinfo = socket.socket.connect = _refuse\n")


def _hub_env(monkeypatch, repo_text: str, *, strict: bool, mapping: str | None = None, lock: Path | None = None):
    monkeypatch.setenv("DEEPINFER_KERNEL_SOURCE", "hub")
    monkeypatch.setenv("DEEPINFER_KERNEL_REPO", repo_text)
    monkeypatch.setenv("DEEPINFER_OPS_STRICT", "1" if strict else "0")
    for var, value in ((config.KERNEL_MAPPING.name, mapping), (config.KERNEL_LOCK.name, lock)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(value))
    kernel_source.reset()


# ------------------------------------------------------------------------------------------ builder

def test_build_writes_noarch_variants_with_digests(repo, kernels_lib, tmp_path):
    from kernels._rust import Digest

    variants = sorted(p.name for p in (repo / "build").iterdir())
    assert variants == ["torch-cpu", "torch-cuda"]
    packages = []
    for name, backend in (("torch-cpu", "cpu"), ("torch-cuda", "cuda")):
        variant = repo / "build" / name
        meta = json.loads((variant / "metadata.json").read_text())
        assert meta["name"] == "deepinfer-sparse-mla" and meta["backend"] == {"type": backend}
        assert meta["python-depends"] == [] and meta["version"] == 1
        parsed = kernels_lib.Metadata.read_from_file(variant / "metadata.json")
        parsed.digest.validate(Digest.hash_variant(parsed.digest.algorithm, variant))  # kernels' own check
        listed = set(meta["digest"]["files"])
        on_disk = {p.relative_to(variant).as_posix() for p in variant.rglob("*") if p.is_file()} - {"metadata.json"}
        assert listed == on_disk
        packages.append({rel: (variant / rel).read_bytes() for rel in sorted(listed)})
    assert packages[0] == packages[1]  # noarch: the same files
    pkg = repo / "build" / "torch-cpu" / "deepinfer_sparse_mla"
    assert (pkg / "h20_ops" / "attention" / "dispatch.py").read_bytes() == \
        (ROOT / "engine" / "h20_ops" / "attention" / "dispatch.py").read_bytes()
    exported = set(builder.literal_all(pkg / "__init__.py"))
    assert set(builder.literal_all(ROOT / "engine" / "h20_ops" / "__init__.py")) <= exported
    assert {"rms_norm", "rope", "kv_quantize", "kv_gather_dequant", "hyper_connection"} <= exported
    if (ROOT / "engine" / "h20_ops" / "flash_mla.py").is_file():
        assert FLASH_MLA_NAMES <= exported
    assert "RMSNorm" in builder.literal_all(pkg / "layers.py")
    with pytest.raises(SystemExit, match="not empty"):
        builder.build(repo)


def test_builder_exports_every_modules_all(tmp_path):
    """The package re-exports h20_ops/flash_mla.py's __all__ as soon as that module exists, and layers.py
    every integrations/*_layers.py's; a name exported twice stops the build."""
    engine = tmp_path / "engine"
    shutil.copytree(ROOT / "engine", engine, ignore=shutil.ignore_patterns("__pycache__"))
    (engine / "h20_ops" / "flash_mla.py").write_text(
        '__all__ = ["flash_mla_sparse_fwd", "flash_mla_with_kvcache", "get_mla_metadata"]\n')
    init = builder.package_init(engine)
    assert "from .h20_ops.flash_mla import (" in init
    assert FLASH_MLA_NAMES <= set(eval(init.split("__all__ = ")[1].split("\n")[0]))
    (engine / "integrations" / "more_layers.py").write_text('__all__ = ["RMSNorm"]\n')
    with pytest.raises(SystemExit, match="RMSNorm"):
        builder.layers_module(engine)


# ----------------------------------------------------------------------------- loading through kernels

def test_loads_through_kernels_with_the_network_blocked(repo, kernels_lib, no_network, monkeypatch):
    module = kernels_lib.get_local_kernel(repo)
    assert Path(module.__file__).parent.parent == repo / "build" / "torch-cpu"
    assert callable(module.sparse_mla_prefill) and callable(module.rms_norm)
    monkeypatch.setenv("LOCAL_KERNELS", f"{REPO_ID}={repo}")
    assert kernels_lib.get_kernel(REPO_ID, revision="v1") is module
    layer = kernels_lib.LocalLayerRepository(repo, layer_name="RMSNorm").load()
    assert layer is module.layers.RMSNorm
    assert layer.__init__ is torch.nn.Module.__init__  # kernels' layer rules: no constructor
    assert list(inspect.signature(layer.forward).parameters) == ["self", "hidden_states"]


def test_offline_cache_and_lock_load_under_hf_hub_offline(repo, tmp_path):
    """The offline cache script, then (another process, HF_HUB_OFFLINE=1, no network) kernels' locked
    loaders and the engine's loader; an edited snapshot file is then refused by the engine's loader."""
    cache, lock = tmp_path / "cache", tmp_path / "kernels.lock"
    assert _script("kernel_offline_cache").main([str(repo), "--lock", str(lock), "--cache", str(cache)]) == 0
    (entry,) = json.loads(lock.read_text())
    commit = entry["lock"]["commit"]
    assert entry["dependency"] == {"repo-id": REPO_ID, "version": 1}
    assert (cache / "kernels--deepinfer--sparse-mla" / "refs" / "v1").read_text() == commit
    code = NO_NETWORK + f"""
import json, sys
from pathlib import Path
import kernels
from engine import kernel_repo
from engine.config import LockedKernelRepo
lock = Path({str(lock)!r})
k = kernels.get_locked_kernel({REPO_ID!r}, lockfile=lock)
layer = kernels.LockedLayerRepository({REPO_ID!r}, lockfile=lock, layer_name="RMSNorm").load()
loaded = kernel_repo.load(LockedKernelRepo({REPO_ID!r}, "v1"), lock)
out = {{"file": k.__file__, "same": kernels.load_kernel({REPO_ID!r}, lockfile=lock) is k and loaded.module is k,
       "layer": layer is k.layers.RMSNorm, "commit": loaded.commit, "digest": loaded.digest}}
ops = Path(loaded.variant_path) / "deepinfer_sparse_mla" / "ops.py"
ops.write_bytes(ops.read_bytes() + b"# edited\\n")
try:
    kernel_repo.load(LockedKernelRepo({REPO_ID!r}, "v1"), lock)
except kernel_repo.KernelVerificationError as exc:
    out["refused"] = str(exc)
print(json.dumps(out))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KERNELS_CACHE": str(cache), "PYTHONPATH": PYTHONPATH,
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["file"].startswith(str(cache / "kernels--deepinfer--sparse-mla" / "snapshots" / commit / "build"))
    assert out["same"] and out["layer"] and out["commit"] == commit
    assert out["digest"] == hashlib.sha256((repo / "build" / "torch-cpu" / "metadata.json").read_bytes()).hexdigest()
    assert "edited file deepinfer_sparse_mla/ops.py" in out["refused"]


def test_locked_repository_errors_name_the_problem(repo, tmp_path):
    lock = tmp_path / "kernels.lock"
    commit = "0123456789abcdef0123456789abcdef01234567"
    lock.write_text(json.dumps([{"dependency": {"repo-id": REPO_ID, "version": 1}, "lock": {"commit": commit}}]))
    with pytest.raises(kernel_repo.KernelRepoError, match="asks for revision v2.*locks deepinfer/sparse-mla v1"):
        kernel_repo.load(config.LockedKernelRepo(REPO_ID, "v2"), lock)
    with pytest.raises(kernel_repo.KernelRepoError, match="does not lock other/repo"):
        kernel_repo.load(config.LockedKernelRepo("other/repo", "v1"), lock)
    with pytest.raises(kernel_repo.KernelRepoError, match=f"no snapshot of {REPO_ID} at commit {commit}"):
        kernel_repo.load(config.LockedKernelRepo(REPO_ID, commit), lock)
    with pytest.raises(kernel_repo.KernelRepoError, match="does not exist"):
        kernel_repo.load(config.LockedKernelRepo(REPO_ID, "v1"), tmp_path / "absent.lock")


@pytest.mark.parametrize("change,message", [
    ("edit", "edited file deepinfer_sparse_mla/h20_ops/attention/prefill.py"),
    ("add", "added file deepinfer_sparse_mla/extra.py"),
    ("delete", "missing file deepinfer_sparse_mla/ops.py"),
    ("no digest", "no digest"),
])
def test_a_changed_variant_is_refused_before_import(repo, tmp_path, monkeypatch, kernels_lib, change, message):
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy)
    variant = copy / "build" / "torch-cuda"  # a variant this CPU machine would not even load
    pkg = variant / "deepinfer_sparse_mla"
    if change == "edit":
        path = pkg / "h20_ops" / "attention" / "prefill.py"
        path.write_text(path.read_text().replace("run non-causal", "run causal"))
    elif change == "add":
        (pkg / "extra.py").write_text("x = 1\n")
    elif change == "delete":
        (pkg / "ops.py").unlink()
    else:
        meta = json.loads((variant / "metadata.json").read_text())
        del meta["digest"]
        (variant / "metadata.json").write_text(json.dumps(meta))
    monkeypatch.setattr(kernels_lib, "get_local_kernel", lambda *a, **k: pytest.fail("imported before verification"))
    with pytest.raises(kernel_repo.KernelVerificationError, match="torch-cuda") as err:
        kernel_repo.load(config.LocalKernelRepo(copy))
    assert message in str(err.value)


# ------------------------------------------------------------------------------------- the op table

def test_hub_ops_equal_the_native_ones_bit_for_bit(repo, monkeypatch):
    _hub_env(monkeypatch, str(repo), strict=True)
    rep = kernel_source.report()
    assert rep["ops"] == {name: "hub" for name in kernel_source.OPS}
    assert rep["variant"] == "torch-cpu" and rep["commit"] is None and rep["fallbacks"] == {}
    assert rep["digest"] == hashlib.sha256((repo / "build" / "torch-cpu" / "metadata.json").read_bytes()).hexdigest()
    module = kernel_source.loaded_kernel().module
    assert kernel_source.op("sparse_mla_prefill") is module.sparse_mla_prefill
    assert kernel_source.attention_dispatch() is module.h20_ops.attention.dispatch

    gen = torch.Generator().manual_seed(0)
    q = normal_inputs(gen, 6, 64, 512).bfloat16()
    kv = normal_inputs(gen, 40, 1, 512).bfloat16()
    idx = random_indices(gen, 6, 40, 32, 24, (-1, 40))
    lengths = torch.tensor([32, 0, 5, 32, 20, 1], dtype=torch.int32)
    sink = normal_inputs(gen, 64).float()
    args = (q, kv, idx, 512 ** -0.5)
    hub, native = (f(*args, attn_sink=sink, topk_length=lengths) for f in (kernel_source.op("sparse_mla_prefill"),
                                                                           sparse_mla_prefill))
    assert torch.equal(hub.out, native.out) and torch.equal(hub.lse_log2, native.lse_log2)

    case = decode_case(1, batch=2, s_q=1, h_q=64, topk=16, extra_topk=8, layout=kv_cache.MODEL1,
                       block_sizes=(16, 8))
    shapes = dict(batch=2, s_q=1, h_q=64, topk=16, q_dtype=case.q.dtype, extra_cache=case.extra.cache, extra_topk=8)
    results = []
    for plan_fn, decode_fn in ((kernel_source.op("plan_sparse_decode"), kernel_source.op("sparse_mla_decode")),
                               (plan_sparse_decode, sparse_mla_decode)):
        plan = plan_fn(case.main.cache, **shapes)
        results.append(decode_fn(case.q, case.main.cache, case.indices, case.sm_scale, plan=plan, **case.kwargs()))
    assert torch.equal(results[0].out, results[1].out) and torch.equal(results[0].lse_log2, results[1].lse_log2)

    x, w = normal_inputs(gen, 5, 3, 128), normal_inputs(gen, 128) + 1
    cos, sin = normal_inputs(gen, 5, 32), normal_inputs(gen, 5, 32)
    assert torch.equal(kernel_source.op("rms_norm")(x, w, 1e-6), native_ops.rms_norm(x, w, 1e-6))
    assert torch.equal(kernel_source.op("rope")(x, cos, sin), native_ops.rope(x, cos, sin))
    hc_args = (normal_inputs(gen, 5, 4, 128).bfloat16(), normal_inputs(gen, 5, 24, scale=2.0),
               normal_inputs(gen, 3) + 1, normal_inputs(gen, 24, scale=1.0), 1e-6, 20)
    hc_hub, hc_native = kernel_source.op("hyper_connection")(*hc_args), native_ops.hyper_connection(*hc_args)
    assert all(torch.equal(a, b) for a, b in zip(hc_hub, hc_native))
    rows = normal_inputs(gen, 4, 1, 512)
    slots = torch.tensor([3, -1, 0, 9], dtype=torch.int64)
    caches = [kv_cache.new_fp8_kv_cache(kv_cache.MODEL1, 2, 8, "cpu") for _ in range(2)]
    kernel_source.op("kv_quantize")(caches[0], slots, rows)
    native_ops.kv_quantize(caches[1], slots, rows)
    assert torch.equal(caches[0], caches[1])
    read = [torch.zeros(1, 2, 1, 512) for _ in range(2)]
    kernel_source.op("kv_gather_dequant")(caches[0], slots[[0, 2]].view(1, 2), read[0])
    native_ops.kv_gather_dequant(caches[1], slots[[0, 2]].view(1, 2), read[1])
    assert torch.equal(read[0], read[1])
    assert kernel_source.fallback_counts() == {}


def test_an_unusable_repository_raises_under_strict_and_falls_back_counted_otherwise(repo, tmp_path, monkeypatch):
    tampered = tmp_path / "tampered"
    shutil.copytree(repo, tampered)
    (tampered / "build" / "torch-cpu" / "deepinfer_sparse_mla" / "rope_extra.py").write_text("")
    for where, why in ((tmp_path / "absent", "does not exist"),
                       (tampered, "added file deepinfer_sparse_mla/rope_extra.py")):
        _hub_env(monkeypatch, str(where), strict=True)
        with pytest.raises(kernel_source.KernelSourceError, match=f"{why}.*DEEPINFER_OPS_STRICT=1"):
            kernel_source.op("rms_norm")
        _hub_env(monkeypatch, str(where), strict=False)
        assert kernel_source.op("rms_norm") is native_ops.rms_norm
        kernel_source.op("rms_norm")
        kernel_source.op("sparse_mla_decode")
        rep = kernel_source.report()
        assert rep["fallbacks"] == {"rms_norm": 2, "sparse_mla_decode": 1}
        assert rep["ops"] == {name: "native" for name in kernel_source.OPS} and why in rep["problem"]
        assert rep["source"] == "hub" and rep["digest"] is None
    with pytest.raises(ValueError, match="not a routed op"):
        kernel_source.op("flash_attn")


def test_without_the_kernels_package(repo, monkeypatch):
    monkeypatch.setitem(sys.modules, "kernels", None)  # `import kernels` raises ModuleNotFoundError
    _hub_env(monkeypatch, str(repo), strict=True)
    with pytest.raises(kernel_source.KernelSourceError, match="`kernels` package is not installed"):
        kernel_source.report()
    _hub_env(monkeypatch, str(repo), strict=False)
    assert kernel_source.op("rope") is native_ops.rope
    assert kernel_source.fallback_counts() == {"rope": 1}


def test_import_engine_works_without_kernels():
    """A fresh process where `import kernels` fails: engine imports and its ops run natively; kernels was
    never needed."""
    code = """
import sys
sys.modules["kernels"] = None
import engine, engine.kernel_source, engine.kv_store, engine.model.deepseek_v4, engine.serve_dp, engine.layer_kernels
import torch
x = torch.randn(2, 8)
y = engine.kernel_source.op("rms_norm")(x, None, 1e-6)
assert torch.equal(y, engine.ops.rms_norm(x, None, 1e-6))
print(engine.kernel_source.report()["source"], sys.modules["kernels"])
"""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "DEEPINFER_KERNELS": "ref"}
    for var in (config.KERNEL_SOURCE, *config.TEXT_VARIABLES):
        env.pop(var.name, None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["native", "None"]


MAPPING_MODULE = '''
calls = []
value = 3


def ops_for(kernel):
    def rms_norm(x, weight=None, eps=1e-6):
        calls.append(tuple(x.shape))
        return kernel.rms_norm(x, weight, eps)

    return {"rms_norm": rms_norm}


def not_a_mapping(kernel):
    return [kernel.rms_norm]


def unknown_op(kernel):
    return {"flash_attn": kernel.rms_norm}


def not_callable(kernel):
    return {"rope": 3}


def reentrant(kernel):
    from engine import kernel_source

    return {"rope": kernel_source.op("rope")}
'''


@pytest.fixture
def mapping_module(tmp_path, monkeypatch):
    name = "deepinfer_test_user_mapping"
    (tmp_path / f"{name}.py").write_text(MAPPING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_user_mapping_by_dotted_path_is_used(repo, monkeypatch, mapping_module):
    _hub_env(monkeypatch, str(repo), strict=True, mapping=f"{mapping_module}:ops_for")
    x = normal_inputs(torch.Generator().manual_seed(3), 3, 64)
    assert torch.equal(kernel_source.op("rms_norm")(x, None, 1e-6), native_ops.rms_norm(x, None, 1e-6))
    assert sys.modules[mapping_module].calls == [(3, 64)]
    rep = kernel_source.report()
    assert rep["mapping"] == f"{mapping_module}:ops_for"
    assert rep["ops"] == {name: "mapping" if name == "rms_norm" else "hub" for name in kernel_source.OPS}


@pytest.mark.parametrize("target,message", [
    ("deepinfer_no_such_module:ops_for", "cannot import deepinfer_no_such_module"),
    ("{m}:absent", "has no attribute 'absent'"),
    ("{m}:value", "expected a callable, got int"),
    ("{m}:not_a_mapping", "returned list; expected a mapping"),
    ("{m}:unknown_op", "unknown op name(s) flash_attn"),
    ("{m}:not_callable", "the value for rope is not callable"),
    ("{m}:reentrant", "used engine.kernel_source while the op table was being resolved"),
])
def test_a_bad_user_mapping_is_an_error(repo, monkeypatch, mapping_module, target, message):
    target = target.format(m=mapping_module)
    _hub_env(monkeypatch, str(repo), strict=False, mapping=target)  # an error even without strict
    with pytest.raises(kernel_source.KernelSourceError) as err:
        kernel_source.op("rms_norm")
    assert f"DEEPINFER_KERNEL_MAPPING={target}" in str(err.value) and message in str(err.value)


# ------------------------------------------------------------------------------------------ kernelize

@pytest.fixture(scope="module")
def oracle_model(tmp_path_factory):
    from engine.model import tiny
    from engine.model.hf_oracle import load_hf_model

    checkpoint = tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)
    return lambda: load_hf_model(checkpoint, dtype=torch.float32, device="cpu")


def _norms(model):
    return [m for m in model.modules() if type(m).__name__ == "DeepseekV4RMSNorm"]


def test_kernelize_the_oracle_model(repo, kernels_lib, oracle_model, monkeypatch):
    from engine import layer_kernels

    model = oracle_model()
    if getattr(type(_norms(model)[0]), "kernel_layer_name", None) != "RMSNorm":
        pytest.skip("this transformers does not accept the installed kernels (no hub layer names)")
    monkeypatch.setenv("DEEPINFER_KERNELS", "ref")
    ids = torch.tensor([[1, 17, 99, 4, 250, 3, 8]])
    with torch.no_grad():
        eager = model(ids).logits
    _hub_env(monkeypatch, str(repo), strict=True)
    layer = kernel_source.loaded_kernel().module.layers.RMSNorm
    silu = [m for m in model.modules() if getattr(type(m), "kernel_layer_name", None) == "SiLU"]
    assert silu  # a hub layer that is not mapped: NO_LAYER keeps its forward under strict
    layer_kernels.kernelize(model, device="cpu")
    assert all(m.forward.__func__ is layer.forward for m in _norms(model))
    assert all(m.forward.__func__ is type(m).forward for m in silu)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager)  # DEEPINFER_KERNELS=ref: transformers' own arithmetic

    model = oracle_model()
    _hub_env(monkeypatch, str(repo.parent / "absent"), strict=True)
    with pytest.raises(kernel_source.KernelSourceError, match="does not exist"):
        layer_kernels.kernelize(model, device="cpu")
    _hub_env(monkeypatch, str(repo.parent / "absent"), strict=False)
    layer_kernels.kernelize(model, device=torch.device("cpu"))
    native = layer_kernels.native_layers()["RMSNorm"]
    assert all(m.forward.__func__ is native.forward for m in _norms(model))
    assert kernel_source.fallback_counts() == {"layer RMSNorm": len(_norms(model))}
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager)
