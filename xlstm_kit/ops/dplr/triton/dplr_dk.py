"""The general op's key gradient (δq, δk, δa, δb, δgk) in two kernels, as kda_dk.py splits KDA's,
with the epilogue `_dk_finish`. It replaced one kernel per (chunk, K-tile), `_bwd_dk`: DPLR
fwd+bwd 11.65 → 10.81 ms (bf16 gk), 15.14 → 12.55 (float32 gk) at (8, 2048, 16, 128, 128), H200
(docs/kernels.md, "DPLR and KDA").

`_bwd_dk_pairs`, grid (chunk × L/S sub-chunks, K-tile, b·h): the four pair matrices' gradients
(δA_qk, δA_qa, δA_bk, δA_ba: x ∈ {q·scale, b} by row, y ∈ {k, a} by column) for the S rows of
one sub-chunk i on [S, S] blocks — δx of its rows from the earlier blocks j < i (reference
point: block j's last row), δy of its columns from the later blocks r > i (reference: block i's
last row), the diagonal block with its middle reference point. The δA are stored strictly lower
(their diagonals, dqk_d and dqa_d, apart), so the diagonal block needs no mask. It writes the
partial gradients δX_q, δX_b, δY_k, δY_a [BH, Tp, K] (float32 scratch): δq, δk, δa, δb and δgk
need the state-side terms and the gate gradient's cumsums over the whole chunk.

`_bwd_dk_state`, grid (chunk, b·h), the K-tiles in a loop: the state-side products (V δh'ᵀ,
V2 δh'ᵀ, δO hᵀ, −GC hᵀ, h·δh'; `_dk_state_side`), then `_dk_finish` on all L rows of the chunk:
the outputs and δgk with float32 sums and the gate-gradient grouping of chunkwise.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import (_chunk_prog, _dk_state_side, _earlier_refs, _gate_grad, _last, _ld, _mm, _offs, _row,
                     _st, _sub_block, _sub_refs, _x_ld, _x_st)


@triton.jit
def _ld_qkab(q, k, a, b, bh, t0, rows, cols, nv, T, H, K, scale):
    """The float32 tiles q·scale, k, a, b at steps t0 + rows, channels cols, of head b·h of the
    caller's [B, T, H, K] arrays (`_x_ld`)."""
    return (_x_ld(q, bh, t0, rows, cols, nv, T, H, K).to(tl.float32) * scale,
            _x_ld(k, bh, t0, rows, cols, nv, T, H, K).to(tl.float32),
            _x_ld(a, bh, t0, rows, cols, nv, T, H, K).to(tl.float32),
            _x_ld(b, bh, t0, rows, cols, nv, T, H, K).to(tl.float32))


@triton.jit
def _dk_finish(dq, dk, da, db, dg, bh, t0, rows, cols, nv, T, H, K, qs, kx, ax, bx, dXq, dXb,
               dYk, dYa, dKd, dAd, dQg, GW, eG, dec, eGl, hdh, dqk, dqa, scale):
    """δq, δk, δa, δb and δgk of one chunk and K-tile ([L, BK]: steps t0 + rows, channels cols of
    head b·h, written to the caller's [B, T, H, K] arrays, `_x_st`) from the pair parts δX_q,
    δX_b, δY_k, δY_a, the state-side terms of `_dk_state_side` and the pair diagonals dqk, dqa
    [L]; qs = q·scale."""
    _x_st(dq, (dQg * eG + dXq + dqk[:, None] * kx + dqa[:, None] * ax) * scale, bh, t0, rows, cols,
          nv, T, H, K)
    _x_st(db, GW * eG + dXb, bh, t0, rows, cols, nv, T, H, K)      # δB = δB← ⊙ Γ (+ pair terms)
    _x_st(dk, dKd * dec + dYk + dqk[:, None] * qs, bh, t0, rows, cols, nv, T, H, K)
    _x_st(da, dAd * dec + dYa + dqa[:, None] * qs, bh, t0, rows, cols, nv, T, H, K)
    up = qs * dXq + bx * dXb - kx * dYk - ax * dYa + (qs * eG) * dQg + (bx * eG) * GW
    down = kx * dec * dKd + ax * dec * dAd
    _x_st(dg, _gate_grad(up, down, eGl, hdh), bh, t0, rows, cols, nv, T, H, K)


