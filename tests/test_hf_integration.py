"""transformers' DeepseekV4ForCausalLM through this project's kernels (engine/integrations), on the tiny
checkpoint, against transformers' eager model in float32.

The three ways: attn_implementation="deepinfer_sparse_mla" (register()), the kernel repository's sparse
attention layer bound by kernelize, and a KernelConfig with the repository's layouts (CPU: the
registrations + kernelize). The repository is built from this checkout (scripts/build_kernel_repo.py)
and loaded through LOCAL_KERNELS, as offline users load it.

Tolerances: logits are O(10) and the tiny model (initializer_range 0.2) amplifies rounding: eager
with an exact (float64) attention differs from eager by 3.5e-5 - 6.9e-5 on 12-24 token prompts and by
1.2e-4 on a 140-token prompt (measured on CPU, 2026-12-02), while every layer's attention output here
agrees with eager's to 2e-6 (ATTENTION_ATOL), and eager itself moves by up to 1.3e-4 when the same
prompt runs in a batch of two. So: LOGITS_ATOL = 3e-4 on the short prompt (the sparse kernel under
Triton's interpreter; measured 5.6e-5 - 8.2e-5 over four seeds on one 2-core CPU machine, 1.2e-4 -
1.5e-4 on another, 2026-12-04: CPUs round float32 matmuls differently), LONG_LOGITS_ATOL = 5e-4 on the
140-token prompt (the float32 reference backend: 140 query rows under the interpreter would take
minutes; measured 1.1e-4 - 2.6e-4 over four seeds) and on a batch of two short prompts (1.3e-4);
greedy tokens equal everywhere.
"""

import sys
import tempfile
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if transformers.__version__ != "5.21.1":
    pytest.skip("the integration is pinned to transformers 5.21.1", allow_module_level=True)

import engine.h20_ops  # noqa: E402,F401  (TRITON_INTERPRET before transformers imports triton)
from engine.integrations import hf_layers  # noqa: E402
from engine.integrations import transformers as hf  # noqa: E402
from engine.model import tiny  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import build_kernel_repo  # noqa: E402

REPO_ID, REVISION = build_kernel_repo.REPO_ID, build_kernel_repo.REVISION

LOGITS_ATOL = 3e-4
LONG_LOGITS_ATOL = 5e-4
ATTENTION_ATOL = 1e-5
NEW_TOKENS = 3


def _prompt(n, seed):
    return torch.randint(2, 258, (1, n), generator=torch.Generator().manual_seed(seed))


SHORT = _prompt(16, 0)  # sliding window + 4 ratio-4 entries; no ratio-128 entry yet
LONG = _prompt(140, 1)  # past the 128-token window: 35 ratio-4 entries, one ratio-128 entry


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0))


def _load(path, **kwargs):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@pytest.fixture(scope="module")
def eager(checkpoint):
    return _load(checkpoint)


@torch.no_grad()
def _run(model, ids):
    """(logits of a forward over ids, greedy tokens and their step logits from generate)."""
    logits = model(ids).logits
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    return logits, out.sequences[0, ids.shape[1]:].tolist(), torch.stack(out.logits)


@pytest.fixture(scope="module")
def eager_short(eager):
    return _run(eager, SHORT)


def _assert_matches(run, reference, atol):
    logits, tokens, step_logits = run
    ref_logits, ref_tokens, ref_step_logits = reference
    assert tokens == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= atol
    assert (step_logits - ref_step_logits).abs().max().item() <= atol


@pytest.fixture(scope="module")
def kernel_repo(built_kernel_repo):
    root = built_kernel_repo
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCAL_KERNELS", f"{REPO_ID}={root}")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root


def _repo_layer(name):
    from kernels import LayerRepository

    return LayerRepository(REPO_ID, layer_name=name, revision=REVISION).load()


def _count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _reset_dispatchers():
    """This checkout's dispatcher and those of the kernel repository's copies loaded so far."""
    for name, module in list(sys.modules.items()):
        if name.endswith(".h20_ops.attention.dispatch"):
            module.reset_resolution_for_tests()


@pytest.fixture
def ref_backend(monkeypatch):
    """The float32 reference as the sparse MLA backend (every copy of the dispatcher)."""
    monkeypatch.setenv("DEEPINFER_SPARSE_MLA_BACKEND", "ref")
    _reset_dispatchers()
    yield
    monkeypatch.delenv("DEEPINFER_SPARSE_MLA_BACKEND")
    _reset_dispatchers()


# ----------------------------------------------------------------------------------------------
# 1. attn_implementation="deepinfer_sparse_mla"


