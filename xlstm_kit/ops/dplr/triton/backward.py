"""Phase 5 (the chunk-parallel part of the backward): `_bwd_dv` (V side: δv, GC and the
pair-matrix gradients), and the PyTorch references of the backward phases (the K side's
kernels are in dplr_dk.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _chunk_prog, _ld, _mm, _offs, _row, _st, _x_ld, _x_st, _zeros4
from .pairs import pairs_reference


@triton.jit
def _bwd_dv(Kd, v, Aqk, Abk, E, V2, dO, dH, dV2, GCb, dAqk, dAqa, dAbk, dAba, dv, dqk_d, dqa_d,
            Tp, NC, T, H, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr, LV: tl.constexpr,
            LG: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """Backward, V side of one chunk: δv, GC = Eᵀ δC, and the gradients of the four pair matrices
    (strictly lower parts to dA* [BH, NC, L, L]; the diagonals of δA_qk, δA_qa to dqk_d, dqa_d
    [BH, Tp]). With δW = −δC hᵀ (h entering the chunk), Eᵀ δW = −GC hᵀ and W h = Cm − V2, so
    δF = −(Eᵀ δW Wᵀ + GC Cmᵀ) collapses to δA_ba = −GC V2ᵀ: no K-sized product is needed here.
    `_mm` modes (config.py, LOWP_GROUPS): LO the pair-matrix gradients (they reach only the dk
    group), LV the δv products, LG the product GC (it reaches both).
    v, dO, dv: [B, T, H, V] (the caller's layout, common.py; T, H its sizes); the rest scratch.
    tab: the varlen chunk table with VARLEN (common.py)."""
    n = tl.program_id(0)
    bh, seq, t0, nv, rows, m1, m = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    if seq < 0:
        return
    pa = _offs(bh * NC + n, 0, rows, rows, L, L)
    Aqk_ = tl.load(Aqk + pa)
    Abk_ = tl.load(Abk + pa)
    Em = tl.load(E + pa)
    dA_qk, dA_qa, dA_bk, dA_ba = _zeros4(L, L)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = _offs(bh, t0, rows, vv, Tp, V)
        do = _x_ld(dO, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        vt = _x_ld(v, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        v2 = _ld(V2 + pv, m, VARLEN)
        GC = _mm(tl.trans(Em), _ld(dV2 + pv, m, VARLEN), LG, PREC)   # Eᵀ δC
        _st(GCb + pv, GC, m, VARLEN)
        dvt = _mm(tl.trans(Aqk_), do, LV, PREC)
        dvt -= _mm(tl.trans(Abk_), GC, LV, PREC)
        for k0 in range(0, K, BK):                                # + (K ⊙ e^{G_L−G}) δh'
            kk = k0 + tl.arange(0, BK)
            dh = tl.load(dH + _offs(bh * NC + n, 0, kk, vv, K, V))
            dvt += _mm(_ld(Kd + _offs(bh, t0, rows, kk, Tp, K), m, VARLEN), dh, LV, PREC)
        _x_st(dv, dvt, bh, t0, rows, vv, nv, T, H, V)
        dA_qk += _mm(do, tl.trans(vt), LO, PREC)
        dA_qa += _mm(do, tl.trans(v2), LO, PREC)
        dA_bk -= _mm(GC, tl.trans(vt), LO, PREC)
        dA_ba -= _mm(GC, tl.trans(v2), LO, PREC)
    eye = rows[:, None] == rows[None, :]
    strict = rows[None, :] < rows[:, None]
    # the diagonal (i = r) of A_qk, A_qa has no decay: it goes straight into δq, δk, δa and stays
    # out of the gate gradient (where it would only cancel)
    _st(dqk_d + _row(bh, t0, rows, Tp, 1), tl.sum(tl.where(eye, dA_qk, 0.0), axis=1), m1, VARLEN)
    _st(dqa_d + _row(bh, t0, rows, Tp, 1), tl.sum(tl.where(eye, dA_qa, 0.0), axis=1), m1, VARLEN)
    tl.store(dAqk + pa, tl.where(strict, dA_qk, 0.0))
    tl.store(dAqa + pa, tl.where(strict, dA_qa, 0.0))
    tl.store(dAbk + pa, tl.where(strict, dA_bk, 0.0))
    tl.store(dAba + pa, tl.where(strict, dA_ba, 0.0))


def bwd_dv_reference(Kd, v, Aqk, Abk, E, V2, dO, dH, dV2, L: int):
    """`_bwd_dv` in float64: GC = Eᵀ δV2, δv = A_qkᵀ δO − A_bkᵀ GC + Kd δh', and the pair-matrix
    gradients δA_qk = δO Vᵀ, δA_qa = δO V2ᵀ, δA_bk = −GC Vᵀ, δA_ba = −GC V2ᵀ (strictly lower
    parts; the diagonals of δA_qk, δA_qa separately). Shapes as the kernel's arguments.
    Returns a dict of GC, dv [BH, Tp, V], dAqk, dAqa, dAbk, dAba [BH, NC, L, L], dqk_d, dqa_d [BH, Tp]."""
    BH, Tp, V = v.shape
    c = lambda x: x.double().view(BH, Tp // L, L, x.shape[-1])  # noqa: E731
    Kd, v, V2, dO, dV2 = (c(x) for x in (Kd, v, V2, dO, dV2))
    Aqk, Abk, E = (x.double() for x in (Aqk, Abk, E))
    GC = E.mT @ dV2
    dv = Aqk.mT @ dO - Abk.mT @ GC + Kd @ dH.double()
    dqk, dqa = dO @ v.mT, dO @ V2.mT
    strict = lambda x: x.tril(-1)  # noqa: E731
    diag = lambda x: x.diagonal(dim1=-2, dim2=-1).reshape(BH, Tp)  # noqa: E731
    flat = lambda x: x.reshape(BH, Tp, x.shape[-1])  # noqa: E731
    return dict(GC=flat(GC), dv=flat(dv), dAqk=strict(dqk), dAqa=strict(dqa),
                dAbk=strict(-GC @ v.mT), dAba=strict(-GC @ V2.mT), dqk_d=diag(dqk), dqa_d=diag(dqa))


def chunk_operands_reference(q, k, a, b, gk, scale: float, L: int):
    """Everything the forward builds from q, k, a, b and the gates, in float64 and differentiable:
    the pair matrices (with their diagonals), Qg = scale·q ⊙ e^G, Bg = b ⊙ e^G (B← of docs/design.md),
    Kd = k ⊙ e^{G_L−G}, Ad = a ⊙ e^{G_L−G} ([BH, NC, L, K]) and eGl = e^{G_L} [BH, NC, K].
    q, k, a, b, gk: [BH, Tp, K] (gk the per-step log gates, not cumulated)."""
    BH, Tp, K = q.shape
    G = gk.view(BH, Tp // L, L, K).cumsum(2).view(BH, Tp, K)
    Aqk, Aqa, Abk, Aba = pairs_reference(q, k, a, b, G, scale, L)
    c = lambda x: x.view(BH, Tp // L, L, K)  # noqa: E731
    Gc = c(G)
    Gl = Gc[:, :, -1:]
    return dict(Aqk=Aqk, Aqa=Aqa, Abk=Abk, Aba=Aba, Qg=c(q) * scale * Gc.exp(), Bg=c(b) * Gc.exp(),
                Kd=c(k) * (Gl - Gc).exp(), Ad=c(a) * (Gl - Gc).exp(), eGl=Gl.squeeze(2).exp())


def bwd_dk_reference(q, k, v, a, b, gk, V2, Hs, dO, dH, GC, dA, dqk_d, dqa_d, scale: float, L: int):
    """The key gradient (dplr_dk.py) as a vector-Jacobian product of `chunk_operands_reference` (float64 autograd):
    the cotangents are the pair-matrix gradients of `_bwd_dv` (dA: dAqk, dAqa, dAbk, dAba, plus
    the diagonals dqk_d, dqa_d) and, per chunk with h entering and δh' leaving it, δQg = δO hᵀ,
    δKd = V δh'ᵀ, δAd = V2 δh'ᵀ, δBg = −GC hᵀ, δeGl = diag(h δh'ᵀ).
    Returns (dq, dk, da, db, dgk), each [BH, Tp, K] float64."""
    BH, Tp, K = q.shape
    xs = [x.detach().double().requires_grad_() for x in (q, k, a, b, gk)]
    ops = chunk_operands_reference(*xs, scale, L)
    c = lambda x: x.double().view(BH, Tp // L, L, x.shape[-1])  # noqa: E731
    Hs, dH = Hs.double(), dH.double()
    eye = lambda d: torch.diag_embed(d.double().view(BH, Tp // L, L))  # noqa: E731
    cot = dict(Aqk=dA[0].double() + eye(dqk_d), Aqa=dA[1].double() + eye(dqa_d),
               Abk=dA[2].double(), Aba=dA[3].double(), Qg=c(dO) @ Hs.mT, Bg=-c(GC) @ Hs.mT,
               Kd=c(v) @ dH.mT, Ad=c(V2) @ dH.mT, eGl=(Hs * dH).sum(-1))
    grads = torch.autograd.grad([ops[n] for n in cot], xs, [cot[n] for n in cot])
    return tuple(g.reshape(BH, Tp, K) for g in grads)
