"""Backward per row and per chunk, with every stabilizer held fixed (their own influence is
added by gates._gate_tail): _bwd_rows (the per-row factors of δh), then per chunk either
_bwd_fused (all of K in one program: δq, δk, δv and the log-gate gradients) or, for K above
cfg.fused_max_k, _bwd_dqk (per K-tile: δq, δk, log-gate shares) and _bwd_dv (per V-tile)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _NEG, _chunk_program, _dot_l, _dot_r, _load_rows, _seq_base, _span, pow2


@triton.jit
def _bwd_rows(
    dh_ptr, h_ptr, hlo_ptr, nbar_ptr, mrow_ptr, r_ptr, rd_ptr, g_ptr, tab_ptr,
    T, H, NCL, eps,
    V: tl.constexpr, L: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, H_LO: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """Per-row factors of δh for rows [BT·pid, +BT) of one b·h, [B,H,NC·L] (zeros past T, and
    on the padded rows of packed sequences): r = δh·h / d, rd = 1/d, g = δn̄ = −r·sign(n̄) on
    the |n̄| branch of the max. Reads δh and h (+ its rounding residual with H_LO) in their own
    dtype. VARLEN: per-row position p = c·L + l is step row0_c + l of the inputs (varlen
    table), a real step where that is before its sequence's end."""
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    p = pid * BT + tl.arange(0, BT)
    pm = p < NCL
    if VARLEN:
        row0 = tl.load(tab_ptr + (p // L) * 4 + 1, mask=pm, other=0)
        end = tl.load(tab_ptr + (p // L) * 4 + 2, mask=pm, other=0)
        t = row0 + p % L
        tm = pm & (t < end)
    else:
        t = p
        tm = t < T
    base = _seq_base(bh, 0, T, H, V)
    acc = tl.zeros([BT], dtype=tl.float32)
    for j in range((V + BV - 1) // BV):
        offs_v, mv = _span(j, BV, V)
        off = base + t[:, None].to(tl.int64) * (H * V) + offs_v[None, :]
        msk = tm[:, None] & mv[None, :]
        a = tl.load(dh_ptr + off, mask=msk, other=0.0).to(tl.float32)
        y = tl.load(h_ptr + off, mask=msk, other=0.0).to(tl.float32)
        if H_LO:  # h's rounding residual: δh·h is a near-cancelling term of δP
            y += tl.load(hlo_ptr + off, mask=msk, other=0.0).to(tl.float32)
        acc += tl.sum(a * y, axis=1)
    nb = tl.load(nbar_ptr + bh64 * NCL + p, mask=tm, other=0.0)
    mr = tl.load(mrow_ptr + bh64 * NCL + p, mask=tm, other=0.0)
    floor = tl.exp(-mr)
    den = tl.maximum(tl.abs(nb), floor) + eps
    r = acc / den
    sgn = tl.where(nb > 0, 1.0, tl.where(nb < 0, -1.0, 0.0))
    g = tl.where(tl.abs(nb) > floor, -r * sgn, 0.0)
    out = bh64 * NCL + p
    tl.store(r_ptr + out, tl.where(tm, r, 0.0), mask=pm)
    tl.store(rd_ptr + out, tl.where(tm, 1.0 / den, 0.0), mask=pm)
    tl.store(g_ptr + out, tl.where(tm, g, 0.0), mask=pm)


@triton.jit
def _chunk_gates(beta_ptr, blo_ptr, ig_ptr, u_ptr, ms_ptr, g_base, ms_base, c, prow, offs_l, L: tl.constexpr):
    """Per-row / per-chunk log factors of chunk c (see the package docstring): E = e^{D} on
    the causal triangle [L, L], e^{a} [L], e^{w} [L], e^{b}. prow: the chunk's per-row
    positions c·L + offs_l; ms_base + c: its entry in ms (see states._fwd_states)."""
    beta = tl.load(beta_ptr + g_base + prow)
    blo = tl.load(blo_ptr + g_base + prow)
    blo_last = tl.load(blo_ptr + g_base + c * L + L - 1)
    ig = tl.load(ig_ptr + g_base + prow)
    u = tl.load(u_ptr + g_base + prow)
    beta_last = tl.load(beta_ptr + g_base + c * L + L - 1)
    m_prev = tl.load(ms_ptr + ms_base + c)
    m_next = tl.load(ms_ptr + ms_base + c + 1)
    m_row = tl.maximum(beta + m_prev, u)
    causal = offs_l[:, None] >= offs_l[None, :]
    D = (beta[:, None] - beta[None, :]) + (blo[:, None] - blo[None, :]) + ig[None, :] - m_row[:, None]
    E = tl.exp(tl.where(causal, D, _NEG))
    ea = tl.exp(beta + m_prev - m_row)                                      # e^{a_t}
    ew = tl.exp((beta_last - beta) + (blo_last - blo) + ig - m_next)        # e^{w_s}
    eb = tl.exp(beta_last + m_prev - m_next)                                # e^{b}
    return E, ea, ew, eb


@triton.jit
def _qk_full(q_base, k_base, rows, rmask, HK, L: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
             PREC: tl.constexpr):
    """S = q kᵀ over all of K, [L, L] float32."""
    S = tl.zeros([L, L], dtype=tl.float32)
    for kt in range((K + BK - 1) // BK):
        offs_k, mk = _span(kt, BK, K)
        qt = _load_rows(q_base, rows, rmask, offs_k, mk, HK)
        kk = _load_rows(k_base, rows, rmask, offs_k, mk, HK)
        S += tl.dot(qt, tl.trans(kk), input_precision=PREC)
    return S


@triton.jit
def _bwd_dqk(
    q_ptr, k_ptr, v_ptr, dh_ptr, beta_ptr, blo_ptr, ig_ptr, u_ptr, rd_ptr, g_ptr, ms_ptr,
    cs_ptr, ns_ptr, dcs_ptr, dns_ptr,
    dq_ptr, dk_ptr, dlf_ptr, di_ptr, tab_ptr,
    T, H, NC, NS, BHNCL, scale, c_off,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STATE_MODE: tl.constexpr, PREC: tl.constexpr, DS_SPLIT: tl.constexpr,
    DC_LAST: tl.constexpr, D_MODE: tl.constexpr, VARLEN: tl.constexpr,
):
    """δq, δk of one chunk and K-tile, and this tile's share of the chunk's fixed-stabilizer
    log-gate gradients: dlf[kt] = δlog f, di[kt] = δĩ. Chunk c = program 0 + c_off. DC_LAST:
    dcs_ptr is the float32 δC_T [B·H, K, V] of the last chunk (see last_chunk_apart); D_MODE:
    _dot_r mode of the products with δC. VARLEN: chunks from the varlen table (_chunk_program);
    spare chunks return at once."""
    c, bh, bh64, offs_l, rows, rmask, g_base, prow, row0, seq = _chunk_program(c_off, T, NC, tab_ptr, L, 2, VARLEN)
    if VARLEN:
        if seq < 0:
            return
    pid_k = tl.program_id(1)
    offs_k, mk = _span(pid_k, BK, K)
    st = bh64 * NC + c
    # 64-bit bases at the chunk's first row, 32-bit offsets within it
    qk_base = _seq_base(bh, row0, T, H, K)
    v_base = v_ptr + _seq_base(bh, row0, T, H, V)
    dh_base = dh_ptr + _seq_base(bh, row0, T, H, V)
    rd = tl.load(rd_ptr + g_base + prow)
    gg = tl.load(g_ptr + g_base + prow)

    lk = rmask[:, None] & mk[None, :]
    out_off = qk_base + offs_l[:, None] * (H * K) + offs_k[None, :]
    qt = tl.load(q_ptr + out_off, mask=lk, other=0.0)
    kk = tl.load(k_ptr + out_off, mask=lk, other=0.0)

    dP = tl.zeros([L, L], dtype=tl.float32)
    acc_q = tl.zeros([L, BK], dtype=tl.float32)       # δh C_cᵀ      (inter-chunk part of δq)
    acc_k = tl.zeros([L, BK], dtype=tl.float32)       # v δC_{c+1}ᵀ  (state part of δk)
    zb = tl.zeros([BK], dtype=tl.float32)             # rows of <δC_{c+1}, C_c>
    for j in range((V + BV - 1) // BV):
        offs_v, mv = _span(j, BV, V)
        vt = _load_rows(v_base, offs_l, rmask, offs_v, mv, H * V)
        dht = _load_rows(dh_base, offs_l, rmask, offs_v, mv, H * V)
        kv_off = offs_k[:, None] * V + offs_v[None, :]
        mkv = mk[:, None] & mv[None, :]
        Cp = tl.load(cs_ptr + st * K * V + kv_off, mask=mkv, other=0.0)     # [BK, BV]
        dCn = tl.load(dcs_ptr + (bh64 if DC_LAST else st) * K * V + kv_off, mask=mkv, other=0.0)
        dP += tl.dot(dht, tl.trans(vt), input_precision=PREC)
        acc_q += _dot_r(dht, tl.trans(Cp), STATE_MODE, PREC)
        acc_k += _dot_r(vt, tl.trans(dCn), D_MODE, PREC)
        zb += tl.sum(dCn.to(tl.float32) * Cp.to(tl.float32), axis=1)

    E, ea, ew, eb = _chunk_gates(beta_ptr, blo_ptr, ig_ptr, u_ptr, ms_ptr, g_base, bh64 * (NC + NS) + seq, c, prow, offs_l, L)
    S = _qk_full(q_ptr + qk_base, k_ptr + qk_base, offs_l, rmask, H * K, L, K, BK, PREC)
    P = S * scale * E                                                       # [L, L]
    n_prev = tl.load(ns_ptr + st * K + offs_k, mask=mk, other=0.0)
    dn_next = tl.load(dns_ptr + st * K + offs_k, mask=mk, other=0.0)
    dP = dP * rd[:, None] + gg[:, None]                                     # δP w.r.t. P
    dS = dP * E                                                             # δ w.r.t. q̂·k
    sea = scale * ea
    dq_inter = (sea * rd)[:, None] * acc_q + (sea * gg)[:, None] * n_prev[None, :]
    dq = scale * _dot_l(dS, kk, DS_SPLIT, PREC) + dq_inter
    dk_state = ew[:, None] * (acc_k + dn_next[None, :])
    dk = scale * _dot_l(tl.trans(dS), qt, DS_SPLIT, PREC) + dk_state
    tl.store(dq_ptr + out_off, dq.to(dq_ptr.dtype.element_ty), mask=lk)
    tl.store(dk_ptr + out_off, dk.to(dk_ptr.dtype.element_ty), mask=lk)

    # Log-gate gradients with the stabilizers fixed. Query side of row t: Σ_s dP⊙P + q̂_t·δq̂_t
    # (inter); key side of row s: Σ_t dP⊙P + k_s·δk_s (state); the chunk's last β also gets
    # <δC_{c+1}, C_{c+1}> + <δn_{c+1}, n_{c+1}> = e^b(<δC_{c+1}, C_c> + <δn_{c+1}, n_c>) + Σ_s k_s·δk_s(state).
    # Products with q and k here are per K-tile shares; the dP⊙P sums go to tile 0 only.
    first = (pid_k == 0).to(tl.float32)
    dPP = dP * P
    row_q = tl.sum(dPP, axis=1) * first + tl.sum(qt.to(tl.float32) * dq_inter, axis=1)
    col_k = tl.sum(dPP, axis=0) * first
    dw = tl.sum(kk.to(tl.float32) * dk_state, axis=1)
    dbeta = row_q - col_k - dw
    z = eb * (tl.sum(zb, axis=0) + tl.sum(dn_next * n_prev, axis=0)) + tl.sum(dw, axis=0)
    dlf = tl.sum(dbeta, axis=0) - tl.cumsum(dbeta, axis=0) + dbeta + z      # Σ_{t≥r} δβ_t + z
    part = pid_k.to(tl.int64) * BHNCL + g_base + prow
    tl.store(dlf_ptr + part, dlf)
    tl.store(di_ptr + part, col_k + dw)


@triton.jit
def _bwd_dv(
    q_ptr, k_ptr, dh_ptr, beta_ptr, blo_ptr, ig_ptr, u_ptr, rd_ptr, ms_ptr, dcs_ptr, dv_ptr, tab_ptr,
    T, H, NC, NS, scale, c_off,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STATE_MODE: tl.constexpr, PREC: tl.constexpr, DC_LAST: tl.constexpr, VARLEN: tl.constexpr,
):
    """δv of one chunk and V-tile: Pᵀ(δh/d) + e^{w} k δC_{c+1}, summing over K-tiles.
    c_off, DC_LAST, VARLEN: as in _bwd_dqk (STATE_MODE is then the mode of the δC products)."""
    c, bh, bh64, offs_l, rows, rmask, g_base, prow, row0, seq = _chunk_program(c_off, T, NC, tab_ptr, L, 2, VARLEN)
    if VARLEN:
        if seq < 0:
            return
    offs_v, mv = _span(tl.program_id(1), BV, V)
    st = bh64 * NC + c
    q_base = q_ptr + _seq_base(bh, row0, T, H, K)
    k_base = k_ptr + _seq_base(bh, row0, T, H, K)
    E, ea, ew, eb = _chunk_gates(beta_ptr, blo_ptr, ig_ptr, u_ptr, ms_ptr, g_base, bh64 * (NC + NS) + seq, c, prow, offs_l, L)
    rd = tl.load(rd_ptr + g_base + prow)
    S = tl.zeros([L, L], dtype=tl.float32)
    acc = tl.zeros([L, BV], dtype=tl.float32)
    for kt in range((K + BK - 1) // BK):
        offs_k, mk = _span(kt, BK, K)
        qt = _load_rows(q_base, offs_l, rmask, offs_k, mk, H * K)
        kk = _load_rows(k_base, offs_l, rmask, offs_k, mk, H * K)
        S += tl.dot(qt, tl.trans(kk), input_precision=PREC)
        dCn = tl.load(dcs_ptr + (bh64 if DC_LAST else st) * K * V + offs_k[:, None] * V + offs_v[None, :],
                      mask=mk[:, None] & mv[None, :], other=0.0)
        acc += _dot_r(kk, dCn, STATE_MODE, PREC)
    P = S * scale * E
    lv = rmask[:, None] & mv[None, :]
    off = _seq_base(bh, row0, T, H, V) + offs_l[:, None] * (H * V) + offs_v[None, :]
    dht = tl.load(dh_ptr + off, mask=lv, other=0.0)
    dv = tl.dot(tl.trans((P * rd[:, None]).to(dht.dtype)), dht, input_precision=PREC) + ew[:, None] * acc
    tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=lv)


@triton.jit
def _v_tile(vb, dhb, j, offs_l, rmask, HV, V: tl.constexpr, BV: tl.constexpr):
    """V-tile j of v and δh at their chunk bases vb, dhb: (offs_v, mv, lv, v_off, vt, dht), with
    v_off [L, BV] int32 in-chunk offsets (see _bwd_fused) and lv their mask."""
    offs_v, mv = _span(j, BV, V)
    lv = rmask[:, None] & mv[None, :]
    v_off = offs_l[:, None] * HV + offs_v[None, :]
    return offs_v, mv, lv, v_off, tl.load(vb + v_off, mask=lv, other=0.0), tl.load(dhb + v_off, mask=lv, other=0.0)


@triton.jit
def _bwd_fused(
    q_ptr, k_ptr, v_ptr, dh_ptr, beta_ptr, blo_ptr, ig_ptr, u_ptr, rd_ptr, g_ptr, ms_ptr,
    cs_ptr, ns_ptr, dcs_ptr, dns_ptr,
    dq_ptr, dk_ptr, dv_ptr, dlf_ptr, di_ptr, tab_ptr,
    T, H, NC, NS, scale, c_off,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STATE_MODE: tl.constexpr, PREC: tl.constexpr, DS_SPLIT: tl.constexpr,
    DC_LAST: tl.constexpr, D_MODE: tl.constexpr, VARLEN: tl.constexpr,
):
    """δq, δk, δv and the chunk's fixed-stabilizer log-gate gradients in one program per
    (chunk, b·h); BK covers all of K, so every product is formed once (q kᵀ and δh vᵀ once,
    not once per K-tile, and no separate δv kernel recomputing q kᵀ).

    Two passes over V keep the live set small enough for the register file (one pass holding
    δP, P and both [L, K] state accumulators spills at L=64, K=V=128): pass 1 builds δP and
    writes δv; pass 2 builds δh C_cᵀ and v δC_{c+1}ᵀ with only the 16-bit δS live. v and δh
    are read twice (the second time mostly from L2).
    c_off, DC_LAST, D_MODE, VARLEN: as in _bwd_dqk."""
    c, bh, bh64, offs_l, rows, rmask, g_base, prow, row0, seq = _chunk_program(c_off, T, NC, tab_ptr, L, 1, VARLEN)
    if VARLEN:
        if seq < 0:
            return
    NVT: tl.constexpr = (V + BV - 1) // BV
    offs_k, mk = _span(0, BK, K)
    st = bh64 * NC + c
    # Scalar 64-bit bases at the chunk's first row plus 32-bit in-chunk offsets: a 64-bit
    # pointer per element of the [L, K] tiles, held across the V loops, costs 64 registers.
    qk0 = _seq_base(bh, row0, T, H, K)
    v0 = _seq_base(bh, row0, T, H, V)
    qb = q_ptr + qk0
    kb = k_ptr + qk0
    vb = v_ptr + v0
    dhb = dh_ptr + v0
    dvb = dv_ptr + v0
    csb = cs_ptr + st * K * V
    dcsb = dcs_ptr + (bh64 if DC_LAST else st) * K * V
    rd = tl.load(rd_ptr + g_base + prow)
    gg = tl.load(g_ptr + g_base + prow)
    lk = rmask[:, None] & mk[None, :]
    qk_off = offs_l[:, None] * (H * K) + offs_k[None, :]
    qt = tl.load(qb + qk_off, mask=lk, other=0.0)
    kk = tl.load(kb + qk_off, mask=lk, other=0.0)
    E, ea, ew, eb = _chunk_gates(beta_ptr, blo_ptr, ig_ptr, u_ptr, ms_ptr, g_base, bh64 * (NC + NS) + seq, c, prow, offs_l, L)
    Prd = (tl.dot(qt, tl.trans(kk), input_precision=PREC) * (scale * E) * rd[:, None]).to(kk.dtype)  # P/d

    # pass 1: δP = δh vᵀ and δv = (P/d)ᵀ δh + e^{w} k δC_{c+1}
    dP = tl.zeros([L, L], dtype=tl.float32)
    for j in range(NVT):
        offs_v, mv, lv, v_off, vt, dht = _v_tile(vb, dhb, j, offs_l, rmask, H * V, V, BV)
        dCn = tl.load(dcsb + offs_k[:, None] * V + offs_v[None, :],
                      mask=mk[:, None] & mv[None, :], other=0.0)            # [BK, BV]
        dP += tl.dot(dht, tl.trans(vt), input_precision=PREC)
        dv = tl.dot(tl.trans(Prd), dht, input_precision=PREC)
        dv += ew[:, None] * _dot_r(kk, dCn, D_MODE, PREC)
        tl.store(dvb + v_off, dv.to(dv_ptr.dtype.element_ty), mask=lv)

    # E, q and k are recomputed / re-read (L2) rather than held through the V loops.
    E, ea, ew, eb = _chunk_gates(beta_ptr, blo_ptr, ig_ptr, u_ptr, ms_ptr, g_base, bh64 * (NC + NS) + seq, c, prow, offs_l, L)
    qt = tl.load(qb + qk_off, mask=lk, other=0.0)
    kk = tl.load(kb + qk_off, mask=lk, other=0.0)
    P = tl.dot(qt, tl.trans(kk), input_precision=PREC) * scale * E         # [L, L]
    dP = dP * rd[:, None] + gg[:, None]                                     # δP w.r.t. P
    dPP = dP * P
    row_q = tl.sum(dPP, axis=1)
    col_k = tl.sum(dPP, axis=0)
    dS32 = dP * E                                                           # δ w.r.t. q̂·k
    dS = dS32.to(kk.dtype)
    if DS_SPLIT:  # its 16-bit rounding residual, a second operand of the δq and δk products
        dSlo = (dS32 - dS.to(tl.float32)).to(kk.dtype)

    # pass 2: the state terms δh C_cᵀ, v δC_{c+1}ᵀ and <δC_{c+1}, C_c>
    acc_q = tl.zeros([L, BK], dtype=tl.float32)
    acc_k = tl.zeros([L, BK], dtype=tl.float32)
    zb = tl.zeros([BK], dtype=tl.float32)
    for j in range(NVT):
        offs_v, mv, lv, v_off, vt, dht = _v_tile(vb, dhb, j, offs_l, rmask, H * V, V, BV)
        kv_off = offs_k[:, None] * V + offs_v[None, :]
        mkv = mk[:, None] & mv[None, :]
        Cp = tl.load(csb + kv_off, mask=mkv, other=0.0)
        dCn = tl.load(dcsb + kv_off, mask=mkv, other=0.0)
        acc_q += _dot_r(dht, tl.trans(Cp), STATE_MODE, PREC)
        acc_k += _dot_r(vt, tl.trans(dCn), D_MODE, PREC)
        zb += tl.sum(dCn.to(tl.float32) * Cp.to(tl.float32), axis=1)

    n_prev = tl.load(ns_ptr + st * K + offs_k, mask=mk, other=0.0)
    dn_next = tl.load(dns_ptr + st * K + offs_k, mask=mk, other=0.0)
    qt = tl.load(qb + qk_off, mask=lk, other=0.0)
    kk = tl.load(kb + qk_off, mask=lk, other=0.0)
    sea = scale * ea
    dq_inter = (sea * rd)[:, None] * acc_q + (sea * gg)[:, None] * n_prev[None, :]
    row_q += tl.sum(qt.to(tl.float32) * dq_inter, axis=1)
    dqs = tl.dot(dS, kk, input_precision=PREC)
    if DS_SPLIT:
        dqs = tl.dot(dSlo, kk, acc=dqs, input_precision=PREC)
    dq = scale * dqs + dq_inter
    tl.store(dq_ptr + qk0 + qk_off, dq.to(dq_ptr.dtype.element_ty), mask=lk)
    dk_state = ew[:, None] * (acc_k + dn_next[None, :])
    dw = tl.sum(kk.to(tl.float32) * dk_state, axis=1)
    dks = tl.dot(tl.trans(dS), qt, input_precision=PREC)
    if DS_SPLIT:
        dks = tl.dot(tl.trans(dSlo), qt, acc=dks, input_precision=PREC)
    dk = scale * dks + dk_state
    tl.store(dk_ptr + qk0 + qk_off, dk.to(dk_ptr.dtype.element_ty), mask=lk)

    # log-gate gradients as in _bwd_dqk (one K-tile holding all of K)
    dbeta = row_q - col_k - dw
    z = eb * (tl.sum(zb, axis=0) + tl.sum(dn_next * n_prev, axis=0)) + tl.sum(dw, axis=0)
    dlf = tl.sum(dbeta, axis=0) - tl.cumsum(dbeta, axis=0) + dbeta + z
    tl.store(dlf_ptr + g_base + prow, dlf)
    tl.store(di_ptr + g_base + prow, col_k + dw)


def bwd_rows(dh, h, hlo, nbar, mrow, eps, vl=None):
    """(r, rd, g) [B,H,NC·L] float32 from δh, h (+ hlo, empty for float32) and the forward's
    nbar, mrow [B,H,NC·L]; vl the varlen.ChunkTable or None; one _bwd_rows launch."""
    B, T, H, V = dh.shape
    NCL = nbar.shape[-1]
    r = torch.empty_like(nbar)
    rd, g = torch.empty_like(nbar), torch.empty_like(nbar)
    BT = 32
    h_lo = hlo.numel() > 0
    _bwd_rows[(triton.cdiv(NCL, BT), B * H)](
        dh, h, hlo if h_lo else h, nbar, mrow, r, rd, g, nbar if vl is None else vl.tab, T, H, NCL, eps,
        V=V, L=1 if vl is None else vl.chunk, BT=BT, BV=min(128, pow2(V)), H_LO=h_lo, VARLEN=vl is not None, num_warps=4,
    )
    return r, rd, g


def last_chunk_apart(NC, dcs, dCf, varlen=False):
    """Launch plan [(first chunk, chunks, δC source, DC_LAST)] of the per-chunk backward.

    With 16-bit stored δ-states and a final-state gradient, the last chunk runs as its own
    launch that reads δC_T in float32 and splits it into two 16-bit operands: its
    fixed-stabilizer δĩ, δlog f nearly cancel the final state's −<δC_T, C_T> term of δm_T
    (formed in float32 in the epilogue), so one bfloat16 rounding of δC_T on one side only
    gave δi 7× the reference's error at T = 1. Packed sequences (varlen) have a last chunk per
    sequence: there the δ-states are stored in float32 instead (see op._backward_impl) and
    every chunk splits them (D_MODE 1), in one launch."""
    if dCf is None or dcs.dtype == torch.float32 or varlen:
        return [(0, NC, dcs, False)]
    plan = [(0, NC - 1, dcs, False)] if NC > 1 else []
    return plan + [(NC - 1, 1, dCf, True)]


def bwd_chunks(q, k, v, dh, beta, blo, ig, u, rd, g, ms, cs, ns, dcs, dns, dCf, cfg, smode, prec, vl=None):
    """δq, δk, δv (input dtype) and the fixed-stabilizer log-gate gradients dlf, di
    [B,H,NC·L] float32 of every chunk: _bwd_fused when pow2(K) ≤ cfg.fused_max_k, else
    _bwd_dqk + _bwd_dv. vl: the varlen.ChunkTable or None."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = cs.shape[2]
    L = cfg.chunk
    NCL = NC * L
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ds_split = q.dtype != torch.float32
    scale = K ** -0.5
    varlen = vl is not None
    tab, NS = (vl.tab, vl.n) if varlen else (ms, 1)
    # float32 δ-states of 16-bit inputs (packed sequences with a final-state gradient): split
    d_split = dcs.dtype == torch.float32 and cs.dtype != torch.float32
    if pow2(K) <= cfg.fused_max_k:
        dlf = torch.empty(B, H, NCL, device=q.device, dtype=torch.float32)
        di = torch.empty_like(dlf)
        for c_off, n_c, dsrc, last in last_chunk_apart(NC, dcs, dCf, varlen):
            _bwd_fused[(n_c, B * H)](
                q, k, v, dh, beta, blo, ig, u, rd, g, ms, cs, ns, dsrc, dns,
                dq, dk, dv, dlf, di, tab,
                T, H, NC, NS, scale, c_off,
                K=K, V=V, L=L, BK=pow2(K), BV=min(cfg.fused_bv, pow2(V)),
                STATE_MODE=smode, PREC=prec, DS_SPLIT=ds_split, DC_LAST=last,
                D_MODE=1 if last or d_split else smode, VARLEN=varlen,
                num_warps=cfg.fused_warps, num_stages=cfg.fused_stages,
            )
        return dq, dk, dv, dlf, di
    nkt = triton.cdiv(K, cfg.dqk_bk)
    dlf = torch.empty(nkt, B, H, NCL, device=q.device, dtype=torch.float32)
    di = torch.empty_like(dlf)
    for c_off, n_c, dsrc, last in last_chunk_apart(NC, dcs, dCf, varlen):
        _bwd_dqk[(n_c, nkt, B * H)](
            q, k, v, dh, beta, blo, ig, u, rd, g, ms, cs, ns, dsrc, dns,
            dq, dk, dlf, di, tab,
            T, H, NC, NS, B * H * NCL, scale, c_off,
            K=K, V=V, L=L, BK=cfg.dqk_bk, BV=cfg.dqk_bv, STATE_MODE=smode, PREC=prec,
            DS_SPLIT=int(ds_split), DC_LAST=last, D_MODE=1 if last or d_split else smode, VARLEN=varlen,
            num_warps=cfg.dqk_warps, num_stages=cfg.dqk_stages,
        )
        _bwd_dv[(n_c, triton.cdiv(V, cfg.dv_bv), B * H)](
            q, k, dh, beta, blo, ig, u, rd, ms, dsrc, dv, tab,
            T, H, NC, NS, scale, c_off,
            K=K, V=V, L=L, BK=cfg.dv_bk, BV=cfg.dv_bv, STATE_MODE=1 if last or d_split else smode, PREC=prec,
            DC_LAST=last, VARLEN=varlen, num_warps=cfg.dv_warps, num_stages=cfg.dv_stages,
        )
    if nkt > 1:
        return dq, dk, dv, dlf.sum(0), di.sum(0)
    return dq, dk, dv, dlf[0], di[0]
