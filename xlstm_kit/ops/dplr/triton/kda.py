"""The KDA-specialised kernels (a = k, b = β k, v ← β v; Kimi Linear, arXiv 2510.26692): the inputs k, v, β
are read as they are and β k, β v formed at load time, in registers, and every pair product that
the general kernels compute twice is computed once:

    A_qa = A_qk (a = k)            A_ba = A_bk = Diag(β) A_kk (strictly lower)
    Ad = Kd = k ⊙ e^{G_L−G}         U = β v + V2 = (β v + Cm) − W h (the two V-side operands
                                    of the state pass; `_fwd_wy` stores β v + Cm)
    O = Q⊙e^G h + A_qk U,   h' = Diag(γ_L) h + Kdᵀ U

and in the backward the gradients of the coinciding matrices are summed before their products:
δA_q = δO Uᵀ (δA_qk + δA_qa), δA_b = −GC Uᵀ (δA_bk + δA_ba), δKd + δAd = U δh'ᵀ. The β gradient
is reduced inside the kernels: δβ = Σ_v δ(βv)·v (`_bwd_dv_kda`, all of V in one program) +
Σ_k δ(βk)·k (`_bwd_dk_state_kda`, kda_dk.py: the key gradient's kernels).

`_fwd_wy` and `_fwd_state` (wy.py, state.py) take the KDA case as a constexpr flag (their work
differs in two loads and one product); `_bwd_state` runs with Kd for Ad and A_qk for A_qa. A_qk feeds the state path here (as A_qa), so it is built at float32 accuracy, not LO.

q, k, v, β and δO are read, and δq, δk, δv, δg written, in the caller's [B, T, H, ·] layout
(`_x_ld`, common.py: T, H the caller's sizes); the scratch stays in the chunk layout.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (_chunk_prog, _last, _ld, _mm, _offs, _pair_block, _ref_factors, _row, _st, _x_ld,
                     _x_ld1, _x_st)


@triton.jit
def _fwd_pairs_kda(q, k, beta, G, Aqk, Abk, scale, Tp, NC, T, H,
                   K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """One [L, S] column block of A_qk (= A_qa) and A_bk (= A_ba = Diag(β) A_kk) of one chunk;
    `_fwd_pairs` with two products instead of four. q, k: [B, T, H, K]; beta: [B, T, H];
    Aqk, Abk: [BH, NC, L, L] float32."""
    n, j0, bh, seq, t0, nv, rows, cols, _, _, below, inblk = _pair_block(tab, L, S, VARLEN)
    if seq < 0:
        return
    acc_qk = tl.zeros([L, S], dtype=tl.float32)
    acc_kk = tl.zeros([L, S], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        py = _offs(bh, t0 + j0, cols, kk, Tp, K)
        Gx = tl.load(G + _offs(bh, t0, _last(rows, nv, VARLEN), kk, Tp, K))
        fx_off, fx_in, fy_off, fy_in = _ref_factors(G, Gx, py, bh, t0, j0, kk, below, inblk, nv, Tp, K, S,
                                                    VARLEN)
        xq = _x_ld(q, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * scale
        xk = _x_ld(k, bh, t0, rows, kk, nv, T, H, K).to(tl.float32)
        yk = _x_ld(k, bh, t0 + j0, cols, kk, nv - j0, T, H, K).to(tl.float32)
        y_off = tl.trans(yk * fy_off)
        y_in = tl.trans(yk * fy_in)
        acc_qk += tl.dot(xq * fx_off, y_off, input_precision=PREC) + tl.dot(xq * fx_in, y_in, input_precision=PREC)
        acc_kk += tl.dot(xk * fx_off, y_off, input_precision=PREC) + tl.dot(xk * fx_in, y_in, input_precision=PREC)
    bt = _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)
    ci = j0 + cols
    pa = _offs(bh * NC + n, 0, rows, ci, L, L)
    out_qk = tl.where(ci[None, :] <= rows[:, None], acc_qk, 0.0)
    out_bk = tl.where(ci[None, :] < rows[:, None], acc_kk * bt[:, None], 0.0)
    tl.store(Aqk + pa, out_qk)
    tl.store(Abk + pa, out_bk)


@triton.jit
def _bwd_dv_kda(Kd, v, beta, Aqk, Abk, E, U, dO, dH, dV2, GCb, dAq, dAb, dv, dbv, dqd,
                Tp, NC, T, H, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr, LV: tl.constexpr,
                LG: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """`_bwd_dv` for KDA: GC = Eᵀ δV2, δv = β (A_qkᵀ δO − A_bkᵀ GC + Kd δh'), the β gradient's V
    part Σ_v δ(βv)·v to dbv [BH, Tp], the summed pair gradients δA_q = δO Uᵀ, δA_b = −GC Uᵀ
    (strictly lower, to dAq, dAb [BH, NC, L, L]; δA_q's diagonal to dqd [BH, Tp]).
    U: [BH, Tp, V] (β v + V2, stored by the forward); v, dO, dv: [B, T, H, V]; beta: [B, T, H].
    `_mm` modes as `_bwd_dv`."""
    n = tl.program_id(0)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    if seq < 0:
        return
    pa = _offs(bh * NC + n, 0, rows, rows, L, L)
    Aqk_ = tl.load(Aqk + pa)
    Abk_ = tl.load(Abk + pa)
    Em = tl.load(E + pa)
    bt = _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)
    dA_q = tl.zeros([L, L], dtype=tl.float32)
    dA_b = tl.zeros([L, L], dtype=tl.float32)
    db = tl.zeros([L], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = _offs(bh, t0, rows, vv, Tp, V)
        do = _x_ld(dO, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        u = _ld(U + pv, m, VARLEN)
        GC = _mm(tl.trans(Em), _ld(dV2 + pv, m, VARLEN), LG, PREC)
        _st(GCb + pv, GC, m, VARLEN)
        dvb = _mm(tl.trans(Aqk_), do, LV, PREC)                     # δ(β v)
        dvb -= _mm(tl.trans(Abk_), GC, LV, PREC)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            dh = tl.load(dH + _offs(bh * NC + n, 0, kk, vv, K, V))
            dvb += _mm(_ld(Kd + _offs(bh, t0, rows, kk, Tp, K), m, VARLEN), dh, LV, PREC)
        _x_st(dv, dvb * bt[:, None], bh, t0, rows, vv, nv, T, H, V)
        db += tl.sum(dvb * _x_ld(v, bh, t0, rows, vv, nv, T, H, V).to(tl.float32), axis=1)
        dA_q += _mm(do, tl.trans(u), LO, PREC)
        dA_b -= _mm(GC, tl.trans(u), LO, PREC)
    strict = rows[None, :] < rows[:, None]
    _st(dbv + _row(bh, t0, rows, Tp, 1), db, m1, VARLEN)
    _st(dqd + _row(bh, t0, rows, Tp, 1),
        tl.sum(tl.where(rows[:, None] == rows[None, :], dA_q, 0.0), axis=1), m1, VARLEN)
    tl.store(dAq + pa, tl.where(strict, dA_q, 0.0))
    tl.store(dAb + pa, tl.where(strict, dA_b, 0.0))
