"""The KDA key gradient (δq, δk, δg and δβ's k part) in two kernels (docs/kernels.md,
"DPLR and KDA"; it replaced one kernel per (chunk, K-tile), `_bwd_dk_kda`, 11.04 →
10.14 ms fwd+bwd at (8, 2048, 16, 128, 128), bf16, H200): the terms and gate-gradient grouping of
the general op's (dplr_dk.py), arranged so that no program runs full-height masked pair products and no
K-tile re-reads the V side in a program of its own.

`_bwd_dk_pairs_kda`, grid (chunk × L/S sub-chunks, K-tile, b·h): the pair-matrix gradients of one
16-row sub-chunk i on [S, S] blocks — δx of its rows from the earlier blocks j < i (reference
point: block j's last row, as dplr_dk.py's) and δy of its columns from the later
blocks r > i (reference: block i's last row), the diagonal block with its middle reference
point. δA_q, δA_b are strictly lower, so the diagonal block needs no mask. It writes the three
partial gradients δX_q, δX_b, δY [BH, Tp, K] (float32 scratch) rather than finishing δq, δk, δg:
those need the state-side terms and the gate gradient's cumsums over the whole chunk.

`_bwd_dk_state_kda`, grid (chunk, b·h), the K-tiles in a loop: the state-side products δO hᵀ,
U δh'ᵀ, GC hᵀ and h·δh', then δq, δk, δ(βk), and δg with its two cumsums over all L rows of the
chunk in one program — the float32 sums in the order of `_dk_finish` (dplr_dk.py) — and the β
gradient's k part summed over the K-tiles (dbk [BH, 1, Tp]). At a K-tile of K the V side (U, GC,
δO) is read once per chunk; at smaller tiles it is re-read by the same program (cache-hot).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (_chunk_prog, _dk_state_side, _earlier_refs, _gate_grad, _last, _ld, _mm, _offs,
                     _row, _st, _sub_block, _sub_refs, _x_ld, _x_ld1, _x_st)


@triton.jit
def _bwd_dk_pairs_kda(q, k, beta, G, dAq, dAb, dXq, dXb, dY, scale, Tp, NC, T, H,
                      K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
                      PREC: tl.constexpr, LO: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """δX_q = (δA_q ⊙ decay) k, δX_b = (δA_b ⊙ decay) k (x = q·scale and β k) and δY = (δA_q ⊙
    decay)ᵀ q + (δA_b ⊙ decay)ᵀ β k for the S rows of one sub-chunk and BK channels.
    q, k: [B, T, H, K]; beta: [B, T, H]; dAq, dAb: [BH, NC, L, L]; dXq, dXb, dY: [BH, Tp, K]."""
    NB: tl.constexpr = L // S
    n, i, bh, seq, t0, nv, sr, ri, kr = _sub_block(tab, L, S, BK, VARLEN)
    if seq < 0:
        return
    i0 = i * S
    Gi, g_end, fx, fy = _sub_refs(G, bh, t0, i0, kr, nv, Tp, K, S, VARLEN)
    qi = _x_ld(q, bh, t0, ri, kr, nv, T, H, K).to(tl.float32) * scale
    ki = _x_ld(k, bh, t0, ri, kr, nv, T, H, K).to(tl.float32)
    bi = ki * _x_ld1(beta, bh, t0, ri, nv, T, H).to(tl.float32)[:, None]
    # the diagonal block, both sides referenced at its middle row
    pd = _offs(bh * NC + n, 0, ri, ri, L, L)
    aq = tl.load(dAq + pd)
    ab = tl.load(dAb + pd)
    y = ki * fy
    dxq = fx * _mm(aq, y, LO, PREC)
    dxb = fx * _mm(ab, y, LO, PREC)
    dy = fy * (_mm(tl.trans(aq), qi * fx, LO, PREC) + _mm(tl.trans(ab), bi * fx, LO, PREC))
    for j in range(0, i):           # earlier blocks: this sub-chunk's rows lie below them
        j0 = j * S
        cj = j0 + sr
        fx, ey = _earlier_refs(G, Gi, bh, t0, j0, kr, nv, Tp, K, S, VARLEN)
        y = _x_ld(k, bh, t0, cj, kr, nv, T, H, K).to(tl.float32) * ey
        pd = _offs(bh * NC + n, 0, ri, cj, L, L)
        dxq += fx * _mm(tl.load(dAq + pd), y, LO, PREC)
        dxb += fx * _mm(tl.load(dAb + pd), y, LO, PREC)
    dyo = tl.zeros([S, BK], dtype=tl.float32)
    for r in range(i + 1, NB):      # later blocks: their rows lie below this sub-chunk's columns
        rr = r * S + sr
        Gr = tl.load(G + _offs(bh, t0, _last(rr, nv, VARLEN), kr, Tp, K))
        fx = tl.exp((Gr - g_end[None, :]).to(tl.float32))
        kx = _x_ld(k, bh, t0, rr, kr, nv, T, H, K).to(tl.float32)
        xb = kx * _x_ld1(beta, bh, t0, rr, nv, T, H).to(tl.float32)[:, None] * fx
        xq = _x_ld(q, bh, t0, rr, kr, nv, T, H, K).to(tl.float32) * scale * fx
        pd = _offs(bh * NC + n, 0, rr, ri, L, L)
        dyo += _mm(tl.trans(tl.load(dAq + pd)), xq, LO, PREC) + _mm(tl.trans(tl.load(dAb + pd)), xb, LO, PREC)
    dy += tl.exp((g_end[None, :] - Gi).to(tl.float32)) * dyo
    ps = _offs(bh, t0, ri, kr, Tp, K)
    m = (ri < nv)[:, None]
    _st(dXq + ps, dxq, m, VARLEN)
    _st(dXb + ps, dxb, m, VARLEN)
    _st(dY + ps, dy, m, VARLEN)


@triton.jit
def _bwd_dk_state_kda(q, k, beta, G, U, Hs, dO, dH, GCb, dXq, dXb, dY, dqd, dq, dk, dbk, dg, scale,
                      Tp, NC, T, H, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr,
                      tab=None, VARLEN: tl.constexpr = False):
    """The rest of the key gradient for one chunk, all K-tiles: the state-side products, δq, δk,
    δg (the pair parts δX_q, δX_b, δY from `_bwd_dk_pairs_kda`) and the β gradient's k part
    Σ_k δ(βk)·k over all of K to dbk [BH, Tp]. q, k, dq, dk, dg: [B, T, H, K]; dO: [B, T, H, V];
    beta: [B, T, H]; the scratch in the chunk layout."""
    n = tl.program_id(0)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    if seq < 0:
        return
    bt = _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)
    d = _ld(dqd + _row(bh, t0, rows, Tp, 1), m1, VARLEN)
    dbs = tl.zeros([L], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kr = k0 + tl.arange(0, BK)
        Gc, eG, dec, eGl, dKU, _, dQg, GW, hdh = _dk_state_side(G, U, U, Hs, dO, dH, GCb, bh, n, t0, nv, rows, m,
                                                                kr, Tp, NC, T, H, K, V, L, BK, BV, PREC, LO,
                                                                VARLEN, False)
        qs = _x_ld(q, bh, t0, rows, kr, nv, T, H, K).to(tl.float32) * scale
        kx = _x_ld(k, bh, t0, rows, kr, nv, T, H, K).to(tl.float32)
        bx = kx * bt[:, None]
        ps = _offs(bh, t0, rows, kr, Tp, K)
        dXq_ = _ld(dXq + ps, m, VARLEN)
        dXb_ = _ld(dXb + ps, m, VARLEN)
        dY_ = _ld(dY + ps, m, VARLEN)
        db = GW * eG + dXb_                                                 # δ(β k)
        _x_st(dq, (dQg * eG + dXq_ + d[:, None] * kx) * scale, bh, t0, rows, kr, nv, T, H, K)
        _x_st(dk, dKU * dec + dY_ + d[:, None] * qs + bt[:, None] * db, bh, t0, rows, kr, nv, T, H, K)
        dbs += tl.sum(db * kx, axis=1)
        # gate gradient grouped as in `_dk_finish` (dplr_dk.py; a = k and b = β k merged)
        up = qs * dXq_ + bx * dXb_ - kx * dY_ + (qs * eG) * dQg + (bx * eG) * GW
        _x_st(dg, _gate_grad(up, kx * dec * dKU, eGl, hdh), bh, t0, rows, kr, nv, T, H, K)
    _st(dbk + _row(bh, t0, rows, Tp, 1), dbs, m1, VARLEN)
