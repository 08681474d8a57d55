"""The KDA-specialised kernels (a = k, b = β k, v ← β v; seed "与KDA的关系"): the inputs k, v, β
are read as they are and β k, β v formed at load time, in registers, and every pair product that
the general kernels compute twice is computed once:

    A_qa = A_qk (a = k)            A_ba = A_bk = Diag(β) A_kk (strictly lower)
    Ad = Kd = k ⊙ e^{G_L−G}         U = β v + V2 = (β v + Cm) − W h (the two V-side operands
                                    of the state pass; `_fwd_wy` stores β v + Cm)
    O = Q⊙e^G h + A_qk U,   h' = Diag(γ_L) h + Kdᵀ U

and in the backward the gradients of the coinciding matrices are summed before their products:
δA_q = δO Uᵀ (δA_qk + δA_qa), δA_b = −GC Uᵀ (δA_bk + δA_ba), δKd + δAd = U δh'ᵀ. The β gradient
is reduced inside the kernels: δβ = Σ_v δ(βv)·v (`_bwd_dv_kda`, all of V in one program) +
Σ_k δ(βk)·k (`_bwd_dk_kda`, one partial sum per K-tile, added by the launcher).

`_fwd_wy` and `_fwd_state` (wy.py, state.py) take the KDA case as a constexpr flag (their work
differs in two loads and one product); `_bwd_state` runs with Kd for Ad and A_qk for A_qa. A_qk feeds the state path here (as A_qa), so it is built at float32 accuracy, not LO.

q, k, v, β and δO are read, and δq, δk, δv, δg written, in the caller's [B, T, H, ·] layout
(`_x_ld`, common.py: T, H the caller's sizes); the scratch stays in the chunk layout.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .backward import _pair_grad
from .common import (_chunk_prog, _last, _ld, _mm, _offs, _pair_block, _ref_factors, _row, _st, _x_ld,
                     _x_ld1, _x_st)


@triton.jit
def _fwd_pairs_kda(q, k, beta, G, Aqk, Abk, scale, Tp, NC, T, H,
                   K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
                   PREC: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """One [L, S] column block of A_qk (= A_qa) and A_bk (= A_ba = Diag(β) A_kk) of one chunk;
    `_fwd_pairs` with two products instead of four. q, k: [B, T, H, K]; beta: [B, T, H]."""
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
    tl.store(Aqk + pa, tl.where(ci[None, :] <= rows[:, None], acc_qk, 0.0))
    tl.store(Abk + pa, tl.where(ci[None, :] < rows[:, None], acc_kk * bt[:, None], 0.0))


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


@triton.jit
def _dk_state_side(G, U, Hs, dO, dH, GCb, bh, n, t0, nv, rows, m, kr, Tp, NC, T, H, K: tl.constexpr,
                   V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   PREC: tl.constexpr, LO: tl.constexpr, VARLEN: tl.constexpr):
    """The state-side part of the KDA key gradient for one chunk and K-tile `kr` (both
    `_bwd_dk_kda` and split_dk's `_bwd_dk_state_kda`): the chunk's G and its decays (Gc, e^G,
    e^{G_L − G}, e^{G_L}), U δh'ᵀ, δO hᵀ, −GC hᵀ ([L, BK] each) and Σ_v h⊙δh' ([BK])."""
    Gc = tl.load(G + _offs(bh, t0, _last(rows, nv, VARLEN), kr, Tp, K))
    g_last = tl.load(G + _row(bh, t0 + nv - 1, kr, Tp, K))
    eG = tl.exp(Gc.to(tl.float32))
    dec = tl.exp((g_last[None, :] - Gc).to(tl.float32))
    eGl = tl.exp(g_last.to(tl.float32))
    dKU = tl.zeros([L, BK], dtype=tl.float32)
    dQg = tl.zeros([L, BK], dtype=tl.float32)
    GW = tl.zeros([L, BK], dtype=tl.float32)
    hdh = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = _offs(bh, t0, rows, vv, Tp, V)
        ph = _offs(bh * NC + n, 0, kr, vv, K, V)
        hs = tl.load(Hs + ph)
        dh = tl.load(dH + ph)
        dKU += _mm(_ld(U + pv, m, VARLEN), tl.trans(dh), LO, PREC)
        dQg += _mm(_x_ld(dO, bh, t0, rows, vv, nv, T, H, V).to(tl.float32), tl.trans(hs), LO, PREC)
        GW -= _mm(_ld(GCb + pv, m, VARLEN), tl.trans(hs), LO, PREC)
        hdh += tl.sum(hs * dh, axis=1)
    return Gc, eG, dec, eGl, dKU, dQg, GW, hdh


@triton.jit
def _bwd_dk_kda(q, k, beta, G, U, Hs, dO, dH, GCb, dAq, dAb, dqd, dq, dk, dbk, dg, scale, Tp, NC, T, H,
                K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr, tab=None,
                VARLEN: tl.constexpr = False):
    """`_bwd_dk` for KDA, one (chunk, K-tile): δq, δk (= δk + δa + β δb of the general kernel),
    δg, and this K-tile's part of the β gradient Σ_k δ(βk)·k to dbk [BH, NKT, Tp]. Two pair
    gradients (δA_q with x = q, δA_b with x = β k; y = k for both) instead of four, one U δh'ᵀ
    product for δKd + δAd. q, k, dq, dk, dg: [B, T, H, K]; dO: [B, T, H, V]; beta: [B, T, H]."""
    NB: tl.constexpr = L // S
    n = tl.program_id(0)
    kt = tl.program_id(1)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(2), L, VARLEN)
    if seq < 0:
        return
    kr = kt * BK + tl.arange(0, BK)
    Gc, eG, dec, eGl, dKU, dQg, GW, hdh = _dk_state_side(G, U, Hs, dO, dH, GCb, bh, n, t0, nv, rows, m, kr, Tp,
                                                         NC, T, H, K, V, L, BK, BV, PREC, LO, VARLEN)
    bt = _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)
    qs = _x_ld(q, bh, t0, rows, kr, nv, T, H, K).to(tl.float32) * scale
    kx = _x_ld(k, bh, t0, rows, kr, nv, T, H, K).to(tl.float32)
    bx = kx * bt[:, None]
    dXq = tl.zeros([L, BK], dtype=tl.float32)
    dXb = tl.zeros([L, BK], dtype=tl.float32)
    dY = tl.zeros([L, BK], dtype=tl.float32)
    cols = tl.arange(0, S)
    for jb in range(0, NB):       # column blocks with the forward's reference points (_bwd_dk)
        j0 = jb * S
        ci = j0 + cols
        py = _offs(bh, t0, ci, kr, Tp, K)
        pd = _offs(bh * NC + n, 0, rows, ci, L, L)
        below = rows >= j0 + S
        inblk = (rows >= j0) & (rows < j0 + S)
        fac = _ref_factors(G, Gc, py, bh, t0, j0, kr, below, inblk, nv, Tp, K, S, VARLEN)
        fx_off, fx_in, fy_off, fy_in = fac
        yk = _x_ld(k, bh, t0 + j0, cols, kr, nv - j0, T, H, K).to(tl.float32)
        dXq, cq = _pair_grad(dAq + pd, dXq, yk, qs * fx_off, qs * fx_in, below, inblk, fac, LO, PREC)
        dXb, cb = _pair_grad(dAb + pd, dXb, yk, bx * fx_off, bx * fx_in, below, inblk, fac, LO, PREC)
        # the 0/1 placement is exact at "ieee"; at PREC = "tf32x3" (float32 gates) Triton 3.6
        # built this kernel with an out-of-bounds shared-memory read (compute-sanitizer, H200)
        dY += tl.dot(tl.where(rows[:, None] == ci[None, :], 1.0, 0.0), cq + cb, input_precision="ieee")
    d = _ld(dqd + _row(bh, t0, rows, Tp, 1), m1, VARLEN)
    db = GW * eG + dXb                                                  # δ(β k)
    _x_st(dq, (dQg * eG + dXq + d[:, None] * kx) * scale, bh, t0, rows, kr, nv, T, H, K)
    _x_st(dk, dKU * dec + dY + d[:, None] * qs + bt[:, None] * db, bh, t0, rows, kr, nv, T, H, K)
    _st(dbk + _row(bh * tl.num_programs(1) + kt, t0, rows, Tp, 1), tl.sum(db * kx, axis=1), m1, VARLEN)
    # gate gradient grouped as in `_bwd_dk` (a = k and b = β k merged)
    up = qs * dXq + bx * dXb - kx * dY + (qs * eG) * dQg + (bx * eG) * GW
    down = kx * dec * dKU
    dgk = tl.cumsum(up, axis=0, reverse=True) + (tl.cumsum(down, axis=0) - down)
    dgk += (eGl * hdh)[None, :]
    _x_st(dg, dgk, bh, t0, rows, kr, nv, T, H, K)
