"""fused_sample: the Philox stream, Triton == oracle token for token, distributions, determinism,
bad input, backend resolution and the TileLang kernels' lowering. Thresholds: docs/sampling.md."""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.h20_ops import sampling as fs
from engine.h20_ops.sampling import reference as ref
from engine.h20_ops.sampling.reference import DRAW_ACCEPT, DRAW_DRAFT
from engine.h20_ops.sampling import triton_kernels as ft

# Rows of -inf logits make the interpreter's numpy compute (-inf) - (-inf) before the mask drops it.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

REPO = Path(__file__).resolve().parents[1]
# Exact checks (Philox words, argmax, determinism) run where the kernels run: the GPU when there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Token-for-token equality with the numpy oracle holds under the CPU interpreter (numpy's exp2); a GPU's
# ex2.approx may move a weight by a few units, so on a GPU scripts/ab_fused_sample.py compares the
# kernels with each other instead.
interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "Triton == numpy oracle token for token is a CPU-interpreter check; on a GPU run scripts/ab_fused_sample.py"))
N_DRAWS = 100_000
CHI2_ALPHA_Z = 3.719  # standard normal quantile at 1 - 1e-4


# ---------------------------------------------------------------- the random stream

def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10 (counter, key) -> output."""
    cases = [
        ((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, -1, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0x299F31D0A4093822,
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, seed, expected in cases:
        words = ref.philox4x32_10(np.array([seed]), *(np.array([c], dtype=np.uint64) for c in counter))
        assert tuple(int(w[0]) for w in words) == expected


def test_triton_draws_equal_reference_stream():
    g = torch.Generator().manual_seed(11)
    n = 24
    seeds = torch.randint(-2**62, 2**62, (n,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**40, (n,), generator=g, dtype=torch.int64)  # high word in use
    positions[:4] = torch.tensor([0, 1, 2**32 - 1, 2**32])
    out = ft.philox_words(seeds.to(DEVICE), positions.to(DEVICE)).cpu()
    expected = np.stack([ref.draw_u32(seeds.numpy(), positions.numpy(), d) for d in range(4)], axis=1)
    assert np.array_equal(out.numpy(), expected.astype(np.int64))
    assert len(np.unique(expected)) == expected.size  # the four lanes are distinct words


def test_draws_are_lanes_of_one_counter_block():
    """Draw d at (seed, p) is lane d % 4 of counter (d // 4, 0, p lo, p hi): curand_init(seed, p, d)."""
    seeds, positions = np.array([5, -9]), np.array([3, 2**33 + 7])
    words = ref.philox4x32_10(seeds, np.uint64(1), np.uint64(0), positions & 0xFFFFFFFF, positions >> 32)
    assert np.array_equal(ref.draw_u32(seeds, positions, 6), words[2])


# ---------------------------------------------------------------- inputs

def _params(n, v, g):
    seeds = torch.randint(0, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    positions = torch.randint(0, 2**34, (n,), generator=g, dtype=torch.int64)
    temperature = 0.4 + 1.2 * torch.rand(n, generator=g)
    temperature[0] = 0.0  # greedy row
    top_k = torch.randint(1, v, (n,), generator=g)
    top_k[1::4] = 0  # off
    top_k[2::5] = v + 3  # off
    top_p = 0.3 + 0.7 * torch.rand(n, generator=g)
    top_p[::3] = 1.0  # off
    return seeds, positions, temperature, top_k, top_p


def _logits(shape, dtype, g):
    x = 2.5 * torch.randn(shape, generator=g)
    x.view(-1, shape[-1])[:, ::7] = float("-inf")
    x[..., 3] = x[..., 4]  # ties
    return x.to(dtype)


def _padded(x):
    """The same values with a row stride larger than the vocabulary (non-contiguous rows)."""
    wide = torch.full((*x.shape[:-1], x.shape[-1] + 5), float("nan"), dtype=x.dtype, device=x.device)
    wide[..., : x.shape[-1]] = x
    return wide[..., : x.shape[-1]]


# ---------------------------------------------------------------- exactness: Triton == oracle

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_first_argmax(dtype):
    g = torch.Generator().manual_seed(1)
    x = _logits((9, 150), dtype, g)
    x[2] = float("-inf")
    x[3, 10] = x[3, 100] = 50.0  # tie of the maxima: the first wins
    x = _padded(x.to(DEVICE))
    got = fs.greedy_sample(x, backend="triton").cpu()
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(x.float().cpu(), dim=1))
    assert got[3] == 10 and got[2] == 0


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_triton_equals_reference(dtype):
    g = torch.Generator().manual_seed(2)
    n, v = 10, 150  # three blocks of 64 under the interpreter, the last one masked
    x = _logits((n, v), dtype, g)
    x[5] = float("-inf")  # nothing to sample: -1
    x = _padded(x)
    params = _params(n, v, g)
    got = fs.sample(x, *params, backend="triton")
    want = fs.sample(x, *params, backend="ref")
    assert torch.equal(got, want)
    assert got[5] == -1 and got[0] == torch.argmax(x[0].float())
    drafted = fs.sample(x, *params, draw=DRAW_DRAFT, backend="triton")
    assert torch.equal(drafted, fs.sample(x, *params, draw=DRAW_DRAFT, backend="ref"))


@interpreter_only
def test_rejection_triton_equals_reference():
    g = torch.Generator().manual_seed(3)
    n, k, v = 8, 3, 100
    params = _params(n, v, g)
    target = _logits((n, k + 1, v), torch.float32, g)
    draft = target[:, :k] + 0.8 * torch.randn(n, k, v, generator=g)
    draft[4] = target[4, :k]  # p_d == p_t: always accepted
    draft_tokens = torch.stack([fs.sample(draft[:, j], params[0], params[1] + j, *params[2:], draw=DRAW_DRAFT,
                                          backend="ref") for j in range(k)], dim=1)
    draft_tokens[6, 0] = v + 9  # not a token: rejected
    draft_tokens[7, 1] = -1
    draft_tokens[0] = torch.argmax(target[0, :k], dim=1)  # greedy row, accepted up to a forced miss
    draft_tokens[0, 2] = (draft_tokens[0, 2] + 1) % v
    got_tokens, got_acc = fs.rejection_sample(target, draft, draft_tokens, *params, backend="triton")
    want_tokens, want_acc = fs.rejection_sample(target, draft, draft_tokens, *params, backend="ref")
    assert torch.equal(got_tokens, want_tokens) and torch.equal(got_acc, want_acc)
    assert got_acc[0] == 2 and got_acc[4] == k and got_acc[6] == 0
    for row in range(n):  # layout: accepted drafts, one corrected or bonus token, then -1
        a = int(got_acc[row])
        assert torch.equal(got_tokens[row, :a], draft_tokens[row, :a])
        assert got_tokens[row, a] >= 0 and bool((got_tokens[row, a + 1:] == -1).all())


@interpreter_only
def test_rejection_bf16_noncontiguous_triton_equals_reference():
    g = torch.Generator().manual_seed(4)
    n, k, v = 4, 1, 70
    params = _params(n, v, g)
    target = _padded(_logits((n, k + 1, v), torch.bfloat16, g))
    draft = _padded(_logits((n, k, v), torch.bfloat16, g))
    draft_tokens = torch.randint(0, v, (n, k), generator=g, dtype=torch.int32)
    got = fs.rejection_sample(target, draft, draft_tokens, *params, backend="triton")
    want = fs.rejection_sample(target, draft, draft_tokens, *params, backend="ref")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@interpreter_only
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rejection_rows_past_2_to_the_31(temperature):
    """Logits laid out [K+1, N, V] and passed transposed: row j of a request starts j * N * V elements
    in, past 2^31 here for the bonus row (K = 2, row stride 2^30); the kernel's offsets are 64-bit.
    The 4 GiB tensor is allocated, never touched beyond the rows used."""
    g = torch.Generator().manual_seed(6)
    k, v, stride = 2, 1000, 2**30
    big = torch.empty(k * stride + v, dtype=torch.bfloat16)
    target = big.as_strided((1, k + 1, v), (v, stride, 1))
    target.copy_(_logits((1, k + 1, v), torch.bfloat16, g))
    draft = target[:, :k].clone()
    draft_tokens = torch.argmax(target[:, :k].float(), dim=-1)  # accepted: the bonus row is read
    params = (torch.tensor([5]), torch.tensor([9]), torch.tensor([temperature]), torch.tensor([0]),
              torch.tensor([1.0]))
    got = fs.rejection_sample(target, draft, draft_tokens, *params, backend="triton")
    want = fs.rejection_sample(target, draft, draft_tokens, *params, backend="ref")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and int(got[1][0]) == k


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # 32-bit / 16-bit logit keys
def test_thresholds_stay_exact_when_exp2_is_not_monotone(monkeypatch, dtype):
    """The kernels search thresholds over logits and then check the bracket in weights. With an exp2
    that is not monotone (numpy's, patched: x3 on a band of arguments, for the interpreter and the
    oracle alike) the logit search lands on wrong thresholds, and the weight bisection must repair
    them: tokens still equal the oracle's."""
    exp2 = np.exp2

    def bumpy_exp2(z):
        z = np.asarray(z)
        return exp2(z) * np.where((z > -3.0) & (z < -2.0), np.float32(3.0), np.float32(1.0)).astype(z.dtype)

    g = torch.Generator().manual_seed(9)
    n, v = 40, 150
    x = torch.linspace(0.0, -6.0, v)[torch.randperm(v, generator=g)].repeat(n, 1).to(dtype)  # z = x * log2(e)
    seeds, positions = _batch(n, 77, g)
    temperature = torch.ones(n)
    top_k = torch.randint(2, 40, (n,), generator=g)
    top_k[::2] = 0
    top_p = 0.2 + 0.7 * torch.rand(n, generator=g)
    top_p[1::4] = 1.0
    monkeypatch.setattr(np, "exp2", bumpy_exp2)
    # the trap is live: the logits' order is not the weights' order, and for some rows the weight of
    # the k-th largest logit is not the k-th largest weight
    w = ref.weights(x.float().numpy(), ref.sampling_scale(temperature).numpy())
    by_logit = np.take_along_axis(w, np.argsort(-x.float().numpy(), axis=1, kind="stable"), axis=1)
    assert (np.diff(by_logit, axis=1) > 0).any()
    k = top_k.numpy()
    rows = np.arange(n)[k > 0]
    assert (by_logit[rows, k[rows] - 1] != -np.sort(-w[rows], axis=1)[np.arange(len(rows)), k[rows] - 1]).any()
    params = (seeds, positions, temperature, top_k, top_p)
    got = fs.sample(x, *params, backend="triton")
    assert torch.equal(got, fs.sample(x, *params, backend="ref"))

# ---------------------------------------------------------------- distributions (oracle)

def _chi2_limit(df: int) -> float:
    """Chi-square quantile at 1 - 1e-4 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + CHI2_ALPHA_Z * math.sqrt(c)) ** 3


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson chi-square of counts against probs over kept tokens; bins with expected < 5 merged."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def _target_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The exact float64 distribution after temperature, top-k and top-p."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    if 0 < top_k < len(p):
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    if top_p < 1.0:
        cum = np.cumsum(q[order])
        cut = int(np.searchsorted(cum, top_p))  # first position reaching top_p
        keep2 = np.zeros_like(keep)
        keep2[order[: cut + 1]] = True
        q = np.where(keep2, q, 0.0)
        q /= q.sum()
    return q


def _assert_distribution(tokens: np.ndarray, probs: np.ndarray):
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "a token outside the kept set was sampled"
    chi2, df = _chi2(counts, probs)
    assert chi2 < _chi2_limit(df), f"chi2 {chi2:.1f} over the limit {_chi2_limit(df):.1f} (df {df})"


def _batch(n, seed_offset, g):
    seeds = torch.arange(n, dtype=torch.int64) + seed_offset
    positions = torch.randint(0, 2**31, (n,), generator=g, dtype=torch.int64)
    return seeds, positions


LOGITS_12 = np.array([2.0, 1.5, 1.4, 0.3, 0.0, -0.4, -0.5, -1.0, -1.7, -2.2, -3.0, -4.1], dtype=np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (1.0, 6, 0.9)])
def test_sampling_reproduces_the_target_distribution(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(5)
    seeds, positions = _batch(N_DRAWS, 1_000_000 * top_k + 17, g)
    logits = torch.from_numpy(np.tile(LOGITS_12, (N_DRAWS, 1)))
    tokens = fs.sample(logits, seeds, positions, torch.full((N_DRAWS,), temperature),
                       torch.full((N_DRAWS,), top_k), torch.full((N_DRAWS,), top_p), backend="ref")
    probs = _target_probs(LOGITS_12, temperature, top_k, top_p)
    _assert_distribution(tokens.numpy(), probs)


def test_chi2_rejects_a_wrong_distribution():
    """Negative control: the same test fails on samples of another temperature."""
    g = torch.Generator().manual_seed(6)
    seeds, positions = _batch(N_DRAWS, 99, g)
    logits = torch.from_numpy(np.tile(LOGITS_12, (N_DRAWS, 1)))
    ones = torch.ones(N_DRAWS)
    tokens = fs.sample(logits, seeds, positions, ones, torch.zeros(N_DRAWS, dtype=torch.int64), ones, backend="ref")
    counts = np.bincount(tokens.numpy(), minlength=12)
    chi2, df = _chi2(counts, _target_probs(LOGITS_12, 0.7, 0, 1.0))
    assert chi2 > 10 * _chi2_limit(df)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.9)])
def test_rejection_sampling_reproduces_the_target_distribution(top_k, top_p):
    g = torch.Generator().manual_seed(7)
    n, k, v = N_DRAWS, 2, 10
    rng = np.random.default_rng(8)
    target_rows = rng.normal(0.0, 1.2, (k + 1, v)).astype(np.float32)
    draft_rows = (target_rows[:k] + rng.normal(0.0, 1.0, (k, v))).astype(np.float32)
    seeds, positions = _batch(n, 5_000_000 + top_k, g)
    temperature = torch.ones(n)
    top_ks = torch.full((n,), top_k)
    top_ps = torch.full((n,), top_p)
    target = torch.from_numpy(np.broadcast_to(target_rows, (n, k + 1, v)).copy())
    draft = torch.from_numpy(np.broadcast_to(draft_rows, (n, k, v)).copy())
    draft_tokens = torch.stack([fs.sample(draft[:, j], seeds, positions + j, temperature, top_ks, top_ps,
                                          draw=DRAW_DRAFT, backend="ref") for j in range(k)], dim=1)
    tokens, accepted = fs.rejection_sample(target, draft, draft_tokens, seeds, positions, temperature, top_ks, top_ps,
                                           backend="ref")
    tokens, accepted = tokens.numpy(), accepted.numpy()
    p_t = [_target_probs(target_rows[j], 1.0, top_k, top_p) for j in range(k + 1)]
    p_d = [_target_probs(draft_rows[j], 1.0, top_k, top_p) for j in range(k)]
    _assert_distribution(tokens[:, 0], p_t[0])
    _assert_distribution(tokens[accepted >= 1, 1], p_t[1])
    _assert_distribution(tokens[accepted == k, k], p_t[k])  # the bonus token
    rate = np.minimum(p_t[0], p_d[0]).sum()
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs((accepted >= 1).mean() - rate) < 4.5 * sigma
    # negative control: the first emitted token does not follow the draft distribution
    chi2, df = _chi2(np.bincount(tokens[:, 0], minlength=v), p_d[0])
    assert chi2 > _chi2_limit(df)


# ---------------------------------------------------------------- determinism

def test_same_seed_same_tokens_and_batch_order_does_not_matter():
    g = torch.Generator().manual_seed(9)
    n, v = 6, 90
    x = _logits((n, v), torch.float32, g)
    seeds, positions, temperature, top_k, top_p = _params(n, v, g)
    temperature[0] = 1.0
    top_k[:] = 0
    top_p[:] = 1.0
    x, seeds, positions, temperature, top_k, top_p = (t.to(DEVICE) for t in (x, seeds, positions, temperature,
                                                                              top_k, top_p))
    first = fs.sample(x, seeds, positions, temperature, top_k, top_p, backend="triton")
    again = fs.sample(x, seeds, positions, temperature, top_k, top_p, backend="triton")
    assert torch.equal(first, again)
    perm = torch.tensor([3, 0, 5, 1, 4, 2], device=DEVICE)
    permuted = fs.sample(x[perm], seeds[perm], positions[perm], temperature[perm], top_k[perm], top_p[perm],
                         backend="triton")
    assert torch.equal(permuted, first[perm])
    # another seed changes the draws (flat logits: almost every draw lands elsewhere)
    flat = torch.zeros(64, 1000)
    ones = torch.ones(64)
    zeros = torch.zeros(64, dtype=torch.int64)
    a = fs.sample(flat, torch.arange(64), zeros, ones, zeros, ones, backend="ref")
    b = fs.sample(flat, torch.arange(64) + 64, zeros, ones, zeros, ones, backend="ref")
    assert (a != b).sum() > 50


# ---------------------------------------------------------------- bad input

def _good(n=3, v=20):
    g = torch.Generator().manual_seed(10)
    return torch.randn(n, v, generator=g), _params(n, v, g)


@pytest.mark.parametrize("mutate,exc,name", [
    (lambda x, p: (x.half(), p), TypeError, "logits"),
    (lambda x, p: (x[0], p), ValueError, "logits"),
    (lambda x, p: (x.t(), p), ValueError, "logits"),
    (lambda x, p: (x, (p[0].int(), *p[1:])), TypeError, "seeds"),
    (lambda x, p: (x, (p[0], p[1][:2], *p[2:])), ValueError, "positions"),
    (lambda x, p: (x, (*p[:2], p[2].double(), *p[3:])), TypeError, "temperature"),
    (lambda x, p: (x, (*p[:3], p[3].float(), p[4])), TypeError, "top_k"),
    (lambda x, p: (x, (*p[:4], p[4][None])), ValueError, "top_p"),
])
def test_sample_rejects_bad_arguments(mutate, exc, name):
    x, params = mutate(*_good())
    with pytest.raises(exc, match=name):
        fs.sample(x, *params, backend="ref")


def test_bad_draw_backend_and_rejection_shapes():
    x, params = _good()
    with pytest.raises(ValueError, match="draw"):
        fs.sample(x, *params, draw=DRAW_ACCEPT, backend="ref")
    with pytest.raises(ValueError, match="^draw"):  # equal to DRAW_SAMPLE, but not an int
        fs.sample(x, *params, draw=float(fs.DRAW_SAMPLE), backend="ref")
    huge = torch.empty(1, fs.MAX_VOCAB + 1, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"^logits: expected a vocabulary of at most 2\^31 - 2\^16"):
        fs.greedy_sample(huge, backend="ref")
    with pytest.raises(ValueError, match="backend"):
        fs.sample(x, *params, backend="cuda")
    if importlib.util.find_spec("tilelang") is not None:  # the tilelang kernels run on CUDA tensors only
        with pytest.raises(ValueError, match="^logits: expected a CUDA tensor for the tilelang backend, got dev"):
            fs.sample(x, *params, backend="tilelang")
    target, draft = torch.randn(3, 3, 20), torch.randn(3, 2, 20)
    tokens = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_logits"):
        fs.rejection_sample(target, draft[:, :1], tokens, *params, backend="ref")
    with pytest.raises(TypeError, match="draft_logits"):
        fs.rejection_sample(target, draft.bfloat16(), tokens, *params, backend="ref")
    with pytest.raises(ValueError, match="draft_tokens"):
        fs.rejection_sample(target, draft, tokens[:, :1], *params, backend="ref")
    with pytest.raises(TypeError, match="draft_tokens"):
        fs.rejection_sample(target, draft, tokens.float(), *params, backend="ref")
    with pytest.raises(ValueError, match="target_logits"):
        fs.rejection_sample(target[:, :1], draft[:, :0], tokens[:, :0], *params, backend="ref")


@pytest.mark.parametrize("backend", ["ref", "triton", pytest.param("tilelang", marks=pytest.mark.gpu)])
def test_empty_batch(backend):
    """N = 0 gives empty results on every backend (a TileLang grid of 0 CTAs is not a valid launch: its
    adapter returns before it)."""
    if backend == "tilelang":
        pytest.importorskip("tilelang")
    e64, ef = torch.empty(0, dtype=torch.int64, device=DEVICE), torch.empty(0, device=DEVICE)
    params = (e64, e64, ef, e64, ef)
    assert fs.greedy_sample(torch.empty(0, 20, device=DEVICE), backend=backend).shape == (0,)
    assert fs.sample(torch.empty(0, 20, device=DEVICE), *params, backend=backend).shape == (0,)
    tokens, accepted = fs.rejection_sample(torch.empty(0, 3, 20, device=DEVICE), torch.empty(0, 2, 20, device=DEVICE),
                                           torch.empty(0, 2, dtype=torch.int64, device=DEVICE), *params,
                                           backend=backend)
    assert tokens.shape == (0, 3) and accepted.shape == (0,)


# ---------------------------------------------------------------- backend resolution and TileLang

def _run_python(code: str, **env) -> str:
    # the repository first, then whatever the caller's path had (e.g. an unpacked TileLang bundle)
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


# Without CUDA auto resolution is always triton, and on a GPU that is not an SM90 too; resolve as an SM90
# node would (nothing runs a kernel).
AS_ON_A_GPU_NODE = ("import torch\ntorch.cuda.is_available = lambda: True\n"
                    "torch.cuda.get_device_capability = lambda device=None: (9, 0)\n")


def test_simulated_missing_tilelang_resolves_to_triton():
    out = _run_python(
        AS_ON_A_GPU_NODE +
        "import engine.h20_ops.sampling.dispatch as fs\n"
        "r = fs.backend_resolution()\n"
        "print(r.backend, 'TileLang missing' in r.reason)\n"
        "try:\n"
        "    import engine.h20_ops.sampling.tilelang_sm90\n"
        "except ModuleNotFoundError:\n"
        "    print('blocked')\n",
        DEEPINFER_SIMULATE_NO_TILELANG="1")
    assert out.split() == ["triton", "True", "blocked"]


def test_auto_resolution_prefers_tilelang_when_it_imports():
    pytest.importorskip("tilelang")
    out = _run_python(AS_ON_A_GPU_NODE + "import engine.h20_ops.sampling.dispatch as fs\nprint(fs.resolve_backend())",
                      DEEPINFER_SIMULATE_NO_TILELANG="0")
    assert out.split()[-1] == "tilelang"


def test_triton_kernels_compile_for_sm90():
    """The interpreter accepts code the GPU compiler rejects (e.g. non-constexpr globals): compile the
    three kernels to PTX for sm_90 without a GPU, and check the exp2 they use."""
    out = _run_python(
        "import triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "from engine.h20_ops.sampling import triton_kernels as ft\n"
        "ptr = {'logits': '*bf16', 'out': '*i64', 'seeds': '*i64', 'positions': '*i64', 'scales': '*fp32',\n"
        "       'top_ks': '*i64', 'top_ps': '*fp32', 'target_logits': '*fp32', 'draft_logits': '*fp32',\n"
        "       'draft_tokens': '*i64', 'out_tokens': '*i64', 'out_accepted': '*i64'}\n"
        "for fn, consts in ((ft._greedy_kernel, {'BLOCK': 1024}), (ft._sample_kernel, {'DRAW': 2, 'BLOCK': 1024}),\n"
        "                   (ft._rejection_kernel, {'BLOCK': 1024})):\n"
        "    sig = {a: ('constexpr' if a in consts else ptr.get(a, 'i32')) for a in fn.arg_names}\n"
        "    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget('cuda', 90, 32),\n"
        "                       options={'num_warps': 8})\n"
        "    print('EX2', 'ex2.approx.ftz.f32' in k.asm['ptx'] or fn is ft._greedy_kernel)\n",
        TRITON_INTERPRET="0")
    assert out.split() == ["EX2", "True"] * 3


def test_tilelang_kernels_lower_for_sm90a():
    """The three TileLang kernels lower to CUDA for sm_90a (no GPU needed) and draw with
    curand_init(seed, position, draw); nvcc and running them are the GPU A/B script's job."""
    pytest.importorskip("tilelang")
    out = _run_python(
        "import tilelang\n"
        "from tilelang import tvm\n"
        "from engine.h20_ops.sampling import tilelang_sm90 as k\n"
        "target = tvm.target.Target({'kind': 'cuda', 'arch': 'sm_90a'})\n"
        "for f in (k.greedy_kernel('bfloat16'), k.sample_kernel('float32', 2), k.rejection_kernel('bfloat16')):\n"
        "    with tvm.transform.PassContext(config=k.PASS_CONFIGS), target:\n"
        "        src = tilelang.lower(f, target=target).kernel_source\n"
        "    print('KERNEL', src.count('curand_init('), 'exp2f' in src)\n"
        "    for line in src.splitlines():\n"
        "        if 'curand_init(' in line:\n"
        "            print('INIT', line.strip())\n")
    kernels = [line.split() for line in out.splitlines() if line.startswith("KERNEL")]
    assert kernels == [["KERNEL", "0", "False"], ["KERNEL", "1", "True"], ["KERNEL", "2", "True"]]
    inits = [line for line in out.splitlines() if line.startswith("INIT")]
    assert "positions[" in inits[0] and ", 2, &" in inits[0]  # the drafter's lane
    assert any(", 1, &" in line for line in inits) and any(", 0, &" in line for line in inits)
