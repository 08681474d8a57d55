"""Phase 1 of the forward: the in-chunk cumulative gates G (`_fwd_gamma`), the four pair
matrices of every chunk (`_fwd_pairs`), and their PyTorch reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _chunk_rows, _last, _mm, _offs, _pair_block, _ref_factors, _st, _x_ld, _zeros4


@triton.jit
def _fwd_gamma(gk, G, tab, T, H, Tp, K: tl.constexpr, L: tl.constexpr, BK: tl.constexpr,
               VARLEN: tl.constexpr = False):
    """G = the inclusive cumsum of gk over each chunk (of the varlen table with VARLEN, common.py)
    in float64, for BK channels of one (chunk, b·h). gk: [B, T, H, K] contiguous, read in place
    in its own dtype; G: [B·H, Tp, K] float64. The steps ≥ T of a padded last chunk add 0 (G
    constant there: identity transitions); with VARLEN rows past a sequence's end are not stored."""
    bh = tl.program_id(1).to(tl.int64)
    seq, t0, nv = _chunk_rows(tab, tl.program_id(0), L, VARLEN)
    if seq < 0:
        return
    rows = tl.arange(0, L)
    kk = tl.program_id(2) * BK + tl.arange(0, BK)
    x = _x_ld(gk, bh, t0, rows, kk, nv, T, H, K)
    _st(G + _offs(bh, t0, rows, kk, Tp, K), tl.cumsum(x.to(tl.float64), axis=0), (rows < nv)[:, None], VARLEN)


@triton.jit
def _fwd_pairs(q, k, a, b, G, Aqk, Aqa, Abk, Aba, scale, Tp, NC, T, H,
               K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, LO: tl.constexpr, tab=None, VARLEN: tl.constexpr = False):
    """One [L, S] column block (sub-chunk j) of A_qk, A_qa, A_bk, A_ba of one chunk.
    q, k, a, b: [B, T, H, K] (the caller's layout and dtype, common.py); G: [BH, Tp, K] float64;
    A*: [BH, NC, L, L] float32; tab: the varlen chunk table with VARLEN (common.py)."""
    n, j0, bh, seq, t0, nv, rows, cols, _, _, below, inblk = _pair_block(tab, L, S, VARLEN)
    if seq < 0:
        return
    acc_qk, acc_qa, acc_bk, acc_ba = _zeros4(L, S)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        py = _offs(bh, t0 + j0, cols, kk, Tp, K)                # [S, BK]
        Gx = tl.load(G + _offs(bh, t0, _last(rows, nv, VARLEN), kk, Tp, K))
        fx_off, fx_in, fy_off, fy_in = _ref_factors(G, Gx, py, bh, t0, j0, kk, below, inblk, nv, Tp, K, S,
                                                    VARLEN)
        xq = _x_ld(q, bh, t0, rows, kk, nv, T, H, K).to(tl.float32) * scale
        xb = _x_ld(b, bh, t0, rows, kk, nv, T, H, K).to(tl.float32)
        yk = _x_ld(k, bh, t0 + j0, cols, kk, nv - j0, T, H, K).to(tl.float32)
        ya = _x_ld(a, bh, t0 + j0, cols, kk, nv - j0, T, H, K).to(tl.float32)
        yk_off = tl.trans(yk * fy_off)
        yk_in = tl.trans(yk * fy_in)
        ya_off = tl.trans(ya * fy_off)
        ya_in = tl.trans(ya * fy_in)
        xq_off = xq * fx_off
        xq_in = xq * fx_in
        xb_off = xb * fx_off
        xb_in = xb * fx_in
        acc_qk += _mm(xq_off, yk_off, LO, PREC) + _mm(xq_in, yk_in, LO, PREC)
        acc_qa += tl.dot(xq_off, ya_off, input_precision=PREC) + tl.dot(xq_in, ya_in, input_precision=PREC)
        acc_bk += tl.dot(xb_off, yk_off, input_precision=PREC) + tl.dot(xb_in, yk_in, input_precision=PREC)
        acc_ba += tl.dot(xb_off, ya_off, input_precision=PREC) + tl.dot(xb_in, ya_in, input_precision=PREC)
    ci = j0 + cols
    incl = ci[None, :] <= rows[:, None]
    strict = ci[None, :] < rows[:, None]
    pa = _offs(bh * NC + n, 0, rows, ci, L, L)
    tl.store(Aqk + pa, tl.where(incl, acc_qk, 0.0))
    tl.store(Aqa + pa, tl.where(incl, acc_qa, 0.0))
    tl.store(Abk + pa, tl.where(strict, acc_bk, 0.0))
    tl.store(Aba + pa, tl.where(strict, acc_ba, 0.0))


def pairs_reference(q, k, a, b, G, scale: float, L: int):
    """A_xy[r, i] = Σ_k x_r[k] y_i[k] e^{G_r[k] − G_i[k]} of every chunk, straight from the
    definition in float64: (A_qk, A_qa) for i ≤ r with x = scale·q, (A_bk, A_ba) for i < r with
    x = b. q, k, a, b: [BH, Tp, K]; G: [BH, Tp, K] in-chunk cumulative log gates.
    Returns four [BH, NC, L, L] float64 tensors."""
    BH, Tp, K = q.shape
    f = lambda x: x.double().view(BH, Tp // L, L, K)  # noqa: E731
    Gc = f(G)
    decay = Gc.unsqueeze(-2) - Gc.unsqueeze(-3)                           # [BH, NC, r, i, K]
    keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    # masked before the exp: above the diagonal the exponent is positive and may overflow
    decay = decay.masked_fill(~keep[..., None], float("-inf")).exp()
    pair = lambda x, y: torch.einsum("bnrk,bnik,bnrik->bnri", x, y, decay)  # noqa: E731
    qs, kc, ac, bc = f(q) * scale, f(k), f(a), f(b)
    strict = torch.ones(L, L, dtype=torch.bool, device=q.device).tril(-1)
    return pair(qs, kc), pair(qs, ac), pair(bc, kc) * strict, pair(bc, ac) * strict
