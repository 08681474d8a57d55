"""DPLR / KDA ops: recurrent reference (float64, autograd) → chunkwise (hand-written backward) →
step loop; fla's naive DPLR and KDA as independent peers."""
import importlib.util
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from xlstm_kit.ops import dplr_chunkwise, dplr_recurrent, dplr_step, kda_chunkwise
from xlstm_kit.ops.backend import BackendUnavailableError
from xlstm_kit.ops.dplr import chunkwise as chunkwise_mod

F64 = torch.float64


def make_inputs(B=2, T=37, H=2, K=8, V=6, dtype=F64, g_lo=-1.0, g_hi=0.0, h0=True):
    """Realistic DPLR inputs: k, a unit vectors; b ≈ β a with β ∈ (0.1, 1.5) so the transition
    I − b aᵀ is contractive; log gates uniform in [g_lo, g_hi]."""
    q = torch.randn(B, T, H, K, dtype=F64)
    k = F.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1)
    a = F.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1)
    beta = 0.1 + 1.4 * torch.rand(B, T, H, 1, dtype=F64)
    b = beta * a + 0.05 * torch.randn(B, T, H, K, dtype=F64)
    gk = g_lo + (g_hi - g_lo) * torch.rand(B, T, H, K, dtype=F64)
    v = torch.randn(B, T, H, V, dtype=F64)
    s0 = 0.5 * torch.randn(B, H, K, V, dtype=F64) if h0 else None
    return [x if x is None else x.to(dtype) for x in (q, k, v, a, b, gk, s0)]


def run(fn, xs, do, ds, **kw):
    """Forward with gradients through the output and the final state; returns (o, state, grads)."""
    xs = [x if x is None else x.detach().clone().requires_grad_() for x in xs]
    o, s = fn(*xs[:6], initial_state=xs[6], output_final_state=True, **kw)
    loss = (o.double() * do).sum() + (s.double() * ds).sum()
    leaves = [x for x in xs if x is not None]
    return o, s, torch.autograd.grad(loss, leaves)


def reference(xs, **kw):
    """float64 recurrent reference with random upstream gradients."""
    xs64 = [x if x is None else x.detach().double() for x in xs]
    B, T, H, _ = xs64[0].shape
    V, K = xs64[2].shape[-1], xs64[0].shape[-1]
    do = torch.randn(B, T, H, V, dtype=F64)
    ds = torch.randn(B, H, K, V, dtype=F64)
    o, s, g = run(dplr_recurrent, xs64, do, ds, **kw)
    return o, s, g, do, ds


