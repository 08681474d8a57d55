"""Parallel state passing. The sequential kernels (states.py) walk the chunks with a matrix
product per step, so their time is NC × the latency of one step, whatever the grid; with few
heads and long sequences they leave the GPU idle. Here the products run for all chunks at once
(_fwd_local, _bwd_local: each chunk's own contribution to the state at its end / the δ-state at
its start) and the chunks are then chained by an elementwise scan (_state_scan) whose loads do
not depend on the carried state, G chunks per step as one associative scan. The chunk-start
stabilizers m_c, which the local terms need first, are a max-plus scan of their own (_m_chain).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _NEG, _affine_combine, _chunk_program, _dot_l, _load_rows, _row_base, _seq_base, _span, pow2


@triton.jit
def _maxplus_combine(a1, u1, a2, u2):
    """Compose g ↦ max(a2 + g, u2) after g ↦ max(a1 + g, u1)."""
    return a1 + a2, tl.maximum(a2 + u1, u2)


@triton.jit
def _m_chain(beta_ptr, blo_ptr, u_ptr, m0_ptr, ms_ptr, mf_ptr, NC, L: tl.constexpr, BN: tl.constexpr):
    """Chunk-start stabilizers of one b·h: ms[0] = m0, ms[c+1] = max(β_L + ms[c], u_L) with β_L,
    u_L at chunk c's last step, and mf = ms[NC]; float64, blocks of BN chunks, each one
    max-plus scan."""
    bh = tl.program_id(0)
    bh64 = bh.to(tl.int64)
    idx = tl.arange(0, BN)
    carry = tl.zeros([1], dtype=tl.float64) + tl.load(m0_ptr + bh).to(tl.float64)
    tl.store(ms_ptr + bh64 * (NC + 1) + idx * 0, carry.to(tl.float32) + tl.zeros([BN], dtype=tl.float32), mask=idx == 0)
    for c0 in range(0, NC, BN):
        cc = c0 + idx
        ok = cc < NC
        last = bh64 * NC * L + cc * L + L - 1
        # masked chunks are the identity map (a = 0, u = NEG)
        a = tl.load(beta_ptr + last, mask=ok, other=0.0).to(tl.float64) + \
            tl.load(blo_ptr + last, mask=ok, other=0.0).to(tl.float64)
        uu = tl.load(u_ptr + last, mask=ok, other=_NEG).to(tl.float64)
        A, U = tl.associative_scan((a, uu), 0, _maxplus_combine)
        m = tl.maximum(A + tl.sum(carry, axis=0), U)
        tl.store(ms_ptr + bh64 * (NC + 1) + 1 + cc, m.to(tl.float32), mask=ok)
        carry = tl.zeros([1], dtype=tl.float64) + tl.sum(tl.where(idx == BN - 1, m, 0.0), axis=0)
    tl.store(mf_ptr + bh + idx * 0, carry.to(tl.float32) + tl.zeros([BN], dtype=tl.float32), mask=idx == 0)


@triton.jit
def _local_program(T, NC, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr):
    """Program (chunk c, K-tile × V-tile flattened, b·h) of _fwd_local/_bwd_local: (c, bh, bh64,
    offs_k, mk, offs_v, mv, pid_v, rows, rmask, g_base) as in _chunk_program / _span."""
    c, bh, bh64, offs_l, rows, rmask, g_base, _, _, _ = _chunk_program(0, T, NC, T, L, 2, False)
    NVT: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(1)
    pid_v = pid % NVT
    offs_k, mk = _span(pid // NVT, BK, K)
    offs_v, mv = _span(pid_v, BV, V)
    return c, bh, bh64, offs_k, mk, offs_v, mv, pid_v, rows, rmask, g_base


@triton.jit
def _store_local(dc_ptr, dn_ptr, st, dC, dn, offs_k, mk, offs_v, mv, pid_v, K: tl.constexpr, V: tl.constexpr):
    """A chunk's local term: dC [BK, BV] into dc[st] ([K, V]), dn [BK] into dn[st] ([K]) from
    the V-tile 0 programs only."""
    tl.store(dc_ptr + st * K * V + offs_k[:, None] * V + offs_v[None, :], dC, mask=mk[:, None] & mv[None, :])
    tl.store(dn_ptr + st * K + offs_k, dn, mask=mk & (pid_v == 0))


@triton.jit
def _fwd_local(
    k_ptr, v_ptr, beta_ptr, blo_ptr, ig_ptr, ms_ptr, dc_ptr, dn_ptr,
    T, H, NC, stride_k, stride_v,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    UPD_MODE: tl.constexpr, PREC: tl.constexpr,
):
    """Chunk c's own part of the state at its end, stabilized by m_{c+1}: dc[b·h, c] =
    Σ_s e^{w_s} k_s v_sᵀ [K, V], dn[b·h, c] = Σ_s e^{w_s} k_s [K], float32."""
    c, bh, bh64, offs_k, mk, offs_v, mv, pid_v, rows, rmask, g_base = _local_program(T, NC, K, V, L, BK, BV)
    beta = tl.load(beta_ptr + g_base + rows)
    blo = tl.load(blo_ptr + g_base + rows)
    ig = tl.load(ig_ptr + g_base + rows)
    beta_last = tl.load(beta_ptr + g_base + c * L + L - 1)
    blo_last = tl.load(blo_ptr + g_base + c * L + L - 1)
    m_next = tl.load(ms_ptr + bh64 * (NC + 1) + c + 1)
    wgt = tl.exp((beta_last - beta) + (blo_last - blo) + ig - m_next)       # [L], ≤ 1
    kt = _load_rows(k_ptr + _row_base(bh, 0, T, H, K, stride_k), rows, rmask, offs_k, mk, stride_k)
    vt = _load_rows(v_ptr + _row_base(bh, 0, T, H, V, stride_v), rows, rmask, offs_v, mv, stride_v)
    kw = kt.to(tl.float32) * wgt[:, None]
    _store_local(dc_ptr, dn_ptr, bh64 * NC + c, _dot_l(tl.trans(kw), vt, UPD_MODE, PREC), tl.sum(kw, axis=0),
                 offs_k, mk, offs_v, mv, pid_v, K, V)


@triton.jit
def _bwd_local(
    q_ptr, dh_ptr, beta_ptr, u_ptr, rd_ptr, g_ptr, ms_ptr, dc_ptr, dn_ptr,
    T, H, NC, scale,
    K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    UPD_MODE: tl.constexpr, PREC: tl.constexpr,
):
    """Chunk c's own part of the δ-state at its start (stabilizers fixed): dc[b·h, c] =
    Σ_t (q̂_t e^{a_t}/d_t) δh_tᵀ [K, V], dn[b·h, c] = Σ_t q̂_t e^{a_t} δn̄_t [K], float32."""
    c, bh, bh64, offs_k, mk, offs_v, mv, pid_v, rows, rmask, g_base = _local_program(T, NC, K, V, L, BK, BV)
    beta = tl.load(beta_ptr + g_base + rows)
    u = tl.load(u_ptr + g_base + rows)
    rd = tl.load(rd_ptr + g_base + rows)
    gg = tl.load(g_ptr + g_base + rows)
    m_prev = tl.load(ms_ptr + bh64 * (NC + 1) + c)
    sea = scale * tl.exp(beta + m_prev - tl.maximum(beta + m_prev, u))
    qt = _load_rows(q_ptr + _seq_base(bh, 0, T, H, K), rows, rmask, offs_k, mk, H * K).to(tl.float32)
    dht = _load_rows(dh_ptr + _seq_base(bh, 0, T, H, V), rows, rmask, offs_v, mv, H * V)
    _store_local(dc_ptr, dn_ptr, bh64 * NC + c, _dot_l(tl.trans(qt * (sea * rd)[:, None]), dht, UPD_MODE, PREC),
                 tl.sum(qt * (sea * gg)[:, None], axis=0), offs_k, mk, offs_v, mv, pid_v, K, V)


@triton.jit
def _scan_part(loc_ptr, init_ptr, out_ptr, fin_ptr, beta_ptr, blo_ptr, ms_ptr, bh64, pid, NC, N,
               L: tl.constexpr, BE: tl.constexpr, G: tl.constexpr,
               HAS_INIT: tl.constexpr, REVERSE: tl.constexpr):
    """BE elements of one b·h's flattened state of N elements, chained over the chunks with
    the decays e^{b_c} = e^{β_L + m_c − m_{c+1}}.
    Forward: X_{c+1} = e^{b_c} X_c + loc_c, X_0 = init; out[c] = X_c, fin = X_NC.
    Reverse: Y_c = e^{b_c} Y_{c+1} + loc_c, Y_NC = init; out[c] = Y_{c+1}, fin = Y_0."""
    offs = pid * BE + tl.arange(0, BE)
    me = offs < N
    jg = tl.arange(0, G)
    if HAS_INIT:
        carry = tl.load(init_ptr + bh64 * N + offs, mask=me, other=0.0).to(tl.float32)
    else:
        carry = tl.zeros([BE], dtype=tl.float32)
    first = NC - 1 if REVERSE else 0
    tl.store(out_ptr + (bh64 * NC + first) * N + offs, carry.to(out_ptr.dtype.element_ty), mask=me)
    for g0 in range(0, NC, G):
        if REVERSE:
            cc = NC - 1 - g0 - jg                       # decreasing chunks along the scan
            ok = cc >= 0
        else:
            cc = g0 + jg
            ok = cc < NC
        last = bh64 * NC * L + cc * L + L - 1
        blog = tl.load(beta_ptr + last, mask=ok, other=0.0) + tl.load(blo_ptr + last, mask=ok, other=0.0) + \
            tl.load(ms_ptr + bh64 * (NC + 1) + cc, mask=ok, other=0.0) - \
            tl.load(ms_ptr + bh64 * (NC + 1) + cc + 1, mask=ok, other=0.0)
        dec = tl.where(ok, tl.exp(blog), 1.0)           # masked chunks: the identity map
        X = tl.load(loc_ptr + (bh64 * NC + cc)[:, None] * N + offs[None, :], mask=ok[:, None] & me[None, :], other=0.0)
        A, Bs = tl.associative_scan((tl.broadcast_to(dec[:, None], (G, BE)), X), 0, _affine_combine)
        S = A * carry[None, :] + Bs                      # state after each chunk of the group
        dst = (cc - 1) if REVERSE else (cc + 1)
        tl.store(out_ptr + (bh64 * NC + dst)[:, None] * N + offs[None, :], S.to(out_ptr.dtype.element_ty),
                 mask=(ok & (dst >= 0) & (dst < NC))[:, None] & me[None, :])
        carry = tl.sum(tl.where(jg[:, None] == G - 1, S, 0.0), axis=0)
    tl.store(fin_ptr + bh64 * N + offs, carry, mask=me)


@triton.jit
def _state_scan(
    lc_ptr, ln_ptr, c0_ptr, n0_ptr, cs_ptr, ns_ptr, cf_ptr, nf_ptr, beta_ptr, blo_ptr, ms_ptr,
    NC, K, KV,
    L: tl.constexpr, BE: tl.constexpr, G: tl.constexpr,
    HAS_INIT: tl.constexpr, REVERSE: tl.constexpr,
):
    """The C part ([K, V] flattened, BE elements per program) and, in the program after the
    last C block, the n part ([K]) of the chained states of one b·h; see _scan_part."""
    pid = tl.program_id(0)
    bh64 = tl.program_id(1).to(tl.int64)
    n_c = tl.cdiv(KV, BE)
    if pid < n_c:
        _scan_part(lc_ptr, c0_ptr, cs_ptr, cf_ptr, beta_ptr, blo_ptr, ms_ptr, bh64, pid, NC, KV,
                   L, BE, G, HAS_INIT, REVERSE)
    else:
        for p in range(0, tl.cdiv(K, BE)):
            _scan_part(ln_ptr, n0_ptr, ns_ptr, nf_ptr, beta_ptr, blo_ptr, ms_ptr, bh64, p, NC, K,
                       L, BE, G, HAS_INIT, REVERSE)


def use_scan(cfg, BH: int, K: int, V: int, NC: int, dev) -> bool:
    """cfg.seq_scan: True, False, or "auto": the scan path when the sequential kernels would be
    latency-bound, i.e. many chunk steps (NC ≥ 64) on a grid of fewer than two programs per SM
    (64×64 state tiles × B·H). Elsewhere the sequential kernels were as fast or faster on the
    H200 and need no [B,H,NC,K,V] float32 buffer for the local terms."""
    mode = cfg.seq_scan
    if mode != "auto":
        return mode
    n_sm = _sm_count(dev) if dev.type == "cuda" else 132
    return NC >= 64 and triton.cdiv(K, 64) * triton.cdiv(V, 64) * BH < 2 * n_sm


def _sm_count(dev) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count


def _scan(lc, ln, init_c, init_n, out_c, out_n, fin_c, fin_n, beta, blo, ms, cfg, reverse):
    """One _state_scan launch over the local terms lc [B,H,NC,K,V], ln [B,H,NC,K]."""
    B, H, NC, K, V = lc.shape
    has_init = init_c is not None
    BE = cfg.scan_be
    _state_scan[(triton.cdiv(K * V, BE) + 1, B * H)](
        lc, ln, init_c if has_init else ms, init_n if has_init else ms, out_c, out_n,
        fin_c, fin_n, beta, blo, ms,
        NC, K, K * V,
        L=cfg.chunk, BE=BE, G=cfg.scan_g, HAS_INIT=has_init, REVERSE=reverse,
        num_warps=cfg.scan_warps,
    )


def fwd_states_scan(k, v, beta, blo, ig, u, C0, n0, m0, out, cfg, upd, prec):
    """The forward state passing of states.fwd_states (same out) as _m_chain, _fwd_local and a
    forward _state_scan."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    cs, ns, ms, cf, nf, mf = out
    NC = cs.shape[2]
    L = cfg.chunk
    _m_chain[(B * H,)](beta, blo, u, m0, ms, mf, NC, L=L, BN=max(16, min(1024, pow2(NC))), num_warps=4)
    lc = torch.empty(B, H, NC, K, V, device=k.device, dtype=torch.float32)
    ln = torch.empty(B, H, NC, K, device=k.device, dtype=torch.float32)
    BK, BV = cfg.local_bk, cfg.local_bv
    _fwd_local[(NC, triton.cdiv(K, BK) * triton.cdiv(V, BV), B * H)](
        k, v, beta, blo, ig, ms, lc, ln, T, H, NC, k.stride(1), v.stride(1),
        K=K, V=V, L=L, BK=BK, BV=BV, UPD_MODE=upd, PREC=prec,
        num_warps=cfg.local_warps, num_stages=1,
    )
    _scan(lc, ln, C0, n0, cs, ns, cf, nf, beta, blo, ms, cfg, False)


def bwd_dstates_scan(q, dh, beta, blo, u, rd, g, ms, dCf, dnf, out, cfg, upd, prec):
    """The backward state passing of states.bwd_dstates (same out) as _bwd_local and a reverse
    _state_scan."""
    B, T, H, K = q.shape
    V = dh.shape[-1]
    dcs, dns, dC0, dn0 = out
    NC = dcs.shape[2]
    lc = torch.empty(B, H, NC, K, V, device=q.device, dtype=torch.float32)
    ln = torch.empty(B, H, NC, K, device=q.device, dtype=torch.float32)
    BK, BV = cfg.local_bk, cfg.local_bv
    _bwd_local[(NC, triton.cdiv(K, BK) * triton.cdiv(V, BV), B * H)](
        q, dh, beta, u, rd, g, ms, lc, ln, T, H, NC, K ** -0.5,
        K=K, V=V, L=cfg.chunk, BK=BK, BV=BV, UPD_MODE=upd, PREC=prec,
        num_warps=cfg.local_warps, num_stages=1,
    )
    _scan(lc, ln, dCf, dnf, dcs, dns, dC0, dn0, beta, blo, ms, cfg, True)
