"""Sequential state passing: the forward walks the chunks in order carrying (C, n) in float32
registers (_fwd_states); the backward walks them in reverse carrying (δC, δn) (_bwd_dstates).
One program per (K-tile, V-tile, b·h); each step is one matrix product."""
from __future__ import annotations

import triton
import triton.language as tl

from ._common import _dot_l, _load_rows, _seq_base, _span


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
    cs_ptr, ns_ptr, ms_ptr, cf_ptr, nf_ptr, mf_ptr,
    T, H, NC,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT: tl.constexpr, UPD_MODE: tl.constexpr, PREC: tl.constexpr,
):
    """States entering every chunk: cs[b·h, c] = C_c (cs dtype), ns, ms likewise, and the final
    (C, n, m) in float32. Program (K-tile, V-tile, b·h) holds C[BK, BV] in float32 registers
    and walks the chunks in order."""
    pid_k, pid_v, bh, bh64, offs_k, mk, offs_v, mv, mkv, kv_off = _state_tile(K, V, BK, BV)
    offs_l = tl.arange(0, L)
    g_base = bh64 * NC * L
    k_base = k_ptr + _seq_base(bh, 0, T, H, K)
    v_base = v_ptr + _seq_base(bh, 0, T, H, V)
    C, n = _load_state(c0_ptr, n0_ptr, bh64, kv_off, mkv, offs_k, mk, K, V, BK, BV, HAS_INIT)
    m = tl.load(m0_ptr + bh).to(tl.float32)
    first_v = pid_v == 0
    for c in range(NC):
        _store_state(cs_ptr, ns_ptr, bh64 * NC + c, C, n, kv_off, mkv, offs_k, mk, first_v, K, V)
        tl.store(ms_ptr + bh64 * (NC + 1) + c, m, mask=first_v & (pid_k == 0))
        rows = c * L + offs_l
        rmask = rows < T
        beta = tl.load(beta_ptr + g_base + rows)
        blo = tl.load(blo_ptr + g_base + rows)
        ig = tl.load(ig_ptr + g_base + rows)
        beta_last = tl.load(beta_ptr + g_base + c * L + L - 1)
        blo_last = tl.load(blo_ptr + g_base + c * L + L - 1)
        u_last = tl.load(u_ptr + g_base + c * L + L - 1)
        m_next = tl.maximum(beta_last + m, u_last)
        decay = tl.exp(beta_last + m - m_next)
        wgt = tl.exp((beta_last - beta) + (blo_last - blo) + ig - m_next)    # [L], ≤ 1
        kt = _load_rows(k_base, rows, rmask, offs_k, mk, H * K)              # [L, BK]
        vt = _load_rows(v_base, rows, rmask, offs_v, mv, H * V)              # [L, BV]
        kw = kt.to(tl.float32) * wgt[:, None]
        C = C * decay + _dot_l(tl.trans(kw), vt, UPD_MODE, PREC)
        n = n * decay + tl.sum(kw, axis=0)
        m = m_next
    tl.store(ms_ptr + bh64 * (NC + 1) + NC, m, mask=first_v & (pid_k == 0))
    tl.store(mf_ptr + bh, m, mask=first_v & (pid_k == 0))
    _store_state(cf_ptr, nf_ptr, bh64, C, n, kv_off, mkv, offs_k, mk, first_v, K, V)