def test_registered_attention_matches_eager(checkpoint, eager_short, monkeypatch):
    hf.register()
    model = _load(checkpoint, attn_implementation=hf.ATTENTION_NAME)
    calls = _count_calls(monkeypatch, hf, "sparse_attention")
    _assert_matches(_run(model, SHORT), eager_short, LOGITS_ATOL)
    # 4 layers x (the forward, generate's prefill and its 2 decode steps)
    assert len(calls) == 4 * (2 + NEW_TOKENS - 1)


def test_registered_attention_agrees_with_eager_per_layer(checkpoint, ref_backend):
    """Every attention call (each layer type, prefill past the window and decode) on the same inputs
    as eager's: the model runs eager's output, the sparse one is compared with it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    hf.register()
    diffs = {}

    def both(module, query, key, value, attention_mask, **kwargs):
        reference, _ = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
        out, _ = hf.sparse_mla_attention(module, query, key, value, attention_mask, **kwargs)
        diffs.setdefault(module.layer_type, []).append((out - reference).abs().max().item())
        return reference, None

    AttentionInterface.register("deepinfer_test_both", both)
    AttentionMaskInterface.register("deepinfer_test_both", eager_mask)
    with torch.no_grad():  # 140 query rows: the float32 reference backend, not the interpreter
        _load(checkpoint, attn_implementation="deepinfer_test_both").generate(LONG, max_new_tokens=2, do_sample=False)
    assert set(diffs) == {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert max(max(d) for d in diffs.values()) <= ATTENTION_ATOL


def test_without_a_mask_every_row_is_attended_and_the_window_is_positional(ref_backend):
    """No mask: the registered attention attends every row (as eager does); the layer's window is
    the positional one, the same as the window of transformers' sliding-window mask."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    torch.manual_seed(0)
    q, kv = 0.1 * torch.randn(2, 64, 5, 512), 0.1 * torch.randn(2, 1, 9, 512)
    module = torch.nn.Module()
    module.num_key_value_groups, module.sinks, module.training = 64, torch.randn(64), False
    reference, _ = eager_attention_forward(module, q, kv, kv, None, scaling=512 ** -0.5)
    out, _ = hf.sparse_mla_attention(module, q, kv, kv, None, 512 ** -0.5, s_aux=module.sinks)
    assert (out - reference).abs().max().item() <= ATTENTION_ATOL
    n_rows, seq_len, window = 9, 5, 3  # 4 cached rows, then 5 queries
    query_rows = torch.arange(n_rows - seq_len, n_rows)[:, None]
    allowed = (torch.arange(n_rows)[None, :] <= query_rows) & (torch.arange(n_rows)[None, :] > query_rows - window)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    assert torch.equal(hf_layers.window_entries(None, n_rows, seq_len, window, torch.device("cpu")),
                       hf_layers.window_entries(mask, n_rows, seq_len, window, torch.device("cpu")))


def test_sparse_paths_keep_batch_entries_apart(checkpoint, eager, kernel_repo, ref_backend):
    ids = torch.cat([SHORT, _prompt(16, 2)])
    with torch.no_grad():
        reference = eager(ids).logits
        hf.register()
        registered = _load(checkpoint, attn_implementation=hf.ATTENTION_NAME)(ids).logits
        layer = hf.kernelize_sparse_attention(_load(checkpoint), REPO_ID, REVISION)(ids).logits
    # (a batch entry attending the other's rows would move logits by O(1))
    assert (registered - reference).abs().max().item() <= LONG_LOGITS_ATOL
    assert (layer - reference).abs().max().item() <= LONG_LOGITS_ATOL


def test_registered_attention_rejects_what_it_cannot_compute():
    q = torch.zeros(1, 64, 2, 512)
    kv = torch.zeros(1, 1, 3, 512)
    sinks = torch.zeros(64)
    with pytest.raises(ValueError, match="value: expected the key tensor itself"):
        hf.sparse_mla_attention(None, q, kv, kv.clone(), None, 0.1, s_aux=sinks)
    with pytest.raises(ValueError, match=r"key: expected \[B, 1, N, D\]"):
        two_heads = torch.zeros(1, 2, 3, 512)
        hf.sparse_mla_attention(None, q, two_heads, two_heads, None, 0.1, s_aux=sinks)
    with pytest.raises(ValueError, match="s_aux: expected the attention sinks"):
        hf.sparse_mla_attention(None, q, kv, kv, None, 0.1)
    with pytest.raises(ValueError, match="dropout: the sparse MLA kernel has no dropout"):
        hf.sparse_mla_attention(None, q, kv, kv, None, 0.1, dropout=0.1, s_aux=sinks)


