"""DPLR family (gated generalized delta rule) and its KDA special case.

The public functions validate their inputs, ask `backend.choose_backend` which implementation
runs, and call it: the PyTorch path (naive.py: the reference loop and the single step;
chunkwise.py: the WY algorithm with a hand-written backward; kda.py: the KDA substitution) or
the Triton kernels (the triton/ subpackage, one module per phase; `config=` takes its
`DPLRKernelConfig`, which the PyTorch path ignores).
"""
from __future__ import annotations

import torch

from .._checks import LOG_GATE_FLOOR, autocast_off, check_cu_seqlens, check_varlen_state, compute_dtype, run_varlen
from ..backend import choose_backend, kernel_module, on_device
from . import chunkwise as _chunkwise
from . import kda as _kda
from . import naive as _naive
from .triton.config import DPLRKernelConfig  # no Triton needed to build one

# The Triton chunkwise kernels build in-chunk decays from factors e^{±(G_r − G_mid)} over up to 8
# steps of a 16-step sub-chunk (pairs.py, backward.py, kda_dk.py). Each factor must be a normal
# float32 whose 3-pass TF32 low part is normal too: the GPU flushes subnormals, and at a floor of
# −11 (factors to e^{−88}) the H200 lost the last row of a sub-chunk (2e-3 absolute error at
# log-decay −12, 2026-12-02) where the interpreter kept them. At −9 the factors reach e^{−72}
# (2^{−104}; low parts ≥ 2^{−126} to a relative 2^{−22}). The floor changes a step's decay from
# e^{gk} to at most e^{−9} ≈ 1.2e−4: the past survives such a step at most at that weight.
# (Exact diagonal blocks, which need no such factor and no floor, cost KDA 14 % of its time on
# the H200: docs/kernels.md, "DPLR and KDA".)
TRITON_LOG_DECAY_FLOOR = -9.0


def log_decay(gk: torch.Tensor, floor: float | None = None) -> torch.Tensor:
    """gk inside the domain every path computes in: above 0 (a "decay" that amplifies the state)
    counts as 0, below `floor` (−inf included: a closed gate) as `floor`; NaN stays NaN.

    Clamped, not refused: refusing would read the values back (a host sync per call). Above 0
    the chunkwise forms' decay factors lose their bound of 1 (e^{gk} overflows float32 from
    gk ≈ 88 and its inf reaches the earlier steps of the chunk through the products), and the
    recurrence and the step clamp too so that every path, prefill and decode, gives one result.
    The gradient is 0 where a value was clamped."""
    return gk.clamp(max=0.0) if floor is None else gk.clamp(floor, 0.0)


def _check_varlen(seqs, initial_state, cu_seqlens, check):
    """Packed sequences (cu_seqlens [N+1], B = 1): validate; returns the boundaries [N+1] (for
    the per-sequence loop of the PyTorch paths; the Triton kernels take cu_seqlens itself)."""
    check(*seqs, None)
    bounds = check_cu_seqlens(cu_seqlens, seqs[0].shape[0], seqs[0].shape[1], seqs[0].device)
    if initial_state is not None:
        check_varlen_state(initial_state, len(bounds) - 1)
        # the row shapes as the op's own check sees them for one sequence
        check(*(x[:, :1] for x in seqs), initial_state[:1])
    return bounds


def _varlen(op, seqs, initial_state, output_final_state, cu_seqlens, check):
    """Packed sequences: validate, then `op` once per sequence with its own state row."""
    bounds = _check_varlen(seqs, initial_state, cu_seqlens, check)
    return run_varlen(op, seqs, bounds, initial_state, output_final_state)


@autocast_off
def dplr_recurrent(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False,
                   backend=None, cu_seqlens=None):
    """DPLR recurrence, step by step: S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ,
    α_t = exp(gk_t), o_t = S_t (scale·q_t). The gate-free form S_t = S_{t-1}(Diag(α_t) − d_t a_tᵀ)
    + v_t k_tᵀ is b_t = d_t / α_t.

    q, k, a, b, gk: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] (= Sᵀ) or None.
    gk > 0 counts as 0 (`log_decay`), as on every path.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32/float64 or None).
    `cu_seqlens` as in `dplr_chunkwise`.
    """
    if cu_seqlens is not None:
        return _varlen(lambda *xs, **kw: dplr_recurrent(*xs, scale=scale, backend=backend, **kw),
                       (q, k, v, a, b, gk), initial_state, output_final_state, cu_seqlens, _naive.check_dplr_inputs)
    _naive.check_dplr_inputs(q, k, v, a, b, gk, initial_state)
    choose_backend("dplr_recurrent", backend, q.device)
    return _naive.dplr_recurrent(q, k, v, a, b, log_decay(gk), scale=scale, initial_state=initial_state,
                                 output_final_state=output_final_state)


