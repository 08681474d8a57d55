"""Phase 2 of the forward: the WY factors of every chunk and the decayed operands of the state
kernels (`_fwd_wy`), and their PyTorch reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _chunk_prog, _finite_g, _g_fallback, _last, _offs, _row, _st, _x_ld, _x_ld1


@triton.jit
def _fwd_wy(q, k, a, b, v, G, Abk, Aba, E, W, Cm, Qg, Kd, Ad, eGl, scale, Tp, NC, T, H,
            K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, PREC: tl.constexpr, tab=None, VARLEN: tl.constexpr = False,
            beta=None, KDA: tl.constexpr = False):
    """E = (I + A_ba)⁻¹, W = E B←, Cm = −E (A_bk V) for one chunk, and the decayed operands of
    the sequential kernels (so those load no float64): Qg = scale·q ⊙ e^G, Kd = k ⊙ e^{G_L−G},
    Ad = a ⊙ e^{G_L−G} [BH, Tp, K], eGl = e^{G_L} [BH, NC, K].
    q, k, a, b: [B, T, H, K], v: [B, T, H, V] in the caller's layout (common.py, `_x_ld`; T, H its
    sizes); G float64; Abk, Aba, E: [BH, NC, L, L]; W: [BH, Tp, K]; Cm: [BH, Tp, V] (float32);
    tab: the varlen chunk table with VARLEN (common.py).
    KDA (kda.py): a and b are k, beta [B, T, H] scales b and v at load (b = β k, v ← β v), Ad
    (= Kd) is not stored, and Cm receives β v + Cm (the state pass's U = β v + V2 is then
    Cm − W h: `_fwd_state` reads neither v nor β)."""
    n = tl.program_id(0)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    if seq < 0:
        return
    pa = _offs(bh * NC + n, 0, rows, rows, L, L)
    Nm = tl.load(Aba + pa)                                   # strictly lower part of F
    # E = F⁻¹ in two stages (F = I + N, N strictly lower):
    # 1. the S×S diagonal blocks, all at once, by forward substitution row by row for D = E_d − I:
    #    D_i = −N_i − Σ_{j<i} N_ij D_j. Step i treats row i of every block together: their
    #    nonzeros sit in disjoint column blocks, so one full-width sum serves all of them and the
    #    block mask puts each part back in its own row. Rows not yet formed are still 0 and
    #    N_ij = 0 for j ≥ i, so the sums are exact. S − 1 steps instead of L − 1.
    # 2. block forward substitution with matrix products: E_R = E_d,RR (e_R − Σ_{M<R} N_RM E_M).
    same = (rows[:, None] // S) == (rows[None, :] // S)
    Nd = tl.where(same, Nm, 0.0)
    D = tl.zeros([L, L], dtype=tl.float32)
    for i in range(1, S):
        sel = (rows[:, None] % S) == i
        r = -tl.sum(tl.where(sel, Nd, 0.0), axis=0)          # −N_i of every block   [L]
        r = r + tl.sum(r[:, None] * D, axis=0)                 # −N_i − Σ_j N_ij D_j
        D = tl.where(sel & same, r[None, :], D)
    Ed = D + tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    No = Nm - Nd                                              # strictly block-lower part
    Em = Ed
    for rb in range(1, L // S):
        X = tl.dot(tl.where((rows[:, None] // S) == rb, No, 0.0), Em, input_precision=PREC)
        Em = Em - tl.dot(Ed, X, input_precision=PREC)
    tl.store(E + pa, Em)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        pk = _offs(bh, t0, rows, kk, Tp, K)
        Gc = tl.load(G + _offs(bh, t0, _last(rows, nv, VARLEN), kk, Tp, K))
        g_last = tl.load(G + _row(bh, t0 + nv - 1, kk, Tp, K))
        eG = tl.exp(Gc.to(tl.float32))
        dec = tl.exp((g_last[None, :] - Gc).to(tl.float32))
        # W = E B← is a product over the chunk's steps: B← takes G without its NaNs (common.py)
        eGs = _finite_g(eG, tl.exp(_g_fallback(Gc).to(tl.float32))[None, :])
        Bg = _x_ld(b, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * eGs
        if KDA:     # β loaded where it is used: held across the loops it spills (ptxas)
            Bg *= _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)[:, None]
        _st(W + pk, tl.dot(Em, Bg, input_precision=PREC), m, VARLEN)
        _st(Qg + pk, _x_ld(q, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * (eG * scale),
            m, VARLEN)
        _st(Kd + pk, _x_ld(k, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * dec, m, VARLEN)
        if not KDA:
            _st(Ad + pk, _x_ld(a, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * dec,
                m, VARLEN)
        tl.store(eGl + _row(bh, n, kk, NC, K), tl.exp(g_last.to(tl.float32)))
    Ab = tl.load(Abk + pa)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = _offs(bh, t0, rows, vv, Tp, V)
        vt = _x_ld(v, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        if KDA:
            vt *= _x_ld1(beta, bh, t0, rows, nv, T, H).to(tl.float32)[:, None]
            P = tl.dot(Ab, vt, input_precision=PREC)
            _st(Cm + pv, vt - tl.dot(Em, P, input_precision=PREC), m, VARLEN)
        else:
            P = tl.dot(Ab, vt, input_precision=PREC)
            _st(Cm + pv, -tl.dot(Em, P, input_precision=PREC), m, VARLEN)


def wy_reference(q, k, a, b, v, G, Abk, Aba, scale: float, L: int):
    """The WY factors and decayed operands `_fwd_wy` stores, in float64 with a dense inverse:
    E = (I + A_ba)⁻¹, W = E (b ⊙ e^G), Cm = −E (A_bk V), Qg = scale·q ⊙ e^G,
    Kd = k ⊙ e^{G_L−G}, Ad = a ⊙ e^{G_L−G}, eGl = e^{G_L}.
    q, k, a, b, G: [BH, Tp, K]; v: [BH, Tp, V]; Abk, Aba: [BH, NC, L, L].
    Returns a dict of E [BH, NC, L, L], W, Qg, Kd, Ad [BH, Tp, K], Cm [BH, Tp, V], eGl [BH, NC, K]."""
    BH, Tp, K = q.shape
    NC = Tp // L
    f = lambda x: x.double().view(BH, NC, L, x.shape[-1])  # noqa: E731
    Gc = f(G)
    Gl = Gc[:, :, -1:]
    E = torch.linalg.inv(torch.eye(L, dtype=torch.float64, device=q.device) + Aba.double())
    flat = lambda x: x.reshape(BH, Tp, x.shape[-1])  # noqa: E731
    return dict(E=E, W=flat(E @ (f(b) * Gc.exp())), Cm=flat(-(E @ (Abk.double() @ f(v)))),
                Qg=flat(f(q) * scale * Gc.exp()), Kd=flat(f(k) * (Gl - Gc).exp()),
                Ad=flat(f(a) * (Gl - Gc).exp()), eGl=Gl.squeeze(2).exp())