# ----------------------------------------------------------------------------------------------
# 2. the sparse attention layer (kernelize)


def test_sparse_attention_layer_matches_eager(checkpoint, eager_short, kernel_repo, monkeypatch):
    model = hf.kernelize_sparse_attention(_load(checkpoint), REPO_ID, REVISION)
    layer = _repo_layer(hf.SPARSE_ATTENTION)
    assert all(decoder.self_attn.forward.__func__ is layer.forward for decoder in model.model.layers)
    calls = _count_calls(monkeypatch, sys.modules[layer.__module__], "sparse_attention")
    _assert_matches(_run(model, SHORT), eager_short, LOGITS_ATOL)
    assert len(calls) == 4 * (2 + NEW_TOKENS - 1)


def test_sparse_paths_match_eager_past_the_window(checkpoint, eager, kernel_repo, ref_backend):
    """140 tokens: sliding rows leave the window, the ratio-128 layer has an entry, the indexer picks
    among 35 (the float32 reference backend; see the module doc)."""
    reference = _run(eager, LONG)
    hf.register()
    _assert_matches(_run(_load(checkpoint, attn_implementation=hf.ATTENTION_NAME), LONG), reference, LONG_LOGITS_ATOL)
    model = hf.kernelize_sparse_attention(_load(checkpoint), REPO_ID, REVISION)
    _assert_matches(_run(model, LONG), reference, LONG_LOGITS_ATOL)


