"""DPLR (gated generalized delta rule) reference: the recurrence, one step at a time.

Seed notation (``seeds/003_*.txt``), with S ∈ R^{V×K}:

    S_t = S_{t-1} Diag(α_t) (I − b_t a_tᵀ) + v_t k_tᵀ,      α_t = exp(gk_t), gk_t ≤ 0
    o_t = S_t (scale · q_t)

The library stores the state transposed, h = Sᵀ ∈ R^{K×V} ([B, H, K, V]), so one step reads

    h_t = (I − a_t b_tᵀ) Diag(α_t) h_{t-1} + k_t v_tᵀ,      o_t = h_tᵀ (scale · q_t).

This file is the slow, obviously-correct reference that the chunkwise algorithm and any kernel are
tested against (autograd runs through the loop). It also hosts the input checks shared by every
DPLR entry point.
"""
from __future__ import annotations

import math

import torch

from .._checks import check_chunk_size, check_head_dim, check_same_device, check_tensor, compute_dtype
from ...errors import XLSTMKitError


# ----------------------------------------------------------------------------------------------
# input checks (one vocabulary for every DPLR/KDA entry point)
# ----------------------------------------------------------------------------------------------

def _dims(q) -> tuple[int, int, int, int]:
    check_tensor("q", q, (None, None, None, None), "B,T,H,K")
    check_head_dim("the head dimension K of q [B,T,H,K]", q.shape[-1])
    return tuple(q.shape)


def check_dplr_inputs(q, k, v, a, b, gk, initial_state) -> tuple[int, int, int, int, int]:
    """Validate sequence inputs; returns (B, T, H, K, V)."""
    B, T, H, K = _dims(q)
    if T < 1:
        raise XLSTMKitError(f"q [B,T,H,K] has shape {list(q.shape)}: the sequence length T must be at least 1")
    for name, t in (("k", k), ("a", a), ("b", b), ("gk", gk)):
        check_tensor(name, t, (B, T, H, K), "B,T,H,K")
    check_tensor("v", v, (B, T, H, None), "B,T,H,V")
    V = v.shape[-1]
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (B, H, K, V), "B,H,K,V")
    check_same_device(q=q, k=k, v=v, a=a, b=b, gk=gk, initial_state=initial_state)
    return B, T, H, K, V


def check_dplr_step_inputs(q, k, v, a, b, gk, state) -> tuple[int, int, int, int]:
    """Validate one-step inputs; returns (B, H, K, V)."""
    check_tensor("q", q, (None, None, None), "B,H,K")
    B, H, K = q.shape
    check_head_dim("the head dimension K of q [B,H,K]", K)
    for name, t in (("k", k), ("a", a), ("b", b), ("gk", gk)):
        check_tensor(name, t, (B, H, K), "B,H,K")
    check_tensor("v", v, (B, H, None), "B,H,V")
    V = v.shape[-1]
    if state is not None:
        check_tensor("state", state, (B, H, K, V), "B,H,K,V")
    check_same_device(q=q, k=k, v=v, a=a, b=b, gk=gk, state=state)
    return B, H, K, V


def check_scale(scale, K: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(K)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise XLSTMKitError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


def check_chunk(chunk_size) -> None:
    check_chunk_size(chunk_size, lo=1, hi=1024)




# ----------------------------------------------------------------------------------------------
# the recurrence
# ----------------------------------------------------------------------------------------------

def _step(q, k, v, a, b, gk, h):
    """One step in compute precision. q (already scaled), k, a, b, gk: [B,H,K]; v: [B,H,V];
    h: [B,H,K,V]. Returns (o [B,H,V], h [B,H,K,V])."""
    h = torch.exp(gk).unsqueeze(-1) * h                       # Diag(α_t) h_{t-1}
    h = h - a.unsqueeze(-1) * torch.einsum("bhk,bhkv->bhv", b, h).unsqueeze(-2)   # (I − a bᵀ)(·)
    h = h + k.unsqueeze(-1) * v.unsqueeze(-2)                 # + k_t v_tᵀ
    o = torch.einsum("bhk,bhkv->bhv", q, h)                   # o_t = h_tᵀ q_t
    return o, h


def dplr_step(q, k, v, a, b, gk, state, *, scale=None):
    """One step of the DPLR recurrence (generation).

    S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ, α_t = exp(gk_t), o_t = S_t (scale·q_t);
    equivalently, with d_t = α_t ⊙ b_t, the gate-free form S_t = S_{t-1}(Diag(α_t) − d_t a_tᵀ) + v_t k_tᵀ.

    Args:
        q, k, a, b, gk: [B, H, K] (gk is the log decay, ≤ 0).
        v: [B, H, V].
        state: [B, H, K, V] (= Sᵀ), or None for zeros.
        scale: query scale, default 1/√K.
    Returns:
        (o [B, H, V] in q's dtype, state [B, H, K, V] in float32, float64 for float64 inputs).
    """
    B, H, K, V = check_dplr_step_inputs(q, k, v, a, b, gk, state)
    scale = check_scale(scale, K)
    cd = compute_dtype(q, k, v, a, b, gk, state)
    h = q.new_zeros(B, H, K, V, dtype=cd) if state is None else state.to(cd)
    o, h = _step((q.to(cd) * scale), k.to(cd), v.to(cd), a.to(cd), b.to(cd), gk.to(cd), h)
    return o.to(q.dtype), h


def dplr_recurrent(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False):
    """DPLR recurrence, step by step (the reference; autograd through the loop).

    S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ with α_t = exp(gk_t), o_t = S_t (scale·q_t).
    The gate-free form S_t = S_{t-1}(Diag(α_t) − d_t a_tᵀ) + v_t k_tᵀ is the same recurrence with
    b_t = d_t / α_t.

    Args:
        q, k, a, b, gk: [B, T, H, K]; gk is the log decay (≤ 0).
        v: [B, T, H, V].
        scale: query scale, default 1/√K.
        initial_state: [B, H, K, V] (= Sᵀ, the transposed state of docs/design.md) or None for zeros.
        output_final_state: return the final state.
    Returns:
        (o [B, T, H, V] in q's dtype, final state [B, H, K, V] (float32, float64 for float64
        inputs) or None).
    """
    B, T, H, K, V = check_dplr_inputs(q, k, v, a, b, gk, initial_state)
    scale = check_scale(scale, K)
    cd = compute_dtype(q, k, v, a, b, gk, initial_state)
    out_dtype = q.dtype
    q, k, v, a, b, gk = (x.to(cd) for x in (q, k, v, a, b, gk))
    q = q * scale
    h = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cd)
    outs = []
    for t in range(T):
        o_t, h = _step(q[:, t], k[:, t], v[:, t], a[:, t], b[:, t], gk[:, t], h)
        outs.append(o_t)
    o = torch.stack(outs, dim=1)
    return o.to(out_dtype), (h if output_final_state else None)