def load_fla_naive(rel_path):
    """Load one of fla's naive files directly (they only need torch and einops); importing the
    fla package itself pulls in all its Triton modules."""
    spec = importlib.util.find_spec("fla")
    assert spec is not None, "flash-linear-attention (fla) is a test dependency: make test installs it"
    path = pathlib.Path(spec.origin).parent / rel_path
    mod_spec = importlib.util.spec_from_file_location("fla_naive_" + path.stem, path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


# ----------------------------------------------------------------------------------------------
# the reference itself
# ----------------------------------------------------------------------------------------------

def test_recurrent_matches_fla_naive():
    """fla stores S_t = S_{t-1}(Diag(α) + α_fla β_flaᵀ)-style in its additive convention:
    in [K,V] layout h_t = Diag(α_t) h + β_fla α_flaᵀ h + k vᵀ, ours is Diag(α) h − a (α⊙b)ᵀ h + k vᵀ,
    hence α_fla = −exp(gk)⊙b and β_fla = a (fla: [B,H,T,D] layout, q scaled by 1/√K inside)."""
    fla = load_fla_naive("ops/generalized_delta_rule/dplr/naive.py")
    q, k, v, a, b, gk, s0 = make_inputs(B=2, T=40, H=3, K=8, V=5, dtype=torch.float32)
    o, s = dplr_recurrent(q, k, v, a, b, gk, initial_state=s0, output_final_state=True)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    o_fla, s_fla = fla.dplr_recurrence(t(q), t(k), t(v), t(-gk.exp() * b), t(a), t(gk),
                                       initial_state=s0, output_final_state=True)
    assert rel_err(o, t(o_fla)) < 1e-5
    assert rel_err(s, s_fla) < 1e-5


def test_gate_free_form_and_state_layout():
    """Seed layout S ∈ R^{V×K}: S_t = S_{t-1}(Diag(α_t) − d_t a_tᵀ) + v_t k_tᵀ, o_t = S_t q_t/√K
    equals ours with b = d/α, and our state is Sᵀ."""
    q, k, v, a, _, gk, _ = make_inputs(B=1, T=25, H=2, K=6, V=4, h0=False)
    d = 0.7 * a * gk.exp()
    S = torch.zeros(1, 2, 4, 6, dtype=F64)  # [B,H,V,K]
    outs = []
    for t in range(25):
        trans = torch.diag_embed(gk[:, t].exp()) - d[:, t, :, :, None] * a[:, t, :, None, :]
        S = S @ trans + v[:, t, :, :, None] * k[:, t, :, None, :]
        outs.append(S @ q[:, t, :, :, None] / math.sqrt(6))
    o_ref = torch.stack(outs, 1).squeeze(-1)
    o, s = dplr_recurrent(q, k, v, a, d / gk.exp(), gk, output_final_state=True)
    assert rel_err(o, o_ref) < 1e-12
    assert rel_err(s, S.transpose(-1, -2)) < 1e-12


def test_step_loop_equals_recurrent():
    q, k, v, a, b, gk, s0 = make_inputs(B=2, T=30, H=2, K=8, V=6, dtype=torch.float32)
    o_ref, s_ref = dplr_recurrent(q, k, v, a, b, gk, initial_state=s0, output_final_state=True, scale=0.3)
    state, outs = s0, []
    for t in range(30):
        o_t, state = dplr_step(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], gk[:, t], state, scale=0.3)
        outs.append(o_t)
    assert rel_err(torch.stack(outs, 1), o_ref) < 1e-6
    assert rel_err(state, s_ref) < 1e-6
    # state None means zeros
    o0, _ = dplr_step(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], gk[:, 0], None)
    o1, _ = dplr_recurrent(q[:, :1], k[:, :1], v[:, :1], a[:, :1], b[:, :1], gk[:, :1])
    assert rel_err(o0, o1[:, 0]) < 1e-6


# ----------------------------------------------------------------------------------------------
# chunkwise against the reference
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("T,chunk", [(1, 64), (63, 16), (63, 64), (100, 32), (100, 17), (100, 100), (100, 128)])
@pytest.mark.parametrize("with_h0", [True, False])
def test_chunkwise_matches_reference(T, chunk, with_h0):
    xs = make_inputs(B=2, T=T, H=2, K=8, V=6, h0=with_h0)
    o_ref, s_ref, g_ref, do, ds = reference(xs)
    o, s, g = run(dplr_chunkwise, xs, do, ds, chunk_size=chunk)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(s, s_ref) < 1e-10
    names = ["q", "k", "v", "a", "b", "gk", "initial_state"]
    for name, x, y in zip(names, g, g_ref):
        assert rel_err(x, y) < 1e-10, name