@triton.jit
def _rows_side(d1, d2, y1, y2, LO: tl.constexpr, PREC: tl.constexpr):
    """δx of a block's rows from two pair matrices sharing x: d1 y1 + d2 y2 ([S, S] · [S, BK])."""
    return _mm(d1, y1, LO, PREC) + _mm(d2, y2, LO, PREC)


@triton.jit
def _cols_side(d1, d2, x1, x2, LO: tl.constexpr, PREC: tl.constexpr):
    """δy of a block's columns from two pair matrices sharing y: d1ᵀ x1 + d2ᵀ x2."""
    return _mm(tl.trans(d1), x1, LO, PREC) + _mm(tl.trans(d2), x2, LO, PREC)


@triton.jit
def _bwd_dk_pairs(q, k, a, b, G, dAqk, dAqa, dAbk, dAba, dXq, dXb, dYk, dYa, scale, Tp, NC, T, H,
                  K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
                  PREC: tl.constexpr, LO: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """δX_q = (δA_qk ⊙ decay) k + (δA_qa ⊙ decay) a, δX_b likewise from δA_bk, δA_ba, and
    δY_k = (δA_qk ⊙ decay)ᵀ q·scale + (δA_bk ⊙ decay)ᵀ b, δY_a likewise from δA_qa, δA_ba, for
    the S rows of one sub-chunk and BK channels. q, k, a, b: [B, T, H, K] (the caller's layout);
    dA*: [BH, NC, L, L] strictly lower; dXq, dXb, dYk, dYa: [BH, Tp, K] float32."""
    NB: tl.constexpr = L // S
    n, i, bh, seq, t0, nv, sr, ri, kr = _sub_block(tab, L, S, BK, VARLEN)
    if seq < 0:
        return
    i0 = i * S
    pi = _offs(bh, t0, ri, kr, Tp, K)
    mi = (ri < nv)[:, None]
    Gi, g_end, fx, fy = _sub_refs(G, bh, t0, i0, kr, nv, Tp, K, S, VARLEN)
    qi, ki, ai, bi = _ld_qkab(q, k, a, b, bh, t0, ri, kr, nv, T, H, K, scale)
    # the diagonal block, both sides referenced at its middle row
    pd = _offs(bh * NC + n, 0, ri, ri, L, L)
    d_qk = tl.load(dAqk + pd)
    d_qa = tl.load(dAqa + pd)
    d_bk = tl.load(dAbk + pd)
    d_ba = tl.load(dAba + pd)
    yk = ki * fy
    ya = ai * fy
    xq = qi * fx
    xb = bi * fx
    dxq = fx * _rows_side(d_qk, d_qa, yk, ya, LO, PREC)
    dxb = fx * _rows_side(d_bk, d_ba, yk, ya, LO, PREC)
    dyk = fy * _cols_side(d_qk, d_bk, xq, xb, LO, PREC)
    dya = fy * _cols_side(d_qa, d_ba, xq, xb, LO, PREC)
    for j in range(0, i):           # earlier blocks: this sub-chunk's rows lie below them
        cj = j * S + sr
        fx, ey = _earlier_refs(G, Gi, bh, t0, j * S, kr, nv, Tp, K, S, VARLEN)
        yk = _x_ld(k, bh, t0, cj, kr, nv, T, H, K).to(tl.float32) * ey
        ya = _x_ld(a, bh, t0, cj, kr, nv, T, H, K).to(tl.float32) * ey
        pd = _offs(bh * NC + n, 0, ri, cj, L, L)
        dxq += fx * _rows_side(tl.load(dAqk + pd), tl.load(dAqa + pd), yk, ya, LO, PREC)
        dxb += fx * _rows_side(tl.load(dAbk + pd), tl.load(dAba + pd), yk, ya, LO, PREC)
    dyk_o = tl.zeros([S, BK], dtype=tl.float32)
    dya_o = tl.zeros([S, BK], dtype=tl.float32)
    for r in range(i + 1, NB):      # later blocks: their rows lie below this sub-chunk's columns
        rr = r * S + sr
        fx = tl.exp((tl.load(G + _offs(bh, t0, _last(rr, nv, VARLEN), kr, Tp, K)) - g_end[None, :])
                    .to(tl.float32))
        xq = _x_ld(q, bh, t0, rr, kr, nv, T, H, K).to(tl.float32) * scale * fx
        xb = _x_ld(b, bh, t0, rr, kr, nv, T, H, K).to(tl.float32) * fx
        pd = _offs(bh * NC + n, 0, rr, ri, L, L)
        dyk_o += _cols_side(tl.load(dAqk + pd), tl.load(dAbk + pd), xq, xb, LO, PREC)
        dya_o += _cols_side(tl.load(dAqa + pd), tl.load(dAba + pd), xq, xb, LO, PREC)
    ey = tl.exp((g_end[None, :] - Gi).to(tl.float32))
    _st(dXq + pi, dxq, mi, VARLEN)
    _st(dXb + pi, dxb, mi, VARLEN)
    _st(dYk + pi, dyk + ey * dyk_o, mi, VARLEN)
    _st(dYa + pi, dya + ey * dya_o, mi, VARLEN)


@triton.jit
def _bwd_dk_state(q, k, v, a, b, G, V2, Hs, dO, dH, GCb, dXq, dXb, dYk, dYa, dqk_d, dqa_d,
                  dq, dk, da, db, dg, scale, Tp, NC, T, H, K: tl.constexpr, V: tl.constexpr,
                  L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                  LO: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """The rest of the general key gradient for one chunk, all K-tiles: the state-side products,
    then δq, δk, δa, δb, δgk from the pair parts of `_bwd_dk_pairs`. q, k, a, b, dq, dk, da, db,
    dg: [B, T, H, K], v, dO: [B, T, H, V] (the caller's layout); the scratch [BH, Tp, ·] in the
    chunk layout (V2, GCb: · = V; the rest K), dqk_d, dqa_d [BH, Tp]."""
    n = tl.program_id(0)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    if seq < 0:
        return
    dqk = _ld(dqk_d + _row(bh, t0, rows, Tp, 1), m1, VARLEN)
    dqa = _ld(dqa_d + _row(bh, t0, rows, Tp, 1), m1, VARLEN)
    for k0 in range(0, K, BK):
        kr = k0 + tl.arange(0, BK)
        _, eG, dec, eGl, dKd, dAd, dQg, GW, hdh = _dk_state_side(
            G, v, V2, Hs, dO, dH, GCb, bh, n, t0, nv, rows, m, kr, Tp, NC, T, H, K, V, L, BK, BV,
            PREC, LO, VARLEN, True)
        pk = _offs(bh, t0, rows, kr, Tp, K)
        qs, kx, ax, bx = _ld_qkab(q, k, a, b, bh, t0, rows, kr, nv, T, H, K, scale)
        _dk_finish(dq, dk, da, db, dg, bh, t0, rows, kr, nv, T, H, K, qs, kx, ax, bx,
                   _ld(dXq + pk, m, VARLEN), _ld(dXb + pk, m, VARLEN), _ld(dYk + pk, m, VARLEN),
                   _ld(dYa + pk, m, VARLEN), dKd, dAd, dQg, GW, eG, dec, eGl, hdh, dqk, dqa, scale)
