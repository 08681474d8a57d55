"""DPLR/KDA log-decays outside their domain, on every path (torch in float64 and float32, the
Triton kernels in float32), against the float64 recurrence:

- a NaN log-decay at step t: the outputs before t are the recurrence's, whatever the chunk size
  and wherever t falls in its chunk; the outputs from t on are NaN, as the recurrence's are;
- a positive log-decay (a "decay" above 1, outside the domain gk ≤ 0) counts as 0: every op,
  the recurrent reference and the decode step included, gives the recurrence on gk.clamp(max=0).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from xlstm_kit.ops.dplr import dplr_chunkwise, dplr_recurrent, dplr_step, kda_chunkwise
from xlstm_kit.ops.dplr import naive

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_TRITON = INTERPRET or torch.cuda.is_available()
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# (backend, compute dtype): the Triton kernels need K, V ≥ 16 and chunk sizes 16/32/64
PATHS = [("torch", torch.float64), ("torch", torch.float32),
         pytest.param("triton", torch.float32, marks=pytest.mark.skipif(
             not HAS_TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"))]
T, H, K, V = 40, 1, 16, 16


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(1, T, H, K, generator=g, dtype=torch.float64) / K ** 0.5
    a = F.normalize(torch.randn(1, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    b = -a * torch.rand(1, T, H, 1, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, H, V, generator=g, dtype=torch.float64)
    gk = -torch.rand(1, T, H, K, generator=g, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    return q, k, v, a, b, gk, beta


def _run(kind, backend, dtype, xs, chunk_size):
    q, k, v, a, b, gk, beta = (x.to(DEV if backend == "triton" else "cpu", dtype) for x in xs)
    if kind == "dplr":
        return dplr_chunkwise(q, k, v, a, b, gk, chunk_size=chunk_size, backend=backend,
                              output_final_state=True)
    return kda_chunkwise(q, k, v, gk, beta, chunk_size=chunk_size, backend=backend, output_final_state=True)


def _reference(kind, xs):
    """The float64 recurrence itself (naive.py: no clamp of any kind)."""
    q, k, v, a, b, gk, beta = xs
    if kind == "kda":
        bt = beta[..., None]
        a, b, v = k, k * bt, v * bt
    return naive.dplr_recurrent(q, k, v, a, b, gk, output_final_state=True)


def _tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-4


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("kind", ["dplr", "kda"])
# t in the first 16-step sub-chunk, before, at and after the middle (the Triton kernels'
# in-block reference point) of the second, at the end of a chunk; NaN in one channel or all
@pytest.mark.parametrize("t,channels", [(5, "all"), (20, "one"), (23, "all"), (31, "one")])
def test_nan_log_decay_does_not_reach_earlier_steps(backend, dtype, kind, t, channels):
    xs = list(_inputs(seed=t))
    gk = xs[5].clone()
    gk[0, t, 0, 3 if channels == "one" else slice(None)] = float("nan")
    xs[5] = gk
    ref, _ = _reference(kind, xs)
    assert ref[:, :t].isfinite().all() and ref[:, t:].isnan().all()
    for chunk_size in (16, 32):
        out, state = _run(kind, backend, dtype, xs, chunk_size)
        out = out.double().cpu()
        torch.testing.assert_close(out[:, :t], ref[:, :t], rtol=_tol(dtype), atol=_tol(dtype))
        # from t on every output is NaN, as in the recurrence, and the state carries the NaN
        assert out[:, t:].isnan().all()
        assert state.isnan().any()


@pytest.mark.parametrize("backend,dtype", PATHS)
@pytest.mark.parametrize("kind", ["dplr", "kda"])
def test_positive_log_decay_counts_as_zero(backend, dtype, kind):
    xs = list(_inputs(seed=7))
    gk = xs[5].clone()
    gk[0, 5, 0, :] = 500.0           # e^{500}: inf in float32, poisoned the chunk before it
    gk[0, 21, 0, 2:9] = 30.0
    gk[0, 30:34] = 0.25              # mildly positive: still outside the domain
    xs[5] = gk
    clamped = xs[:5] + [gk.clamp(max=0.0)] + xs[6:]
    ref, ref_state = _reference(kind, clamped)
    for chunk_size in (16, 32):
        out, state = _run(kind, backend, dtype, xs, chunk_size)
        torch.testing.assert_close(out.double().cpu(), ref, rtol=_tol(dtype), atol=_tol(dtype))
        torch.testing.assert_close(state.double().cpu(), ref_state, rtol=_tol(dtype), atol=_tol(dtype))


def test_recurrent_and_step_clamp_positive_log_decays_too():
    """Prefill (chunkwise) and decode (step) agree: the public recurrence and step clamp too."""
    q, k, v, a, b, gk, _ = _inputs(seed=3)
    gk = gk.clone()
    gk[0, ::4] = 2.0
    ref, _ = naive.dplr_recurrent(q, k, v, a, b, gk.clamp(max=0.0))
    out, _ = dplr_recurrent(q, k, v, a, b, gk)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    state, outs = None, []
    for t in range(T):
        o, state = dplr_step(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], gk[:, t], state)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), ref, rtol=1e-12, atol=1e-12)
    # a NaN stays a NaN through the clamp (it is not mistaken for a closed or open gate)
    gk[0, 6, 0, 0] = float("nan")
    out, _ = dplr_recurrent(q, k, v, a, b, gk)
    assert out[:, :6].isfinite().all() and out[:, 6:].isnan().all()


@pytest.mark.skipif(not HAS_TRITON, reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_triton_step_kernel_clamps_positive_log_decays():
    from xlstm_kit.ops.dplr.triton.step import dplr_step_triton

    q, k, v, a, b, gk, _ = (x[:, 0].float().to(DEV) for x in _inputs(seed=5))
    gk[0, 0, :4] = 3.0
    s = torch.randn(1, H, K, V, device=DEV)
    o, s1 = dplr_step_triton(q, k, v, a, b, gk, s)
    ro, rs1 = naive.dplr_step(*(x.double() for x in (q, k, v, a, b, gk.clamp(max=0.0), s)))
    torch.testing.assert_close(o.double().cpu(), ro.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1.double().cpu(), rs1.cpu(), rtol=1e-5, atol=1e-5)
    # a NaN is not clamped away: the state and the output are NaN, as the recurrence's
    gk[0, 0, 4] = float("nan")
    o, s1 = dplr_step_triton(q, k, v, a, b, gk, s)
    assert s1.isnan().all() and o.isnan().all()