def test_chunkwise_uses_the_hand_written_backward():
    xs = [x.requires_grad_() for x in make_inputs(T=10, h0=False)[:6]]
    o, _ = dplr_chunkwise(*xs, chunk_size=4)
    seen, stack = set(), [o.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    names = {type(fn).__name__ for fn in seen}
    assert "_DPLRChunkwiseBackward" in names
    assert not any("Cumsum" in n or "LinalgSolveTriangular" in n for n in names)


@pytest.mark.parametrize("with_h0", [True, False])
def test_gradcheck_chunkwise(monkeypatch, with_h0):
    # sub-chunks of 2 inside chunks of 4: diagonal blocks, off-diagonal blocks and a padded chunk
    monkeypatch.setattr(chunkwise_mod, "SUB_CHUNK", 2)
    xs = make_inputs(B=1, T=7, H=1, K=3, V=2, g_lo=-2.0, h0=with_h0)
    xs[4] = 0.5 * torch.randn_like(xs[4])  # generic b, not only β·a
    inputs = [x.requires_grad_() for x in xs if x is not None]

    def f(q, k, v, a, b, gk, *s0):
        return dplr_chunkwise(q, k, v, a, b, gk, initial_state=s0[0] if s0 else None,
                              output_final_state=True, chunk_size=4, scale=0.8)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_split_in_two_equals_whole():
    xs = make_inputs(B=2, T=90, H=2, K=8, V=6)
    q, k, v, a, b, gk, s0 = xs
    o, s = dplr_chunkwise(q, k, v, a, b, gk, initial_state=s0, output_final_state=True, chunk_size=16)
    first = [x[:, :37] for x in xs[:6]]
    second = [x[:, 37:] for x in xs[:6]]
    o1, s1 = dplr_chunkwise(*first, initial_state=s0, output_final_state=True, chunk_size=16)
    o2, s2 = dplr_chunkwise(*second, initial_state=s1, output_final_state=True, chunk_size=16)
    assert rel_err(torch.cat((o1, o2), 1), o) < 1e-12
    assert rel_err(s2, s) < 1e-12


@pytest.mark.parametrize("g_lo,g_hi", [(-5.5, -4.5), (-50.0, -40.0)])
@pytest.mark.parametrize("chunk", [16, 64, 128])
def test_strong_decay_float32_finite_and_accurate(g_lo, g_hi, chunk):
    """Cumulative log gates reach −700 inside a chunk; nothing may overflow and float32 must stay
    as accurate as the float32 recurrence (≈1e-7..1e-6 relative)."""
    xs = make_inputs(B=1, T=130, H=2, K=16, V=8, g_lo=g_lo, g_hi=g_hi)
    o_ref, s_ref, g_ref, do, ds = reference(xs)
    xs32 = [x.float() for x in xs]
    o, s, g = run(dplr_chunkwise, xs32, do, ds, chunk_size=chunk)
    assert rel_err(o, o_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5
    for name, x, y in zip(["q", "k", "v", "a", "b", "gk", "initial_state"], g, g_ref):
        assert rel_err(x, y) < 2e-5, name


def test_default_scale_and_no_final_state():
    q, k, v, a, b, gk, _ = make_inputs(T=20, h0=False)
    o, s = dplr_chunkwise(q, k, v, a, b, gk, chunk_size=8)
    assert s is None
    o_half, _ = dplr_chunkwise(q, k, v, a, b, gk, chunk_size=8, scale=0.5 / math.sqrt(8))
    assert rel_err(o_half, 0.5 * o) < 1e-12   # o is linear in the scale; default is 1/√K
    o_rec, _ = dplr_recurrent(q, k, v, a, b, gk, scale=1.3)
    o_chk, _ = dplr_chunkwise(q, k, v, a, b, gk, scale=1.3, chunk_size=8)
    assert rel_err(o_chk, o_rec) < 1e-12


# ----------------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------------

def kda_loop(q, k, v, g, beta, s0):
    """KDA written directly: decay, then a delta-rule correction of size β along k."""
    B, T, H, K = q.shape
    S = s0.clone()
    outs = []
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        pred = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] / math.sqrt(K), S))
    return torch.stack(outs, 1), S


def kda_inputs(B=2, T=45, H=2, K=8, V=6):
    q = torch.randn(B, T, H, K, dtype=F64)
    k = F.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, H, K, dtype=F64) + 2.0)
    beta = torch.rand(B, T, H, dtype=F64)
    s0 = 0.5 * torch.randn(B, H, K, V, dtype=F64)
    return [q, k, v, g, beta, s0]


def test_kda_equals_direct_recurrence_with_gradients():
    xs = [x.requires_grad_() for x in kda_inputs()]
    o, s = kda_chunkwise(*xs[:5], initial_state=xs[5], output_final_state=True, chunk_size=16)
    o_ref, s_ref = kda_loop(*xs)
    assert rel_err(o, o_ref) < 1e-10
    assert rel_err(s, s_ref) < 1e-10
    do, ds = torch.randn_like(o), torch.randn_like(s)
    g = torch.autograd.grad((o * do).sum() + (s * ds).sum(), xs)
    g_ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), xs)
    for name, x, y in zip(["q", "k", "v", "g", "beta", "initial_state"], g, g_ref):
        assert rel_err(x, y) < 1e-10, name


def test_kda_is_dplr_substitution_and_matches_fla():
    q, k, v, g, beta, s0 = [x.float() for x in kda_inputs(T=33)]
    o, s = kda_chunkwise(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=8)
    bb = beta.unsqueeze(-1)
    o2, s2 = dplr_chunkwise(q, k, v * bb, k, k * bb, g, initial_state=s0, output_final_state=True, chunk_size=8)
    assert rel_err(o, o2) < 1e-6 and rel_err(s, s2) < 1e-6
    fla = load_fla_naive("ops/kda/naive.py")
    o3, s3 = fla.naive_recurrent_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert rel_err(o, o3) < 1e-5 and rel_err(s, s3) < 1e-5