@triton.jit
def _bwd_dstates(
    q_ptr, dh_ptr, beta_ptr, u_ptr, rd_ptr, g_ptr, ms_ptr,
    dcf_ptr, dnf_ptr,
    dcs_ptr, dns_ptr, dc0_ptr, dn0_ptr,
    T, H, NC, scale,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DFINAL: tl.constexpr, UPD_MODE: tl.constexpr, PREC: tl.constexpr,
):
    """Reverse pass over chunks: dcs[b·h, c] = δC at the end of chunk c (= start of c+1), dns
    likewise; δC_0, δn_0 (the initial state's gradients, stabilizers fixed) in float32."""
    pid_k, pid_v, bh, bh64, offs_k, mk, offs_v, mv, mkv, kv_off = _state_tile(K, V, BK, BV)
    offs_l = tl.arange(0, L)
    g_base = bh64 * NC * L
    q_base = q_ptr + _seq_base(bh, 0, T, H, K)
    dh_base = dh_ptr + _seq_base(bh, 0, T, H, V)
    first_v = pid_v == 0
    dC, dn = _load_state(dcf_ptr, dnf_ptr, bh64, kv_off, mkv, offs_k, mk, K, V, BK, BV, HAS_DFINAL)
    msb = ms_ptr + bh64 * (NC + 1)
    m_next = tl.load(msb + NC)
    for cc in range(NC):
        c = NC - 1 - cc
        beta_last = tl.load(beta_ptr + g_base + c * L + L - 1)
        m_prev = tl.load(msb + c)
        _store_state(dcs_ptr, dns_ptr, bh64 * NC + c, dC, dn, kv_off, mkv, offs_k, mk, first_v, K, V)
        rows = c * L + offs_l
        rmask = rows < T
        beta = tl.load(beta_ptr + g_base + rows)
        u = tl.load(u_ptr + g_base + rows)
        rd = tl.load(rd_ptr + g_base + rows)
        gg = tl.load(g_ptr + g_base + rows)
        m_row = tl.maximum(beta + m_prev, u)
        sea = scale * tl.exp(beta + m_prev - m_row)
        decay = tl.exp(beta_last + m_prev - m_next)
        qt = _load_rows(q_base, rows, rmask, offs_k, mk, H * K).to(tl.float32)
        dht = _load_rows(dh_base, rows, rmask, offs_v, mv, H * V)
        qs = qt * (sea * rd)[:, None]                                        # q̂ e^{a} / d
        dC = dC * decay + _dot_l(tl.trans(qs), dht, UPD_MODE, PREC)
        dn = dn * decay + tl.sum(qt * (sea * gg)[:, None], axis=0)
        m_next = m_prev
    _store_state(dc0_ptr, dn0_ptr, bh64, dC, dn, kv_off, mkv, offs_k, mk, first_v, K, V)


def fwd_states(k, v, beta, blo, ig, u, C0, n0, m0, out, cfg, upd, prec):
    """Launch _fwd_states; out = (cs, ns, ms, Cf, nf, mf) preallocated (see op.forward)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    cs, ns, ms, cf, nf, mf = out
    NC = cs.shape[2]
    has_init = C0 is not None
    BK, BV = cfg.states_bk, cfg.states_bv
    _fwd_states[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        k, v, beta, blo, ig, u,
        C0 if has_init else ms, n0 if has_init else ms, m0,
        cs, ns, ms, cf, nf, mf,
        T, H, NC,
        K=K, V=V, L=cfg.chunk, BK=BK, BV=BV, HAS_INIT=has_init, UPD_MODE=upd, PREC=prec,
        num_warps=cfg.states_warps, num_stages=cfg.states_stages,
    )


def bwd_dstates(q, dh, beta, u, rd, g, ms, dCf, dnf, out, cfg, upd, prec):
    """Launch _bwd_dstates; out = (dcs, dns, dC0, dn0) preallocated; dCf, dnf float32 or None."""
    B, T, H, K = q.shape
    V = dh.shape[-1]
    dcs, dns, dC0, dn0 = out
    NC = dcs.shape[2]
    has_df = dCf is not None
    BK, BV = cfg.dstates_bk, cfg.dstates_bv
    _bwd_dstates[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        q, dh, beta, u, rd, g, ms,
        dCf if has_df else ms, dnf if has_df else ms,
        dcs, dns, dC0, dn0,
        T, H, NC, K ** -0.5,
        K=K, V=V, L=cfg.chunk, BK=BK, BV=BV, HAS_DFINAL=has_df, UPD_MODE=upd, PREC=prec,
        num_warps=cfg.dstates_warps, num_stages=cfg.dstates_stages,
    )