@autocast_off
def dplr_chunkwise(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False,
                   chunk_size=64, backend=None, config=None, cu_seqlens=None):
    """DPLR, chunkwise WY algorithm (same maths as `dplr_recurrent`, same shapes), with a
    hand-written backward. S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ, α_t = exp(gk_t),
    o_t = S_t (scale·q_t); the gate-free form S_t = S_{t-1}(Diag(α_t) − d_t a_tᵀ) + v_t k_tᵀ is
    b_t = d_t / α_t.

    q, k, a, b, gk: [B, T, H, K]; v: [B, T, H, V]; initial_state: [B, H, K, V] (= Sᵀ) or None;
    chunk_size: any integer in [1, 1024], T need not be a multiple; config: the Triton kernels'
    `DPLRKernelConfig` (None: the defaults; unused on the
    PyTorch path). gk = −inf is a closed gate (α = 0) on every path; the Triton kernels treat
    log-decays below −9 as −9 (`TRITON_LOG_DECAY_FLOOR`); gk > 0 counts as 0 (`log_decay`). A
    NaN in gk at step t leaves the outputs before t as the recurrence gives them, for any
    chunk_size; from t on the outputs are NaN and so is the final state (the recurrence's are).
    cu_seqlens: None, or int32/int64 [N+1] (0 = cu[0] < ... < cu[N] = T) with B = 1: N sequences
    packed along T, each from its own row of initial_state [N, H, K, V] (None: zeros), returning
    its own final state [N, H, K, V]; nothing crosses a boundary.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32/float64 or None).
    """
    seqs = (q, k, v, a, b, gk)
    if cu_seqlens is not None:
        bounds = _check_varlen(seqs, initial_state, cu_seqlens, _naive.check_dplr_inputs)
    else:
        _naive.check_dplr_inputs(*seqs, initial_state)
    if choose_backend("dplr_chunkwise", backend, q.device, inputs=(*seqs, initial_state),
                      K=q.shape[-1], V=v.shape[-1], chunk_size=chunk_size,
                      dtype=compute_dtype(*seqs)) == "triton":
        gk = log_decay(gk, TRITON_LOG_DECAY_FLOOR)
        with on_device(q):
            # packed sequences natively: one launch per phase for all of them
            return kernel_module("dplr_chunkwise").dplr_chunkwise_triton(
                q, k, v, a, b, gk, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                chunk_size=chunk_size, config=config, cu_seqlens=cu_seqlens)
    # gk = -inf (a closed gate) would give -inf - -inf in the cumulative sums
    seqs = (q, k, v, a, b, log_decay(gk, LOG_GATE_FLOOR))
    op = lambda *xs, **kw: _chunkwise.dplr_chunkwise(*xs, scale=scale, chunk_size=chunk_size, **kw)  # noqa: E731
    if cu_seqlens is not None:
        return run_varlen(op, seqs, bounds, initial_state, output_final_state)
    return op(*seqs, initial_state=initial_state, output_final_state=output_final_state)


@autocast_off
def dplr_step(q, k, v, a, b, gk, state, *, scale=None):
    """One DPLR step. q, k, a, b, gk: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] or None (zeros).
    Returns (o [B, H, V] in q's dtype, state [B, H, K, V] float32/float64). gk > 0 counts as 0.
    On CUDA the Triton decode kernel runs when no input needs a gradient (it has no backward)."""
    B, H, K, V = _naive.check_dplr_step_inputs(q, k, v, a, b, gk, state)
    xs = (q, k, v, a, b, gk, state)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)
    if choose_backend("dplr_step", None, q.device, K=K, V=V, dtype=compute_dtype(*xs),
                      requires_grad=needs_grad) == "triton":
        with on_device(q):
            # the kernel clamps gk > 0 itself: no extra launch per decoded token
            return kernel_module("dplr_step").dplr_step_triton(q, k, v, a, b, gk, state, scale=scale)
    return _naive.dplr_step(q, k, v, a, b, log_decay(gk), state, scale=scale)


@autocast_off
def kda_chunkwise(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=64, backend=None, config=None, cu_seqlens=None):
    """KDA: DPLR with a = k, b = β k, v ← β v, i.e. S_t = S_{t-1} Diag(α_t)(I − β_t k_t k_tᵀ)
    + β_t v_t k_tᵀ with α_t = exp(g_t).

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None;
    config: as for `dplr_chunkwise` (also for g = −inf, the Triton floor of −9, g > 0 and NaN).
    cu_seqlens: as for `dplr_chunkwise` (initial_state and the final state then [N, H, K, V]).
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32/float64 or None).
    """
    seqs = (q, k, v, g, beta)
    if cu_seqlens is not None:
        bounds = _check_varlen(seqs, initial_state, cu_seqlens, _kda.check_kda_inputs)
    else:
        _kda.check_kda_inputs(*seqs, initial_state)
    if choose_backend("kda_chunkwise", backend, q.device, inputs=(*seqs, initial_state),
                      K=q.shape[-1], V=v.shape[-1], chunk_size=chunk_size,
                      dtype=compute_dtype(*seqs)) == "triton":
        g = log_decay(g, TRITON_LOG_DECAY_FLOOR)
        with on_device(q):
            return kernel_module("kda_chunkwise").kda_chunkwise_triton(
                q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                chunk_size=chunk_size, config=config, cu_seqlens=cu_seqlens)
    seqs = (q, k, v, log_decay(g, LOG_GATE_FLOOR), beta)
    op = lambda *xs, **kw: _kda.kda_chunkwise(*xs, scale=scale, chunk_size=chunk_size, **kw)  # noqa: E731
    if cu_seqlens is not None:
        return run_varlen(op, seqs, bounds, initial_state, output_final_state)
    return op(*seqs, initial_state=initial_state, output_final_state=output_final_state)


__all__ = ["dplr_recurrent", "dplr_chunkwise", "dplr_step", "kda_chunkwise", "DPLRKernelConfig"]
