"""DEEPINFER_* variables: defaults, normalisation and errors that name variable, value and choices."""

from pathlib import Path

import pytest

from engine import config


def test_defaults_when_unset_or_empty():
    assert config.validate_all({}) == {
        "DEEPINFER_SPARSE_MLA_BACKEND": None,
        "DEEPINFER_SIMULATE_NO_TILELANG": "0",
        "DEEPINFER_KERNELS": "triton",
        "DEEPINFER_OPS_STRICT": "0",
        "DEEPINFER_USE_NEXTN_DECODE": "0",
        "DEEPINFER_KERNEL_SOURCE": "native",
        "DEEPINFER_KERNEL_REPO": None,
        "DEEPINFER_KERNEL_LOCK": None,
        "DEEPINFER_KERNEL_MAPPING": None,
    }
    assert config.sparse_mla_backend({"DEEPINFER_SPARSE_MLA_BACKEND": "  "}) is None


def test_values_are_normalised():
    env = {"DEEPINFER_SPARSE_MLA_BACKEND": " Triton ", "DEEPINFER_SIMULATE_NO_TILELANG": "1",
           "DEEPINFER_KERNELS": "REF", "DEEPINFER_OPS_STRICT": "1", "DEEPINFER_USE_NEXTN_DECODE": "1"}
    assert config.sparse_mla_backend(env) == "triton"
    assert config.simulate_no_tilelang(env) and config.ops_strict(env) and config.use_nextn_decode(env)
    assert config.kernels(env) == "ref"


@pytest.mark.parametrize("var,value", [
    ("DEEPINFER_SPARSE_MLA_BACKEND", "flashmla"),
    ("DEEPINFER_SIMULATE_NO_TILELANG", "yes"),
    ("DEEPINFER_KERNELS", "cuda"),
    ("DEEPINFER_OPS_STRICT", "true"),
    ("DEEPINFER_USE_NEXTN_DECODE", "2"),
    ("DEEPINFER_KERNEL_SOURCE", "kernels"),
])
def test_bad_value_names_variable_value_and_choices(var, value):
    spec = next(v for v in config.ALL_VARIABLES if v.name == var)
    with pytest.raises(config.ConfigError) as err:
        config.validate_all({var: value})
    message = str(err.value)
    assert var in message and repr(value) in message
    assert all(choice in message for choice in spec.allowed)


def test_reads_the_process_environment_at_call_time(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNELS", "ref")
    assert config.kernels() == "ref"
    monkeypatch.setenv("DEEPINFER_KERNELS", "bogus")
    with pytest.raises(config.ConfigError, match="DEEPINFER_KERNELS"):
        config.kernels()


def test_kernel_source_settings():
    hub = {"DEEPINFER_KERNEL_SOURCE": "hub"}
    local = config.kernel_source_settings({**hub, "DEEPINFER_KERNEL_REPO": " ./repo ", "DEEPINFER_OPS_STRICT": "1"})
    assert local.repo == config.LocalKernelRepo(Path("repo")) and local.lockfile is None and local.strict
    locked = config.kernel_source_settings({**hub, "DEEPINFER_KERNEL_REPO": "deepinfer/sparse-mla@v1",
                                            "DEEPINFER_KERNEL_LOCK": "/x/kernels.lock",
                                            "DEEPINFER_KERNEL_MAPPING": "my_pkg.kernel_map:ops_for"})
    assert locked.repo == config.LockedKernelRepo("deepinfer/sparse-mla", "v1")
    assert locked.lockfile == Path("/x/kernels.lock") and locked.mapping == ("my_pkg.kernel_map", "ops_for")
    assert config.kernel_source_settings({}).source == "native"


@pytest.mark.parametrize("env,names", [
    ({"DEEPINFER_KERNEL_SOURCE": "hub"}, ["DEEPINFER_KERNEL_REPO"]),
    ({"DEEPINFER_KERNEL_SOURCE": "hub", "DEEPINFER_KERNEL_REPO": "relative/dir"}, ["'relative/dir'", "./"]),
    ({"DEEPINFER_KERNEL_SOURCE": "hub", "DEEPINFER_KERNEL_REPO": "org/name@v1"}, ["DEEPINFER_KERNEL_LOCK"]),
    ({"DEEPINFER_KERNEL_SOURCE": "hub", "DEEPINFER_KERNEL_REPO": "/repo", "DEEPINFER_KERNEL_LOCK": "k.lock"},
     ["DEEPINFER_KERNEL_LOCK", "local path"]),
    ({"DEEPINFER_KERNEL_SOURCE": "hub", "DEEPINFER_KERNEL_REPO": "/repo", "DEEPINFER_KERNEL_MAPPING": "pkg.mod"},
     ["DEEPINFER_KERNEL_MAPPING", "package.module:function"]),
    ({"DEEPINFER_KERNEL_MAPPING": "pkg.mod:fn"}, ["DEEPINFER_KERNEL_MAPPING", "DEEPINFER_KERNEL_SOURCE=native"]),
])
def test_kernel_source_errors_name_the_variables(env, names):
    with pytest.raises(config.ConfigError) as err:
        config.validate_all(env)
    assert all(n in str(err.value) for n in names), str(err.value)
