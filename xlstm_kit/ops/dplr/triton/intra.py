"""The KDA forward's intra-chunk phase in one kernel per (chunk, b·h), `_fwd_intra_kda`
(`DPLRKernelConfig(fused_intra=True)`; the default is still `_fwd_pairs_kda` + `_fwd_wy`).

The chunk is handled as NB = L / 16 row blocks of S = 16 steps, one row block at a time
(`_row_pass`): its q, k, G once, and k, G of the column blocks left of it again (L2; the split
path's pair kernel reloads the whole chunk in each of its L / S column-block programs). The pair
matrices are formed as [S, S] blocks: NB diagonal ones and NB (NB − 1) / 2 strictly-lower ones —
the blocks above the diagonal, which the split path computes and masks away, are never formed. The reference points of the log-decays are the split path's
(`_ref_factors`): a block below the diagonal is referenced at the end of its column block (both
factors ≤ 1), a diagonal block at its middle step; so A_qk, A_bk are the same matrices up to
float32 rounding order, and the backward (which re-forms these factors itself) is unchanged.

E = (I + A_bk)⁻¹ is block lower triangular: the NB diagonal [S, S] inverses by forward
substitution (the NB chains interleaved in one loop, so the S − 1 dependent steps run on
[S, S] tiles, not on one [L, L] tile), then the blocks below by block forward substitution,
E_ij = −E_ii Σ_{j ≤ m < i} N_im E_mj: 16 [S, S] products at L = 64, not 6 masked [L, L]² ones.
The inverse reads A_bk's blocks back (after a block barrier: other warps stored them), and
W = E (β k ⊙ e^G), U₀ = E (β v) (one product; the split path forms β v − E (A_bk β v)) follow
from E read back as one [L, L] tile the same way (both are stored for the backward anyway; the
reads hit L2). Qg, Kd and e^{G_L} are stored from the pair passes' tiles.
Products at PREC (3-pass TF32 on the GPU): all of them reach the state path.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_prog, _last, _offs, _row, _st, _x_ld, _x_ld1


@triton.jit
def _put(A, base, i0, j0, x, L: tl.constexpr, S: tl.constexpr):
    """Stores the [S, S] block x at rows i0, columns j0 of pair matrix `base` of A [·, L, L]."""
    r = tl.arange(0, S)
    tl.store(A + _offs(base, i0, r, j0 + r, L, L), x)


@triton.jit
def _get(A, base, i0, j0, L: tl.constexpr, S: tl.constexpr):
    """The [S, S] block at rows i0, columns j0 of pair matrix `base` of A [·, L, L]."""
    r = tl.arange(0, S)
    return tl.load(A + _offs(base, i0, r, j0 + r, L, L))


@triton.jit
def _dot(x, y, PREC: tl.constexpr):
    return tl.dot(x, y, input_precision=PREC)


@triton.jit
def _x_blk(q, k, G, Qg, Kd, bh, t0, i0, nv, kk, scale, Tp, T, H, K, S: tl.constexpr, VARLEN: tl.constexpr):
    """Row block i0 … i0 + S − 1 of the chunk as the rows of its pair blocks, channels kk:
    (scale·q, k [S, BK] float32, zeros past the valid rows; G [S, BK] float64, read at the last
    valid row past them; kᵀ decayed from the block's middle step [BK, S]; its middle-step
    reference g_mid [BK]). Stores the rows' Qg and Kd on the way."""
    r = tl.arange(0, S)
    Gb = tl.load(G + _offs(bh, t0, _last(i0 + r, nv, VARLEN), kk, Tp, K))
    g_mid = tl.load(G + _row(bh, t0 + _last(i0 + S // 2 - 1, nv, VARLEN), kk, Tp, K))
    g_last = tl.load(G + _row(bh, t0 + nv - 1, kk, Tp, K))
    xq = _x_ld(q, bh, t0 + i0, r, kk, nv - i0, T, H, K).to(tl.float32) * scale
    xk = _x_ld(k, bh, t0 + i0, r, kk, nv - i0, T, H, K).to(tl.float32)
    pk = _offs(bh, t0 + i0, r, kk, Tp, K)
    m = (i0 + r < nv)[:, None]
    _st(Qg + pk, xq * tl.exp(Gb.to(tl.float32)), m, VARLEN)
    _st(Kd + pk, xk * tl.exp((g_last[None, :] - Gb).to(tl.float32)), m, VARLEN)
    y_in = tl.trans(xk * tl.exp((g_mid[None, :] - Gb).to(tl.float32)))
    return xq, xk, Gb, y_in, g_mid


@triton.jit
def _y_blk(k, G, bh, t0, j0, nv, kk, Tp, T, H, K, S: tl.constexpr, VARLEN: tl.constexpr):
    """Column block j0 … j0 + S − 1 as the columns of the blocks below the diagonal: (kᵀ decayed
    from the block's end step [BK, S], that reference g_end [BK])."""
    r = tl.arange(0, S)
    Gb = tl.load(G + _offs(bh, t0, _last(j0 + r, nv, VARLEN), kk, Tp, K))
    g_end = tl.load(G + _row(bh, t0 + _last(j0 + S - 1, nv, VARLEN), kk, Tp, K))
    yk = _x_ld(k, bh, t0 + j0, r, kk, nv - j0, T, H, K).to(tl.float32)
    return tl.trans(yk * tl.exp((g_end[None, :] - Gb).to(tl.float32))), g_end


@triton.jit
def _pair(aq, ak, xq, xk, Gx, g_ref, yT, PREC: tl.constexpr):
    """One [S, S] block of A_qk and A_kk, one K-step: rows x (scale·q and k) decayed to the
    reference g_ref, against yT (k of the column block, decayed from it)."""
    f = tl.exp((Gx - g_ref[None, :]).to(tl.float32))
    aq += tl.dot(xq * f, yT, input_precision=PREC)
    ak += tl.dot(xk * f, yT, input_precision=PREC)
    return aq, ak


@triton.jit
def _row_pass(q, k, beta, G, Aqk, Abk, Qg, Kd, base, bh, t0, nv, scale, Tp, T, H, I: tl.constexpr,
              K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
              VARLEN: tl.constexpr):
    """Row block I of A_qk and A_bk: its diagonal block and the I blocks left of it, over all of K
    (at most 8 [S, S] accumulators live: one row block at a time keeps them in registers, where all
    20 at once spilled 2.5 KB per thread; ptxas sm_90a, K = V = 128, L = 64, 8 warps: 668 B at
    BK = 32, 20 B at BK = 16), stored with the blocks right of it as zeros; Qg, Kd of its rows."""
    i0 = I * S
    z = tl.zeros([S, S], dtype=tl.float32)
    qd, kd, q0, k0, q1, k1, q2, k2 = z, z, z, z, z, z, z, z
    for c0 in range(0, K, BK):
        kk = c0 + tl.arange(0, BK)
        xq, xk, Gx, y_in, g_mid = _x_blk(q, k, G, Qg, Kd, bh, t0, i0, nv, kk, scale, Tp, T, H, K, S, VARLEN)
        qd, kd = _pair(qd, kd, xq, xk, Gx, g_mid, y_in, PREC)
        if I > 0:
            y, g_end = _y_blk(k, G, bh, t0, 0, nv, kk, Tp, T, H, K, S, VARLEN)
            q0, k0 = _pair(q0, k0, xq, xk, Gx, g_end, y, PREC)
        if I > 1:
            y, g_end = _y_blk(k, G, bh, t0, S, nv, kk, Tp, T, H, K, S, VARLEN)
            q1, k1 = _pair(q1, k1, xq, xk, Gx, g_end, y, PREC)
        if I > 2:
            y, g_end = _y_blk(k, G, bh, t0, 2 * S, nv, kk, Tp, T, H, K, S, VARLEN)
            q2, k2 = _pair(q2, k2, xq, xk, Gx, g_end, y, PREC)
    r = tl.arange(0, S)
    bt = _x_ld1(beta, bh, t0 + i0, r, nv - i0, T, H).to(tl.float32)[:, None]
    _put(Aqk, base, i0, i0, tl.where(r[None, :] <= r[:, None], qd, 0.0), L, S)
    _put(Abk, base, i0, i0, tl.where(r[None, :] < r[:, None], kd * bt, 0.0), L, S)
    if I > 0:
        _put(Aqk, base, i0, 0, q0, L, S)
        _put(Abk, base, i0, 0, k0 * bt, L, S)
    if I > 1:
        _put(Aqk, base, i0, S, q1, L, S)
        _put(Abk, base, i0, S, k1 * bt, L, S)
    if I > 2:
        _put(Aqk, base, i0, 2 * S, q2, L, S)
        _put(Abk, base, i0, 2 * S, k2 * bt, L, S)
    for j in tl.static_range(I + 1, L // S):
        _put(Aqk, base, i0, j * S, z, L, S)
        _put(Abk, base, i0, j * S, z, L, S)


@triton.jit
def _subst(N, D, sel):
    """One step of forward substitution for D = (I + N)⁻¹ − I, N strictly lower [S, S]: row i
    (sel) becomes −N_i − Σ_j N_ij D_j; rows not yet formed are still 0 and N_ij = 0 for j ≥ i."""
    x = -tl.sum(tl.where(sel, N, 0.0), axis=0)
    x = x + tl.sum(x[:, None] * D, axis=0)
    return tl.where(sel, x[None, :], D)


@triton.jit
def _fwd_intra_kda(q, k, v, beta, G, Aqk, Abk, E, W, Cm, Qg, Kd, eGl, scale, Tp, NC, T, H,
                   K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, S: tl.constexpr,
                   BK: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                   tab=None, VARLEN: tl.constexpr = False):
    """`_fwd_pairs_kda` + `_fwd_wy` (KDA) for one chunk (module docstring): A_qk (lower), A_bk
    (strictly lower), E [BH, NC, L, L] (zeros above the diagonal, as the split path stores them),
    W [BH, Tp, K], Cm = U₀ = E β v [BH, Tp, V] (what `_fwd_wy` stores under KDA), Qg, Kd
    [BH, Tp, K], eGl [BH, NC, K]. q, k: [B, T, H, K], v: [B, T, H, V], beta: [B, T, H] in the
    caller's layout; G float64 [BH, Tp, K]. BK: K-step of the pair loop; BKW, BV: K- and V-steps
    of W and U₀. L ∈ {16, 32, 64} (NB = 1, 2, 4 row blocks)."""
    NB: tl.constexpr = L // S
    n = tl.program_id(0)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    if seq < 0:
        return
    base = bh * NC + n
    for c0 in range(0, K, BK):
        kk = c0 + tl.arange(0, BK)
        tl.store(eGl + _row(bh, n, kk, NC, K), tl.exp(tl.load(G + _row(bh, t0 + nv - 1, kk, Tp, K)).to(tl.float32)))
    for i in tl.static_range(NB):
        _row_pass(q, k, beta, G, Aqk, Abk, Qg, Kd, base, bh, t0, nv, scale, Tp, T, H, i, K, L, S, BK, PREC, VARLEN)
    # N = A_bk read back block by block (L2): held from the passes, the 10 blocks spilled
    tl.debug_barrier()
    r = tl.arange(0, S)
    z = tl.zeros([S, S], dtype=tl.float32)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in tl.static_range(NB):
        for j in tl.static_range(i + 1, NB):
            _put(E, base, i * S, j * S, z, L, S)
    # the diagonal inverses: NB independent chains per step (latency, not width, bounds them)
    N00 = _get(Abk, base, 0, 0, L, S)
    D0, D1, D2, D3 = z, z, z, z
    if NB > 1:
        N11 = _get(Abk, base, S, S, L, S)
    if NB > 2:
        N22 = _get(Abk, base, 2 * S, 2 * S, L, S)
        N33 = _get(Abk, base, 3 * S, 3 * S, L, S)
    for i in range(1, S):
        sel = r[:, None] == i
        D0 = _subst(N00, D0, sel)
        if NB > 1:
            D1 = _subst(N11, D1, sel)
        if NB > 2:
            D2 = _subst(N22, D2, sel)
            D3 = _subst(N33, D3, sel)
    # the blocks below: E_ij = −E_ii Σ_{j ≤ m < i} N_im E_mj
    E00 = D0 + eye
    _put(E, base, 0, 0, E00, L, S)
    if NB > 1:
        E11 = D1 + eye
        E10 = -_dot(E11, _dot(_get(Abk, base, S, 0, L, S), E00, PREC), PREC)
        _put(E, base, S, S, E11, L, S)
        _put(E, base, S, 0, E10, L, S)
    if NB > 2:
        E22 = D2 + eye
        E33 = D3 + eye
        _put(E, base, 2 * S, 2 * S, E22, L, S)
        _put(E, base, 3 * S, 3 * S, E33, L, S)
        N21 = _get(Abk, base, 2 * S, S, L, S)
        E21 = -_dot(E22, _dot(N21, E11, PREC), PREC)
        _put(E, base, 2 * S, S, E21, L, S)
        E20 = -_dot(E22, _dot(_get(Abk, base, 2 * S, 0, L, S), E00, PREC) + _dot(N21, E10, PREC), PREC)
        _put(E, base, 2 * S, 0, E20, L, S)
        N32 = _get(Abk, base, 3 * S, 2 * S, L, S)
        N31 = _get(Abk, base, 3 * S, S, L, S)
        E32 = -_dot(E33, _dot(N32, E22, PREC), PREC)
        _put(E, base, 3 * S, 2 * S, E32, L, S)
        E31 = -_dot(E33, _dot(N31, E11, PREC) + _dot(N32, E21, PREC), PREC)
        _put(E, base, 3 * S, S, E31, L, S)
        P30 = _dot(_get(Abk, base, 3 * S, 0, L, S), E00, PREC) + _dot(N31, E10, PREC) + _dot(N32, E20, PREC)
        _put(E, base, 3 * S, 0, -_dot(E33, P30, PREC), L, S)
    # E back as one [L, L] tile: W and U₀ are then [L, L] × [L, ·] products, not NB² small ones
    tl.debug_barrier()
    Em = tl.load(E + _offs(base, 0, rows, rows, L, L))
    for k0 in range(0, K, BKW):
        kk = k0 + tl.arange(0, BKW)
        Gc = tl.load(G + _offs(bh, t0, _last(rows, nv, VARLEN), kk, Tp, K))
        Bg = _x_ld(k, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * tl.exp(Gc.to(tl.float32))
        Bg *= _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)[:, None]
        _st(W + _offs(bh, t0, rows, kk, Tp, K), tl.dot(Em, Bg, input_precision=PREC), m, VARLEN)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        vt = _x_ld(v, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        vt *= _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)[:, None]
        _st(Cm + _offs(bh, t0, rows, vv, Tp, V), tl.dot(Em, vt, input_precision=PREC), m, VARLEN)
