"""Forward output: h of every chunk from its intra-chunk quadratic part and the inter-chunk
term q̂ᵀC_c, plus the per-row n̄ and m the backward needs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _NEG, _chunk_program, _dot_l, _dot_r, _load_rows, _row_base, _seq_base, _span


@triton.jit
def _fwd_out(
    q_ptr, k_ptr, v_ptr, beta_ptr, blo_ptr, ig_ptr, u_ptr, cs_ptr, ns_ptr, ms_ptr,
    h_ptr, hlo_ptr, nbar_ptr, mrow_ptr, tab_ptr,
    T, H, NC, NS, scale, eps, stride_q, stride_k, stride_v,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STATE_MODE: tl.constexpr, PREC: tl.constexpr, P_SPLIT: tl.constexpr, H_LO: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Outputs of one chunk for one V-tile: intra-chunk quadratic part + inter-chunk q̂ᵀC_c.
    P_SPLIT: P enters P v as two 16-bit parts (hi + lo); H_LO: also writes h's rounding
    residual (float32 h − h) in h's dtype, so the backward's δh·h sees float32 h. Both terms
    enter near-cancelling sums of the backward (δP = δh·(v_s − h_t)/d). VARLEN: chunks from
    the varlen table (_chunk_program); spare chunks write zero n̄ and m (defined outputs) and
    return."""
    c, bh, bh64, offs_l, rows, rmask, g_base, prow, row0, seq = _chunk_program(0, T, NC, tab_ptr, L, 2, VARLEN)
    pid_v = tl.program_id(1)
    if VARLEN:
        if seq < 0:
            zero = tl.zeros([L], dtype=tl.float32)
            tl.store(nbar_ptr + g_base + prow, zero, mask=(offs_l < L) & (pid_v == 0))
            tl.store(mrow_ptr + g_base + prow, zero, mask=(offs_l < L) & (pid_v == 0))
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

    S = tl.zeros([L, L], dtype=tl.float32)
    inter = tl.zeros([L, BV], dtype=tl.float32)
    qn = tl.zeros([L], dtype=tl.float32)
    for kt in range((K + BK - 1) // BK):
        offs_k, mk = _span(kt, BK, K)
        qt = _load_rows(q_base, offs_l, rmask, offs_k, mk, stride_q)
        kk = _load_rows(k_base, offs_l, rmask, offs_k, mk, stride_k)
        S += tl.dot(qt, tl.trans(kk), input_precision=PREC)
        Ct = tl.load(cs_ptr + (bh64 * NC + c) * K * V + offs_k[:, None] * V + offs_v[None, :],
                     mask=mk[:, None] & mv[None, :], other=0.0)              # [BK, BV]
        inter += _dot_r(qt, Ct, STATE_MODE, PREC)
        nt = tl.load(ns_ptr + (bh64 * NC + c) * K + offs_k, mask=mk, other=0.0)
        qn += tl.sum(qt.to(tl.float32) * nt[None, :], axis=1)

    causal = offs_l[:, None] >= offs_l[None, :]
    D = (beta[:, None] - beta[None, :]) + (blo[:, None] - blo[None, :]) + ig[None, :] - m_row[:, None]
    P = S * scale * tl.exp(tl.where(causal, D, _NEG))                        # [L, L]
    ea = tl.exp(beta + m_prev - m_row)
    nbar = ea * qn * scale + tl.sum(P, axis=1)
    vt = _load_rows(v_base, offs_l, rmask, offs_v, mv, stride_v)
    if P_SPLIT:
        pv = _dot_l(P, vt, 1, PREC)
    else:
        pv = tl.dot(P.to(vt.dtype), vt, input_precision=PREC)
    num = (ea * scale)[:, None] * inter + pv
    den = tl.maximum(tl.abs(nbar), tl.exp(-m_row)) + eps
    out = num / den[:, None]
    h_off = _seq_base(bh, row0, T, H, V) + offs_l[:, None] * (H * V) + offs_v[None, :]
    out_h = out.to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + h_off, out_h, mask=rmask[:, None] & mv[None, :])
    if H_LO:
        tl.store(hlo_ptr + h_off, (out - out_h.to(tl.float32)).to(hlo_ptr.dtype.element_ty),
                 mask=rmask[:, None] & mv[None, :])
    first_v = (offs_l < L) & (pid_v == 0)
    tl.store(nbar_ptr + g_base + prow, nbar, mask=first_v)
    tl.store(mrow_ptr + g_base + prow, m_row, mask=first_v)


def fwd_out(q, k, v, beta, blo, ig, u, cs, ns, ms, h, hlo, nbar, mrow, eps, cfg, smode, prec, vl=None):
    """Launch _fwd_out: fills h [B,T,H,V], hlo (h's rounding residual; empty for float32
    inputs), nbar and mrow [B,H,NC·L] float32; vl the varlen.ChunkTable or None. q, k, v
    [B,T,H,*] with heads packed and evenly spaced rows (op._rows)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = cs.shape[2]
    lowp = q.dtype != torch.float32
    BV = cfg.out_bv
    _fwd_out[(NC, triton.cdiv(V, BV), B * H)](
        q, k, v, beta, blo, ig, u, cs, ns, ms, h, hlo if lowp else h, nbar, mrow, ms if vl is None else vl.tab,
        T, H, NC, 1 if vl is None else vl.n, K ** -0.5, eps, q.stride(1), k.stride(1), v.stride(1),
        K=K, V=V, L=cfg.chunk, BK=cfg.out_bk, BV=BV,
        STATE_MODE=smode, PREC=prec, P_SPLIT=lowp, H_LO=lowp, VARLEN=vl is not None,
        num_warps=cfg.out_warps, num_stages=cfg.out_stages,
    )
