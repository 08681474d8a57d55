"""Gate prologue (_gate_prep: β, ĩ, u and the max-chain flags per chunk) and gate epilogue
(_gate_tail: the stabilizers' influence on δi, δf, routed along the max chain)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _NEG, _affine_combine, _chunk_program, _seq_base, _seq_program


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _gate_prep(
    i_ptr, f_ptr, hi_ptr, lo_ptr, ig_ptr, u_ptr, x_ptr, tab_ptr,
    T, H, NC,
    L: tl.constexpr, VARLEN: tl.constexpr,
):
    """Gate tensors of one chunk of one b·h: from i, f [B,T,H] (any float dtype) writes β =
    in-chunk cumsum of log σ(f) as two float32 parts (hi, lo), ĩ and u = β + cummax(ĩ − β) in
    float32, all [B,H,NC·L], and xm [B,H,NC·L] float64: x = ĩ − β where x tops every earlier x
    of its chunk (a new running max), else NEG. Step t took the carried branch of the
    stabilizer's max unless xm_t ≥ m_c (see _gate_tail). Padded steps (past the sequence's
    end, and every step of a spare varlen chunk): log f = 0, ĩ = NEG."""
    c, bh, bh64, offs_l, rows, rm, g_base, prow, row0, seq = _chunk_program(0, T, NC, tab_ptr, L, 1, VARLEN)
    src = _seq_base(bh, 0, T, H, 1) + rows.to(tl.int64) * H
    fv = tl.load(f_ptr + src, mask=rm, other=0.0).to(tl.float64)
    iv = tl.load(i_ptr + src, mask=rm, other=0.0).to(tl.float64)
    # log σ(f) = min(f, 0) − log(1 + e^{−|f|}); in float64 the log of 1 + tiny loses nothing
    # that matters for β (absolute error ≤ 1e-16 per step)
    lf = tl.minimum(fv, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(fv)))
    lf = tl.where(rm, lf, 0.0)
    ig = tl.where(rm, iv, _NEG)
    beta = tl.cumsum(lf, axis=0)
    x = ig - beta
    cm = tl.associative_scan(x, 0, _max_combine)
    u = beta + cm
    hi = beta.to(tl.float32)
    lo = (beta - hi.to(tl.float64)).to(tl.float32)
    dst = g_base + prow
    tl.store(hi_ptr + dst, hi)
    tl.store(lo_ptr + dst, lo)
    tl.store(ig_ptr + dst, ig.to(tl.float32))
    tl.store(u_ptr + dst, u.to(tl.float32))
    tl.store(x_ptr + dst, tl.where(x == cm, x, _NEG))


@triton.jit
def _gate_tail(
    r_ptr, xm_ptr, ms_ptr, dlf_ptr, di_ptr, f_ptr, elast_ptr,
    dio_ptr, dfo_ptr, dm0_ptr, sinfo_ptr,
    T, H, NC, NCL, NS, eps,
    L: tl.constexpr, BT: tl.constexpr, HAS_LAST: tl.constexpr, VARLEN: tl.constexpr,
):
    """Gate gradients of one b·h with the stabilizers' influence added. δm_t = −eps·r_t
    (+ elast at t = T−1) is routed along m_t = max(log f_t + m_{t−1}, ĩ_t):
    G_t = δm_t + A_{t+1} G_{t+1}, where A_t (log f_t + m_{t−1} realised the max) is ¬(xm_t ≥
    m_c) on the forward's own values (see _gate_prep). Then δĩ_t = di_t + ¬A_t G_t,
    δf_t = (dlf_t + A_t G_t)·σ(−f_t), written [B,T,H] in the output dtypes; δm_0 = A_0 G_0.
    Walks the sequence backwards in blocks of BT steps, each block's recurrence as one
    associative scan of affine maps over its steps in reverse time order (in the addressing,
    so the scan itself runs forward), the carry G entering from the later block.
    VARLEN: one program per n·H + h walks sequence n only (the chain starts at its own m_0 and
    ends at its own final m: nothing crosses a boundary); t below is the step within it."""
    pid = tl.program_id(0)
    hb, n, bos, eos, c0, c1 = _seq_program(pid, sinfo_ptr, T, H, NC, VARLEN)
    hb64 = hb.to(tl.int64)
    T_n = eos - bos
    idx = tl.arange(0, BT)
    carry = tl.zeros([1], dtype=tl.float64)
    seq0 = _seq_base(hb, bos, T, H, 1)
    pbase = hb64 * NCL + c0 * L                            # the sequence's first padded row
    msb = ms_ptr + hb64 * (NC + NS) + n + c0               # its chunk-start stabilizers
    NB = (T_n + BT - 1) // BT
    for jb in range(NB):
        blk = NB - 1 - jb
        t = blk * BT + (BT - 1) - idx                     # decreasing time along idx
        tm = t < T_n
        rowv = pbase + t
        nA = tl.load(xm_ptr + rowv, mask=tm, other=0.0) >= tl.load(msb + t // L, mask=tm, other=0.0)
        t1 = t + 1
        t1m = t1 < T_n
        nA1 = tl.load(xm_ptr + pbase + t1, mask=t1m, other=0.0) >= \
            tl.load(msb + t1 // L, mask=t1m, other=0.0)
        alpha = tl.where(t1m & (nA1 == 0), 1.0, 0.0).to(tl.float64)
        e = -eps * tl.load(r_ptr + rowv, mask=tm, other=0.0).to(tl.float64)
        if HAS_LAST:
            e += tl.where(t == T_n - 1, tl.load(elast_ptr + pid), 0.0).to(tl.float64)
        e = tl.where(tm, e, 0.0)
        ca, cb = tl.associative_scan((alpha, e), 0, _affine_combine)
        G = cb + ca * tl.sum(carry, axis=0)
        carry = tl.zeros([1], dtype=tl.float64) + tl.sum(tl.where(idx == BT - 1, G, 0.0), axis=0)
        lf_chain = tl.where(nA, 0.0, G)
        di = tl.load(di_ptr + rowv, mask=tm, other=0.0).to(tl.float64) + (G - lf_chain)
        fo = seq0 + t.to(tl.int64) * H
        fv = tl.load(f_ptr + fo, mask=tm, other=0.0).to(tl.float32)
        sg = 1.0 / (1.0 + tl.exp(fv))                      # σ(−f) in float32, as in PyTorch
        df = (tl.load(dlf_ptr + rowv, mask=tm, other=0.0).to(tl.float64) + lf_chain) * sg.to(tl.float64)
        tl.store(dio_ptr + fo, di.to(dio_ptr.dtype.element_ty), mask=tm)
        tl.store(dfo_ptr + fo, df.to(dfo_ptr.dtype.element_ty), mask=tm)
        tl.store(dm0_ptr + pid + idx * 0, lf_chain.to(tl.float32), mask=t == 0)


def gates_padded(i: torch.Tensor, f: torch.Tensor, L: int, vl=None):
    """i, f [B,T,H] (contiguous) → β as hi + lo float32 parts, ĩ, u, each [B,H,NC·L] float32,
    and xm [B,H,NC,L] float64 (see _gate_prep); one launch. vl: the varlen.ChunkTable of packed
    sequences (B = 1; NC = vl.nc chunks, each inside one sequence) or None.

    The in-chunk cumsum runs in float64 and β travels as two float32 parts because the kernels
    need β_t − β_s accurately: with closed forget gates |β| reaches hundreds within a chunk,
    and one float32 β would put an absolute error of ulp(|β|) (~1e-5) on every log weight (a
    100× larger error than the recurrent float32 loop on rows whose denominator nearly
    cancels)."""
    B, T, H = i.shape
    NC = triton.cdiv(T, L) if vl is None else vl.nc
    hi, lo, ig, u, x = out = gate_buffers(i, NC, L)
    _gate_prep[(NC, B * H)](i, f, hi, lo, ig, u, x, hi if vl is None else vl.tab, T, H, NC,
                            L=L, VARLEN=vl is not None, num_warps=1)
    return out


def gate_buffers(i: torch.Tensor, NC: int, L: int):
    """Unfilled β (hi, lo), ĩ, u [B,H,NC·L] float32 and xm [B,H,NC,L] float64 for i [B,T,H]."""
    B, _, H = i.shape
    hi = torch.empty(B, H, NC * L, device=i.device, dtype=torch.float32)
    x = torch.empty(B, H, NC, L, device=i.device, dtype=torch.float64)
    return hi, torch.empty_like(hi), torch.empty_like(hi), torch.empty_like(hi), x


def gate_tail(i, f, ms, xm, r, dlf, di, elast, eps, L, tail_bt, vl=None):
    """δi, δf [B,T,H] (in i's and f's dtype) and δm_0 [S,H] float32 from the fixed-stabilizer
    gate gradients dlf, di and the row factors r [B,H,NC·L] float32; elast [S,H] float64 is
    δm_T (or None). S = B, or the number of sequences of the varlen.ChunkTable vl (B = 1).
    One _gate_tail launch (one program per sequence and head)."""
    B, T, H = i.shape
    NS = 1 if vl is None else vl.n
    NC = ms.shape[-1] - NS
    S = B if vl is None else vl.n
    dio = torch.empty_like(i)
    dfo = torch.empty_like(f)
    dm0 = torch.empty(S, H, device=i.device, dtype=torch.float32)
    # 4096-step blocks (8 warps, 255 registers, no spill) when few b·h programs walk long
    # sequences: fewer sequential blocks per program
    BT = tail_bt or (4096 if S * H < 64 and T > 4096 else 1024)
    _gate_tail[(S * H,)](
        r, xm, ms, dlf, di, f, ms if elast is None else elast, dio, dfo, dm0, ms if vl is None else vl.sinfo,
        T, H, NC, NC * L, NS, eps,
        L=L, BT=BT, HAS_LAST=elast is not None, VARLEN=vl is not None, num_warps=4 if BT <= 1024 else 8,
    )
    return dio, dfo, dm0
