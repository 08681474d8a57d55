"""Forward output: h of every chunk from its intra-chunk quadratic part and the inter-chunk
term q̂ᵀC_c, plus the per-row n̄ and m the backward needs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _NEG, _dot_l, _dot_r, _load_rows, _row_base, _seq_base, _span, _sub_program, _sub_rows


@triton.jit
def _fwd_out(
    q_ptr, k_ptr, v_ptr, beta_ptr, blo_ptr, ig_ptr, u_ptr, cs_ptr, ns_ptr, ms_ptr,
    h_ptr, hlo_ptr, nbar_ptr, mrow_ptr, tab_ptr,
    T, H, NC, NS, scale, eps, stride_q, stride_k, stride_v,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STATE_MODE: tl.constexpr, PREC: tl.constexpr, P_SPLIT: tl.constexpr, H_LO: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Outputs of one sub-tile i (R rows) of one chunk for one V-tile: the inter-chunk term
    q̂ᵀC_c plus the intra-chunk quadratic part, its own R x R diagonal block first, then the
    key sub-tiles j < i one R x R block at a time (so a long chunk never holds an L x L tile).
    P_SPLIT: P enters P v as two 16-bit parts (hi + lo); H_LO: also writes h's rounding
    residual (float32 h − h) in h's dtype, so the backward's δh·h sees float32 h. Both terms
    enter near-cancelling sums of the backward (δP = δh·(v_s − h_t)/d). VARLEN: chunks from
    the varlen table (_sub_program); spare chunks write zero n̄ and m (defined outputs) and
    return."""
    c, i, bh, bh64, g_base, row0, end, seq = _sub_program(0, T, NC, tab_ptr, L, R, 2, VARLEN)
    offs_i, rmask, prow = _sub_rows(c, i, row0, end, L, R)
    pid_v = tl.program_id(1)
    if VARLEN:
        if seq < 0:
            zero = tl.zeros([R], dtype=tl.float32)
            tl.store(nbar_ptr + g_base + prow, zero, mask=(offs_i < L) & (pid_v == 0))
            tl.store(mrow_ptr + g_base + prow, zero, mask=(offs_i < L) & (pid_v == 0))
            return
    offs_v, mv = _span(pid_v, BV, V)
    # 64-bit bases at the chunk's first row, 32-bit offsets within it (packed inputs are long)
    q_base = q_ptr + _row_base(bh, row0, T, H, K, stride_q)
    k_base = k_ptr + _row_base(bh, row0, T, H, K, stride_k)
    v_base = v_ptr + _row_base(bh, row0, T, H, V, stride_v)
    beta = tl.load(beta_ptr + g_base + prow)
    blo = tl.load(blo_ptr + g_base + prow)
    ig = tl.load(ig_ptr + g_base + prow)
    u = tl.load(u_ptr + g_base + prow)
    m_prev = tl.load(ms_ptr + bh64 * (NC + NS) + seq + c)
    m_row = tl.maximum(beta + m_prev, u)

    S = tl.zeros([R, R], dtype=tl.float32)
    inter = tl.zeros([R, BV], dtype=tl.float32)
    qn = tl.zeros([R], dtype=tl.float32)
    for kt in range((K + BK - 1) // BK):
        offs_k, mk = _span(kt, BK, K)
        qt = _load_rows(q_base, offs_i, rmask, offs_k, mk, stride_q)
        kk = _load_rows(k_base, offs_i, rmask, offs_k, mk, stride_k)
        S += tl.dot(qt, tl.trans(kk), input_precision=PREC)
        Ct = tl.load(cs_ptr + (bh64 * NC + c) * K * V + offs_k[:, None] * V + offs_v[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)              # [BK, BV]
        inter += _dot_r(qt, Ct, STATE_MODE, PREC)
        nt = tl.load(ns_ptr + (bh64 * NC + c) * K + offs_k, mask=mk, other=0.0)
        qn += tl.sum(qt.to(tl.float32) * nt[None, :], axis=1)

    causal = offs_i[:, None] >= offs_i[None, :]
    D = (beta[:, None] - beta[None, :]) + (blo[:, None] - blo[None, :]) + ig[None, :] - m_row[:, None]
    P = S * scale * tl.exp(tl.where(causal, D, _NEG))                        # [R, R]
    rowsum = tl.sum(P, axis=1)
    vt = _load_rows(v_base, offs_i, rmask, offs_v, mv, stride_v)
    pv = _pv(P, vt, P_SPLIT, PREC)
    for j in range(0, i):  # key sub-tiles before this one: every entry is causal
        offs_j, mj, prow_j = _sub_rows(c, j, row0, end, L, R)
        S = tl.zeros([R, R], dtype=tl.float32)
        for kt in range((K + BK - 1) // BK):
            offs_k, mk = _span(kt, BK, K)
            qt = _load_rows(q_base, offs_i, rmask, offs_k, mk, stride_q)
            kk = _load_rows(k_base, offs_j, mj, offs_k, mk, stride_k)
            S += tl.dot(qt, tl.trans(kk), input_precision=PREC)
        beta_j = tl.load(beta_ptr + g_base + prow_j)
        blo_j = tl.load(blo_ptr + g_base + prow_j)
        ig_j = tl.load(ig_ptr + g_base + prow_j)
        D = (beta[:, None] - beta_j[None, :]) + (blo[:, None] - blo_j[None, :]) + ig_j[None, :] - m_row[:, None]
        P = S * scale * tl.exp(D)
        rowsum += tl.sum(P, axis=1)
        pv += _pv(P, _load_rows(v_base, offs_j, mj, offs_v, mv, stride_v), P_SPLIT, PREC)
    ea = tl.exp(beta + m_prev - m_row)
    nbar = ea * qn * scale + rowsum
    num = (ea * scale)[:, None] * inter + pv
    den = tl.maximum(tl.abs(nbar), tl.exp(-m_row)) + eps
    out = num / den[:, None]
    h_off = _seq_base(bh, row0, T, H, V) + offs_i[:, None] * (H * V) + offs_v[None, :]
    out_h = out.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + h_off, out_h, mask=rmask[:, None] & mv[None, :])
    if H_LO:
        tl.store(hlo_ptr + h_off, (out - out_h.to(tl.float32)).to(hlo_ptr.dtype.element_ty),
                 mask=rmask[:, None] & mv[None, :])
    first_v = (offs_i < L) & (pid_v == 0)
    tl.store(nbar_ptr + g_base + prow, nbar, mask=first_v)
    tl.store(mrow_ptr + g_base + prow, m_row, mask=first_v)


@triton.jit
def _pv(P, vt, P_SPLIT: tl.constexpr, PREC: tl.constexpr):
    """P (float32) @ v: P in two 16-bit parts with P_SPLIT, else rounded to v's dtype."""
    if P_SPLIT:
        return _dot_l(P, vt, 1, PREC)
    return tl.dot(P.to(vt.dtype), vt, input_precision=PREC)


def fwd_out(q, k, v, beta, blo, ig, u, cs, ns, ms, h, hlo, nbar, mrow, eps, cfg, smode, prec, vl=None):
    """Launch _fwd_out: fills h [B,T,H,V], hlo (h's rounding residual; empty for float32
    inputs), nbar and mrow [B,H,NC·L] float32; vl the varlen.ChunkTable or None. q, k, v
    [B,T,H,*] with heads packed and evenly spaced rows (op._rows)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = cs.shape[2]
    lowp = q.dtype != torch.float32
    BV = cfg.out_bv
    _fwd_out[(NC * (cfg.chunk // cfg.rows), triton.cdiv(V, BV), B * H)](
        q, k, v, beta, blo, ig, u, cs, ns, ms, h, hlo if lowp else h, nbar, mrow, ms if vl is None else vl.tab,
        T, H, NC, 1 if vl is None else vl.n, K ** -0.5, eps, q.stride(1), k.stride(1), v.stride(1),
        K=K, V=V, L=cfg.chunk, R=cfg.rows, BK=cfg.out_bk, BV=BV,
        STATE_MODE=smode, PREC=prec, P_SPLIT=lowp, H_LO=lowp, VARLEN=vl is not None,
        num_warps=cfg.out_warps, num_stages=cfg.out_stages,
    )