def test_compressed_entries_equal_transformers_compressors(eager):
    """The sparse layer's pooling of the compressors (no indexer, no dense bias) is transformers' to the
    bit, with the cache (a prefill past a window boundary, one token, a chunk) and without."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    chunks = [torch.randn(1, n, eager.config.hidden_size) for n in (130, 1, 9)]
    for layer_idx, overlapping in ((1, True), (2, False)):
        compressor = eager.model.layers[layer_idx].self_attn.compressor
        theirs_cache, ours_cache = DynamicCache(config=eager.config), DynamicCache(config=eager.config)
        start = 0
        with torch.no_grad():
            for hidden in chunks:
                positions = torch.arange(start, start + hidden.shape[1]).unsqueeze(0)
                q_residual = torch.randn(1, hidden.shape[1], eager.config.q_lora_rank)
                theirs, _ = compressor(hidden, q_residual, positions, theirs_cache, layer_idx)
                ours = hf_layers.compressed_entries(compressor, hidden, ours_cache, layer_idx, overlapping)
                assert torch.equal(ours, theirs[:, 0])
                start += hidden.shape[1]
            assert ours.shape[1] == (140 // 4 if overlapping else 1)
            q_residual = torch.randn(1, 130, eager.config.q_lora_rank)
            theirs, _ = compressor(chunks[0], q_residual, torch.arange(130)[None], None, layer_idx)
            assert torch.equal(hf_layers.compressed_entries(compressor, chunks[0], None, layer_idx, overlapping),
                               theirs[:, 0])


# ----------------------------------------------------------------------------------------------
# 3. KernelConfig: layouts and a fused module


def _saved_keys(model, directory):
    from safetensors import safe_open

    model.save_pretrained(directory)
    keys = set()
    for file in Path(directory).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys.update(f.keys())
    return keys


def _eager_rms_norm_calls(eager):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in eager.modules()
             if type(m) is DeepseekV4RMSNorm]
    try:
        _run(eager, SHORT)
    finally:
        for hook in hooks:
            hook.remove()
    return len(calls)


def test_kernel_config_layouts_on_cpu(checkpoint, eager, eager_short, kernel_repo, monkeypatch):
    from torch import nn

    monkeypatch.setenv("DEEPINFER_KERNELS", "triton")
    monkeypatch.setenv("DEEPINFER_OPS_STRICT", "1")  # the Triton RMSNorm runs, or the test fails
    try:
        model = hf.from_pretrained_on_cpu(checkpoint, hf.kernel_config(REPO_ID, REVISION), dtype=torch.float32)
        norm_layout = model.model.norm
        fused = model.model.layers[0].attn_hc
        assert type(norm_layout).__name__ == "RMSNormScaleLayout"
        assert type(fused).__name__ == "HyperConnectionNormLayout"
        assert isinstance(model.model.layers[0].input_layernorm, nn.Identity)
        assert type(fused.norm).__name__ == "RMSNormScaleLayout"  # the fused norm is a layout too
        # the kernels are bound, not the layouts' reference forwards
        assert norm_layout.forward.__func__ is _repo_layer("RMSNormScale").forward
        assert fused.forward.__func__ is _repo_layer("HyperConnectionNorm").forward
        attention = _repo_layer(hf.SPARSE_ATTENTION)
        assert all(decoder.self_attn.forward.__func__ is attention.forward for decoder in model.model.layers)
        # every weight came from the checkpoint: the originals, renamed
        state = model.state_dict()
        original = eager.state_dict()
        assert torch.equal(state["model.norm.scale"], original["model.norm.weight"])
        assert torch.equal(state["model.layers.0.attn_hc.norm.scale"],
                           original["model.layers.0.input_layernorm.weight"])
        assert torch.equal(state["model.layers.1.self_attn.kv_norm.scale"],
                           original["model.layers.1.self_attn.kv_norm.weight"])
        assert len(state) == len(original)

        norms, fusions = [], []
        for module in model.modules():
            if type(module).__name__ == "RMSNormScaleLayout":
                module.register_forward_hook(lambda *_: norms.append(1))
            if type(module).__name__ == "HyperConnectionNormLayout":
                module.register_forward_hook(lambda *_: fusions.append(1))
        layer_module = sys.modules[attention.__module__]
        attention_calls = _count_calls(monkeypatch, layer_module, "sparse_attention")
        norm_calls = _count_calls(monkeypatch, layer_module.ops, "rms_norm")
        run = _run(model, SHORT)
        _assert_matches(run, eager_short, LOGITS_ATOL)
        forwards = 2 + NEW_TOKENS - 1
        assert len(fusions) == 4 * forwards
        assert len(attention_calls) == 4 * forwards
        assert len(norms) == _eager_rms_norm_calls(eager)  # every DeepseekV4RMSNorm call, now the layout's
        assert len(norm_calls) == len(norms) + len(fusions)  # Triton RMSNorm: the norms + each fusion's own

        # save: transformers' keys (the layouts' renames reverse), then a second load in this
        # process (the renames registered again) from the saved checkpoint
        with tempfile.TemporaryDirectory() as saved, tempfile.TemporaryDirectory() as saved_eager:
            assert _saved_keys(model, saved) == _saved_keys(eager, saved_eager)
            again = hf.from_pretrained_on_cpu(saved, hf.kernel_config(REPO_ID, REVISION), dtype=torch.float32)
            assert again.model.norm.forward.__func__ is _repo_layer("RMSNormScale").forward
            assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), state.values()))
            assert list(again.state_dict()) == list(state)
            with torch.no_grad():
                assert torch.equal(again(SHORT).logits, run[0])
            hf.forget_kernel_config()
            plain = _load(saved)
            assert type(plain.model.norm).__name__ == "DeepseekV4RMSNorm"
            assert list(plain.state_dict()) == list(original)
            assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), original.values()))
    finally:
        hf.forget_kernel_config()


def test_transformers_own_kernel_config_path(checkpoint, eager_short, kernel_repo, monkeypatch):
    """from_pretrained(kernel_config=...) itself (the GPU path: its checks, its mapping, its kernelize)
    with "cpu" admitted as a device type, which transformers 5.21.1 refuses."""
    import transformers.utils.kernel_config as kernel_config_module

    monkeypatch.setattr(kernel_config_module, "KERNELS_SUPPORTED_DEVICE_TYPES",
                        [*kernel_config_module.KERNELS_SUPPORTED_DEVICE_TYPES, "cpu"])
    try:
        model = _load(checkpoint, use_kernels=True, kernel_config=hf.kernel_config(REPO_ID, REVISION))
        assert model.model.norm.forward.__func__ is _repo_layer("RMSNormScale").forward
        assert model.model.layers[0].attn_hc.forward.__func__ is _repo_layer("HyperConnectionNorm").forward
        assert model.model.layers[1].self_attn.forward.__func__ is _repo_layer(hf.SPARSE_ATTENTION).forward
        with torch.no_grad():
            assert (model(SHORT).logits - eager_short[0]).abs().max().item() <= LOGITS_ATOL
    finally:
        hf.forget_kernel_config()


def test_kernel_config_keys_are_anchored():
    assert hf.RMS_NORM_KEY == "^DeepseekV4RMSNorm$"
    import re

    assert re.search(hf.RMS_NORM_KEY, "DeepseekV4RMSNorm")
    assert not re.search(hf.RMS_NORM_KEY, "DeepseekV4UnweightedRMSNorm")