# ----------------------------------------------------------------------------------------------
# dtypes, bad input, backend
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, F64])
def test_dtypes(dtype):
    xs = make_inputs(B=1, T=50, H=2, K=8, V=6)
    o_ref, s_ref, g_ref, do, ds = reference(xs)
    xs_d = [x.to(dtype) for x in xs]
    o, s, g = run(dplr_chunkwise, xs_d, do, ds, chunk_size=16)
    assert o.dtype == dtype
    assert s.dtype == (F64 if dtype == F64 else torch.float32)
    assert all(x.dtype == dtype for x in g)
    errs = [rel_err(o, o_ref), rel_err(s, s_ref)] + [rel_err(x, y) for x, y in zip(g, g_ref)]
    if dtype in (torch.float32, F64):
        assert max(errs) < (1e-5 if dtype == torch.float32 else 1e-10)
    else:
        # flash-attention's rule: at most 2× the error of the reference run on the same low-precision inputs
        o_r, s_r, g_r = run(dplr_recurrent, xs_d, do, ds)
        errs_r = [rel_err(o_r, o_ref), rel_err(s_r, s_ref)] + [rel_err(x, y) for x, y in zip(g_r, g_ref)]
        for e, e_r in zip(errs, errs_r):
            assert e <= 2 * e_r + 1e-4


def test_bad_inputs_raise_value_error():
    q, k, v, a, b, gk, s0 = make_inputs(B=2, T=10, H=2, K=8, V=6)
    for fn in (dplr_recurrent, dplr_chunkwise):
        with pytest.raises(ValueError, match="k"):
            fn(q, k[..., :7], v, a, b, gk)
        with pytest.raises(ValueError, match="v"):
            fn(q, k, v[:, :9], a, b, gk)
        with pytest.raises(ValueError, match="gk"):
            fn(q, k, v, a, b, gk.long())
        with pytest.raises(ValueError, match="initial_state"):
            fn(q, k, v, a, b, gk, initial_state=s0[..., :5])
        with pytest.raises(ValueError, match="q"):
            fn(q[0], k, v, a, b, gk)
        with pytest.raises(ValueError, match="T"):
            fn(*(x[:, :0] for x in (q, k, v, a, b, gk)))
        with pytest.raises(ValueError, match="scale"):
            fn(q, k, v, a, b, gk, scale="big")
    for bad in (0, 2000, 1.5):
        with pytest.raises(ValueError, match="chunk_size"):
            dplr_chunkwise(q, k, v, a, b, gk, chunk_size=bad)
    with pytest.raises(ValueError, match="state"):
        dplr_step(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], gk[:, 0], s0[:, :1])
    with pytest.raises(ValueError, match="a"):
        dplr_step(q[:, 0], k[:, 0], v[:, 0], a[:, 0, :1], b[:, 0], gk[:, 0], None)
    with pytest.raises(ValueError, match="beta"):
        kda_chunkwise(q, k, v, gk, torch.rand(2, 10, 2, 1, dtype=F64))
    with pytest.raises(ValueError, match="g"):
        kda_chunkwise(q, k, v, gk[:, :, :1], torch.rand(2, 10, 2, dtype=F64))


def test_backend_choice(monkeypatch):
    # pinned to "no kernel registered" so the refusal is tested whatever kernels exist
    import xlstm_kit.ops.backend as backend_mod

    monkeypatch.setattr(backend_mod, "KERNEL_MODULES", {})
    q, k, v, a, b, gk, _ = make_inputs(T=5, h0=False)
    with pytest.raises(BackendUnavailableError):
        dplr_chunkwise(q, k, v, a, b, gk, backend="triton")
    with pytest.raises(BackendUnavailableError):
        dplr_recurrent(q, k, v, a, b, gk, backend="triton")
    with pytest.raises(BackendUnavailableError):
        kda_chunkwise(q, k, v, gk, torch.rand(2, 5, 2, dtype=F64), backend="triton")
    with pytest.raises(ValueError, match="backend"):
        dplr_chunkwise(q, k, v, a, b, gk, backend="cuda")
    o1, _ = dplr_chunkwise(q, k, v, a, b, gk, backend="torch")
    o2, _ = dplr_chunkwise(q, k, v, a, b, gk, backend=None)
    assert torch.equal(o1, o2)
