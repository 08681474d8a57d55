"""Phase 3 (forward) and phase 4 (first of the backward): the sequential passes over the chunks
that carry the state h = Sᵀ [K, V] (`_fwd_state`) and its gradient (`_bwd_state`), and their
PyTorch references."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _chunk_rows, _ld, _mm, _offs, _row, _seq_chunks, _st, _x_ld, _x_st


@triton.jit
def _state_start(h_in, sinfo, H, NC, HAS_IN: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 L: tl.constexpr, BV: tl.constexpr, VARLEN: tl.constexpr):
    """The program of a sequential state kernel (grid: V-tile, b·h or n·H + h, common.py
    `_seq_chunks`): (lay, sid, c0, c1, rows [L], kr [K], vv [BV], h) with h the [K, BV] float32
    tile of row sid of h_in [BH or N·H, K, V] (zeros without HAS_IN)."""
    lay, sid, c0, c1 = _seq_chunks(sinfo, H, NC, VARLEN)
    rows = tl.arange(0, L)
    kr = tl.arange(0, K)
    vv = tl.program_id(0) * BV + tl.arange(0, BV)
    if HAS_IN:
        h = tl.load(h_in + _offs(sid, 0, kr, vv, K, V)).to(tl.float32)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    return lay, sid, c0, c1, rows, kr, vv, h


@triton.jit
def _chunk_start(Hs, h, bh, n, tab, rows, kr, vv, Tp, NC, K: tl.constexpr, V: tl.constexpr,
                 L: tl.constexpr, VARLEN: tl.constexpr):
    """Stores h as chunk n's entry of Hs [BH, NC, K, V]; returns the offsets of the chunk's rows
    of the [BH, Tp, K] and [BH, Tp, V] operands and of its [L, L] pair matrix, and the mask of
    its valid rows [L, 1]."""
    tl.store(Hs + _offs(bh * NC + n, 0, kr, vv, K, V), h)
    _, t0, nv = _chunk_rows(tab, n, L, VARLEN)
    pk = _offs(bh, t0, rows, kr, Tp, K)
    pv = _offs(bh, t0, rows, vv, Tp, V)
    return pk, pv, _offs(bh * NC + n, 0, rows, rows, L, L), (rows < nv)[:, None]


@triton.jit
def _fwd_state(Qg, Kd, Ad, eGl, v, Aqk, Aqa, W, Cm, h0, Hs, V2, O, hT, Tp, NC, T, H,
               K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
               HAS_H0: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr, tab=None, sinfo=None,
               VARLEN: tl.constexpr = False, KDA: tl.constexpr = False):
    """Sequential over the chunks of one (b·h, V-tile): V2, O and the state h [K, BV].
    v, O: [B, T, H, V] (the caller's layout, common.py; T, H its sizes); Hs: [BH, NC, K, V] states
    entering each chunk; V2: [BH, Tp, V]; h0, hT: [BH, K, V].
    VARLEN (tab, sinfo: the chunk table): program n·H + h walks sequence n's chunks from
    row n·H + h of h0 [N·H, K, V] to that row of hT.
    KDA (kda.py): the two V-side operands merged, U = β v + V2 = Cm − W h (`_fwd_wy` stored
    β v + Cm in Cm) is what V2 receives, O = Qg h + A_qk U, h' = Diag(eGl) h + Kdᵀ U; v, Ad and
    A_qa are not read."""
    bh, sid, c0, c1, rows, kr, vv, h = _state_start(h0, sinfo, H, NC, HAS_H0, K, V, L, BV, VARLEN)
    for n in range(c0, c1):
        pk, pv, pa, m = _chunk_start(Hs, h, bh, n, tab, rows, kr, vv, Tp, NC, K, V, L, VARLEN)
        _, t0, nv = _chunk_rows(tab, n, L, VARLEN)
        if KDA:
            u = _ld(Cm + pv, m, VARLEN) - tl.dot(_ld(W + pk, m, VARLEN), h, input_precision=PREC)
            _st(V2 + pv, u, m, VARLEN)
            o = _mm(tl.load(Aqk + pa), u, LO, PREC)
            hn = tl.load(eGl + _row(bh, n, kr, NC, K))[:, None] * h
            hn += tl.dot(tl.trans(_ld(Kd + pk, m, VARLEN)), u, input_precision=PREC)
            o += _mm(_ld(Qg + pk, m, VARLEN), h, LO, PREC)
            _x_st(O, o, bh, t0, rows, vv, nv, T, H, V)
            h = hn
        else:
            vt = _x_ld(v, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
            v2 = _ld(Cm + pv, m, VARLEN) - tl.dot(_ld(W + pk, m, VARLEN), h, input_precision=PREC)
            _st(V2 + pv, v2, m, VARLEN)
            o = _mm(_ld(Qg + pk, m, VARLEN), h, LO, PREC)
            o += _mm(tl.load(Aqk + pa), vt, LO, PREC)
            o += _mm(tl.load(Aqa + pa), v2, LO, PREC)
            _x_st(O, o, bh, t0, rows, vv, nv, T, H, V)
            h = tl.load(eGl + _row(bh, n, kr, NC, K))[:, None] * h
            h += tl.dot(tl.trans(_ld(Kd + pk, m, VARLEN)), vt, input_precision=PREC)
            h += tl.dot(tl.trans(_ld(Ad + pk, m, VARLEN)), v2, input_precision=PREC)
    tl.store(hT + _offs(sid, 0, kr, vv, K, V), h)


@triton.jit
def _bwd_state(Qg, Ad, eGl, Aqa, W, dO, dhT, dH, dV2, dh0, Tp, NC, T, H,
               K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
               HAS_DHT: tl.constexpr, PREC: tl.constexpr, tab=None, sinfo=None,
               VARLEN: tl.constexpr = False):
    """Reverse-sequential over the chunks of one (b·h, V-tile), as in ../chunkwise.py:
        δV2 = (A ⊙ e^{G_L−G}) δh' + A_qaᵀ δO,   δh = Diag(γ_L) δh' + Q←ᵀ δO − Wᵀ δV2.
    dO: [B, T, H, V] (the caller's layout, common.py; T, H its sizes); dH: [BH, NC, K, V] δ of the
    state leaving each chunk; dV2: [BH, Tp, V]; dhT, dh0: [BH, K, V].
    VARLEN: as `_fwd_state`, sequence n's chunks in reverse from row n·H + h of dhT [N·H, K, V]."""
    bh, sid, c0, c1, rows, kr, vv, dh = _state_start(dhT, sinfo, H, NC, HAS_DHT, K, V, L, BV, VARLEN)
    for i in range(c0, c1):
        n = c0 + c1 - 1 - i
        pk, pv, pa, m = _chunk_start(dH, dh, bh, n, tab, rows, kr, vv, Tp, NC, K, V, L, VARLEN)
        _, t0, nv = _chunk_rows(tab, n, L, VARLEN)
        do = _x_ld(dO, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        dv2 = tl.dot(_ld(Ad + pk, m, VARLEN), dh, input_precision=PREC)
        dv2 += tl.dot(tl.trans(tl.load(Aqa + pa)), do, input_precision=PREC)
        _st(dV2 + pv, dv2, m, VARLEN)
        dh = tl.load(eGl + _row(bh, n, kr, NC, K))[:, None] * dh
        dh += tl.dot(tl.trans(_ld(Qg + pk, m, VARLEN)), do, input_precision=PREC)
        dh -= tl.dot(tl.trans(_ld(W + pk, m, VARLEN)), dv2, input_precision=PREC)
    tl.store(dh0 + _offs(sid, 0, kr, vv, K, V), dh)


def _chunks(x, L):
    """[BH, Tp, D] → float64 [BH, NC, L, D]."""
    BH, Tp, D = x.shape
    return x.double().view(BH, Tp // L, L, D)


def state_reference(Qg, Kd, Ad, eGl, v, Aqk, Aqa, W, Cm, h0, L: int):
    """`_fwd_state` in float64, chunk by chunk: V2 = Cm − W h, O = Qg h + A_qk V + A_qa V2,
    h' = Diag(eGl) h + Kdᵀ V + Adᵀ V2. Operands as `_fwd_wy` and `_fwd_pairs` leave them
    ([BH, Tp, ·], [BH, NC, L, L], eGl [BH, NC, K]); h0: [BH, K, V] or None.
    Returns a dict of Hs [BH, NC, K, V] (states entering each chunk), V2, O [BH, Tp, V], hT."""
    Qg, Kd, Ad, v, W, Cm = (_chunks(x, L) for x in (Qg, Kd, Ad, v, W, Cm))
    BH, NC, _, K = Qg.shape
    h = Qg.new_zeros(BH, K, v.shape[-1]) if h0 is None else h0.double()
    Hs, V2, O = [], [], []
    for n in range(NC):
        Hs.append(h)
        v2 = Cm[:, n] - W[:, n] @ h
        O.append(Qg[:, n] @ h + Aqk[:, n].double() @ v[:, n] + Aqa[:, n].double() @ v2)
        V2.append(v2)
        h = eGl[:, n, :, None].double() * h + Kd[:, n].mT @ v[:, n] + Ad[:, n].mT @ v2
    cat = lambda xs: torch.cat(xs, 1)  # noqa: E731
    return dict(Hs=torch.stack(Hs, 1), V2=cat(V2), O=cat(O), hT=h)


def bwd_state_reference(Qg, Ad, eGl, Aqa, W, dO, dhT, L: int):
    """`_bwd_state` in float64, chunks in reverse: δV2 = Ad δh' + A_qaᵀ δO,
    δh = Diag(eGl) δh' + Qgᵀ δO − Wᵀ δV2. dO: [BH, Tp, V]; dhT: [BH, K, V] or None.
    Returns a dict of dH [BH, NC, K, V] (δ of each chunk's leaving state), dV2 [BH, Tp, V], dh0."""
    Qg, Ad, W, dO = (_chunks(x, L) for x in (Qg, Ad, W, dO))
    BH, NC, _, K = Qg.shape
    dh = Qg.new_zeros(BH, K, dO.shape[-1]) if dhT is None else dhT.double()
    dH, dV2 = [None] * NC, [None] * NC
    for n in reversed(range(NC)):
        dH[n] = dh
        dv2 = Ad[:, n] @ dh + Aqa[:, n].double().mT @ dO[:, n]
        dV2[n] = dv2
        dh = eGl[:, n, :, None].double() * dh + Qg[:, n].mT @ dO[:, n] - W[:, n].mT @ dv2
    return dict(dH=torch.stack(dH, 1), dV2=torch.cat(dV2, 1), dh0=dh)
