"""Sequential state passing: the forward walks the chunks in order carrying (C, n) in float32
registers (_fwd_states); the backward walks them in reverse carrying (δC, δn) (_bwd_dstates).
One program per (K-tile, V-tile, b·h); each step is one matrix product."""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import _dot_l, _load_rows, _row_base, _seq_base, _seq_program, _span


@triton.jit
def _state_tile(K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Program (K-tile, V-tile, b·h): (pid_k, pid_v, bh, bh64, offs_k, mk, offs_v, mv, mkv,
    kv_off), kv_off [BK, BV] the tile's offsets in a [K, V] state."""
    pid_k = tl.program_id(0)
    pid_v = tl.program_id(1)
    bh = tl.program_id(2)
    offs_k, mk = _span(pid_k, BK, K)
    offs_v, mv = _span(pid_v, BV, V)
    return (pid_k, pid_v, bh, bh.to(tl.int64), offs_k, mk, offs_v, mv, mk[:, None] & mv[None, :],
            offs_k[:, None] * V + offs_v[None, :])


@triton.jit
def _load_state(c_ptr, n_ptr, bh64, kv_off, mkv, offs_k, mk, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, HAS: tl.constexpr):
    """This tile of b·h's state ([B·H, K, V], [B·H, K]) as float32 (C [BK, BV], n [BK]); zeros
    without HAS."""
    if HAS:
        C = tl.load(c_ptr + bh64 * K * V + kv_off, mask=mkv, other=0.0).to(tl.float32)
        n = tl.load(n_ptr + bh64 * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    else:
        C = tl.zeros([BK, BV], dtype=tl.float32)
        n = tl.zeros([BK], dtype=tl.float32)
    return C, n


@triton.jit
def _store_state(c_ptr, n_ptr, i, C, n, kv_off, mkv, offs_k, mk, first_v, K: tl.constexpr, V: tl.constexpr):
    """This tile of state i of [*, K, V], [*, K] (n from the V-tile 0 programs only)."""
    tl.store(c_ptr + i * K * V + kv_off, C.to(c_ptr.dtype.element_ty), mask=mkv)
    tl.store(n_ptr + i * K + offs_k, n, mask=mk & first_v)


@triton.jit
def _fwd_states(
    k_ptr, v_ptr, beta_ptr, blo_ptr, ig_ptr, u_ptr,
    c0_ptr, n0_ptr, m0_ptr,
    cs_ptr, ns_ptr, ms_ptr, cf_ptr, nf_ptr, mf_ptr, sinfo_ptr,
    T, H, NC, NS, stride_k, stride_v,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT: tl.constexpr, UPD_MODE: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    """States entering every chunk: cs[b·h, c] = C_c (cs dtype), ns likewise, ms[b·h, c + seq]
    (ms [B,H,NC+NS]: each sequence's chunks and then its final m), and the final (C, n, m) in
    float32. Program (K-tile, V-tile, b·h) holds C[BK, BV] in float32 registers and walks the
    chunks in order; VARLEN: program (K-tile, V-tile, n·H + h) walks sequence n's chunks from
    its initial state (row n·H + h of the [N,H,...] states) to its final state."""
    pid_k, pid_v, sb, sb64, offs_k, mk, offs_v, mv, mkv, kv_off = _state_tile(K, V, BK, BV)
    hb, sq, bos, eos, c0, c1 = _seq_program(sb, sinfo_ptr, T, H, NC, VARLEN)
    hb64 = hb.to(tl.int64)
    offs_l = tl.arange(0, L)
    g_base = hb64 * NC * L
    msb = ms_ptr + hb64 * (NC + NS) + sq
    C, n = _load_state(c0_ptr, n0_ptr, sb64, kv_off, mkv, offs_k, mk, K, V, BK, BV, HAS_INIT)
    m = tl.load(m0_ptr + sb).to(tl.float32)
    first_v = pid_v == 0
    # 64-bit bases at the sequence's first row, 32-bit offsets within it (a sequence's steps ×
    # H·K stay below 2^31; the packed total need not)
    kb = k_ptr + _row_base(hb, bos, T, H, K, stride_k)
    vb = v_ptr + _row_base(hb, bos, T, H, V, stride_v)
    for c in range(c0, c1):
        _store_state(cs_ptr, ns_ptr, hb64 * NC + c, C, n, kv_off, mkv, offs_k, mk, first_v, K, V)
        tl.store(msb + c, m, mask=first_v & (pid_k == 0))
        rows = (c - c0) * L + offs_l
        rmask = rows < eos - bos
        prow = c * L + offs_l
        beta = tl.load(beta_ptr + g_base + prow)
        blo = tl.load(blo_ptr + g_base + prow)
        ig = tl.load(ig_ptr + g_base + prow)
        beta_last = tl.load(beta_ptr + g_base + c * L + L - 1)
        blo_last = tl.load(blo_ptr + g_base + c * L + L - 1)
        u_last = tl.load(u_ptr + g_base + c * L + L - 1)
        m_next = tl.maximum(beta_last + m, u_last)
        decay = tl.exp(beta_last + m - m_next)
        wgt = tl.exp((beta_last - beta) + (blo_last - blo) + ig - m_next)    # [L], ≤ 1
        kt = _load_rows(kb, rows, rmask, offs_k, mk, stride_k)               # [L, BK]
        vt = _load_rows(vb, rows, rmask, offs_v, mv, stride_v)               # [L, BV]
        kw = kt.to(tl.float32) * wgt[:, None]
        C = C * decay + _dot_l(tl.trans(kw), vt, UPD_MODE, PREC)
        n = n * decay + tl.sum(kw, axis=0)
        m = m_next
    tl.store(msb + c1, m, mask=first_v & (pid_k == 0))
    tl.store(mf_ptr + sb, m, mask=first_v & (pid_k == 0))
    _store_state(cf_ptr, nf_ptr, sb64, C, n, kv_off, mkv, offs_k, mk, first_v, K, V)
    if VARLEN:
        # the spare chunks past the last sequence's get zero states and stabilizers, so that
        # every output of the forward is defined (nothing reads them)
        c_end = tl.where(sq == NS - 1, NC, c1)
        for c in range(c1, c_end):
            _store_state(cs_ptr, ns_ptr, hb64 * NC + c, tl.zeros([BK, BV], dtype=tl.float32),
                         tl.zeros([BK], dtype=tl.float32), kv_off, mkv, offs_k, mk, first_v, K, V)
            tl.store(msb + c + 1, 0.0, mask=first_v & (pid_k == 0))


@triton.jit
def _bwd_dstates(
    q_ptr, dh_ptr, beta_ptr, u_ptr, rd_ptr, g_ptr, ms_ptr,
    dcf_ptr, dnf_ptr,
    dcs_ptr, dns_ptr, dc0_ptr, dn0_ptr, sinfo_ptr,
    T, H, NC, NS, scale,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DFINAL: tl.constexpr, UPD_MODE: tl.constexpr, PREC: tl.constexpr, VARLEN: tl.constexpr,
):
    """Reverse pass over chunks: dcs[b·h, c] = δC at the end of chunk c (= start of c+1), dns
    likewise; δC_0, δn_0 (the initial state's gradients, stabilizers fixed) in float32.
    VARLEN: as in _fwd_states, from sequence n's final-state gradient back to its start."""
    pid_k, pid_v, sb, sb64, offs_k, mk, offs_v, mv, mkv, kv_off = _state_tile(K, V, BK, BV)
    hb, sq, bos, eos, c0, c1 = _seq_program(sb, sinfo_ptr, T, H, NC, VARLEN)
    hb64 = hb.to(tl.int64)
    offs_l = tl.arange(0, L)
    g_base = hb64 * NC * L
    first_v = pid_v == 0
    dC, dn = _load_state(dcf_ptr, dnf_ptr, sb64, kv_off, mkv, offs_k, mk, K, V, BK, BV, HAS_DFINAL)
    msb = ms_ptr + hb64 * (NC + NS) + sq
    m_next = tl.load(msb + c1)
    qb = q_ptr + _seq_base(hb, bos, T, H, K)      # as in _fwd_states
    dhb = dh_ptr + _seq_base(hb, bos, T, H, V)
    for cc in range(c1 - c0):
        c = c1 - 1 - cc
        beta_last = tl.load(beta_ptr + g_base + c * L + L - 1)
        m_prev = tl.load(msb + c)
        _store_state(dcs_ptr, dns_ptr, hb64 * NC + c, dC, dn, kv_off, mkv, offs_k, mk, first_v, K, V)
        rows = (c - c0) * L + offs_l
        rmask = rows < eos - bos
        prow = c * L + offs_l
        beta = tl.load(beta_ptr + g_base + prow)
        u = tl.load(u_ptr + g_base + prow)
        rd = tl.load(rd_ptr + g_base + prow)
        gg = tl.load(g_ptr + g_base + prow)
        m_row = tl.maximum(beta + m_prev, u)
        sea = scale * tl.exp(beta + m_prev - m_row)
        decay = tl.exp(beta_last + m_prev - m_next)
        qt = _load_rows(qb, rows, rmask, offs_k, mk, H * K).to(tl.float32)
        dht = _load_rows(dhb, rows, rmask, offs_v, mv, H * V)
        qs = qt * (sea * rd)[:, None]                                        # q̂ e^{a} / d
        dC = dC * decay + _dot_l(tl.trans(qs), dht, UPD_MODE, PREC)
        dn = dn * decay + tl.sum(qt * (sea * gg)[:, None], axis=0)
        m_next = m_prev
    _store_state(dc0_ptr, dn0_ptr, sb64, dC, dn, kv_off, mkv, offs_k, mk, first_v, K, V)


def fwd_states(k, v, beta, blo, ig, u, C0, n0, m0, out, cfg, upd, prec, vl=None):
    """Launch _fwd_states; out = (cs, ns, ms, Cf, nf, mf) preallocated (see op.forward); vl the
    varlen.ChunkTable of packed sequences or None."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    cs, ns, ms, cf, nf, mf = out
    NC = ns.shape[2]
    has_init = C0 is not None
    BK, BV = cfg.states_bk, cfg.states_bv
    S = B if vl is None else vl.n
    _fwd_states[(triton.cdiv(K, BK), triton.cdiv(V, BV), S * H)](
        k, v, beta, blo, ig, u,
        C0 if has_init else ms, n0 if has_init else ms, m0,
        cs, ns, ms, cf, nf, mf, ms if vl is None else vl.sinfo,
        T, H, NC, 1 if vl is None else vl.n, k.stride(1), v.stride(1),
        K=K, V=V, L=cfg.chunk, BK=BK, BV=BV, HAS_INIT=has_init, UPD_MODE=upd, PREC=prec, VARLEN=vl is not None,
        num_warps=cfg.states_warps, num_stages=cfg.states_stages,
    )


def bwd_dstates(q, dh, beta, u, rd, g, ms, dCf, dnf, out, cfg, upd, prec, vl=None):
    """Launch _bwd_dstates; out = (dcs, dns, dC0, dn0) preallocated; dCf, dnf float32 or None;
    vl as in fwd_states."""
    B, T, H, K = q.shape
    V = dh.shape[-1]
    dcs, dns, dC0, dn0 = out
    NC = dcs.shape[2]
    has_df = dCf is not None
    BK, BV = cfg.dstates_bk, cfg.dstates_bv
    S = B if vl is None else vl.n
    _bwd_dstates[(triton.cdiv(K, BK), triton.cdiv(V, BV), S * H)](
        q, dh, beta, u, rd, g, ms,
        dCf if has_df else ms, dnf if has_df else ms,
        dcs, dns, dC0, dn0, ms if vl is None else vl.sinfo,
        T, H, NC, 1 if vl is None else vl.n, K ** -0.5,
        K=K, V=V, L=cfg.chunk, BK=BK, BV=BV, HAS_DFINAL=has_df, UPD_MODE=upd, PREC=prec, VARLEN=vl is not None,
        num_warps=cfg.dstates_warps, num_stages=cfg.dstates_stages,
    )
