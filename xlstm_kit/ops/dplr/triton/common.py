"""Helpers shared by the DPLR kernels: the low-precision product `_mm`, the one offset rule, the
reference-point decay factors of a pair-matrix column block and the accumulator set `_zeros4`.

Scratch tensors are contiguous [N, T, D] arrays (the chunk layout [B·H, Tp, D], pair matrices
[B·H·NC, L, L], chunk states [B·H·NC, K, V]); `_offs` gives the flat offsets of one [rows, cols]
tile of them and `_row` those of one row. The inputs and outputs of both ops (q, k, v, a, b, β,
δO; o and every gradient) stay in the caller's contiguous [B, T, H, D] layout (row stride H·D;
β [B, T, H]) and are addressed by the second rule, `_x_ld` / `_x_st` (a per-program base pointer
plus 32-bit tile offsets): no layout copies around the kernels, and the steps ≥ T of the last,
padded chunk are masked on load (read as the zeros a padded copy would hold) and on store.

Packed sequences (VARLEN, cu_seqlens; B = 1, Tp = T, no padding): chunk n is the table row
(sequence, first row t0, end row) of mlstm/triton/varlen.py, so a chunk never crosses a boundary.
Its rows past the sequence's end (nv valid rows) are loaded as zeros and never stored, and G is
read at the last valid row there: exactly the zero-padded steps (gk = 0, G constant) the last
chunk of an unpacked sequence has, so the per-chunk maths is unchanged. Without VARLEN chunk n
is rows n·L … n·L + L − 1 and the helpers below compile to the unmasked forms.
"""
from __future__ import annotations

import triton
import triton.language as tl

SUB = 16  # column sub-chunk of the pair matrices (the package docstring says why 16)


@triton.jit
def _offs(n, t0, rows, cols, T, D):
    """Offsets of the tile [t0 + rows, cols] of item n of a contiguous [N, T, D] array."""
    # the flat row index first, then × D: ptxas at sm_90a spills less with this form than with
    # n·T·D + (t0 + rows)·D (the hand-written offsets it replaced; docs/kernels.md, "DPLR and KDA")
    return (n * T + t0 + rows)[:, None] * D + cols[None, :]


@triton.jit
def _row(n, t, cols, T, D):
    """Offsets of row t, columns `cols`, of item n of a contiguous [N, T, D] array."""
    return (n * T + t) * D + cols


@triton.jit
def _x_base(x, bh, t0, T, H, D):
    """Pointer to step t0 of head bh % H, batch bh // H, of a contiguous [B, T, H, D] array (the
    caller's layout); the tiles below add 32-bit offsets to it."""
    return x + ((bh // H * T + t0) * H + bh % H) * D


@triton.jit
def _x_mask(t0, rows, nv, T):
    """Rows < nv (past a packed sequence's end) at steps < T (the padded last chunk)."""
    return (rows < nv) & (t0 + rows < T)


@triton.jit
def _x_ld(x, bh, t0, rows, cols, nv, T, H, D):
    """The tile [t0 + rows, cols] of head b·h of a contiguous [B, T, H, D] array, zeros where
    `_x_mask` is false (the zero padding of the chunk layout)."""
    # rows clamped to step T − 1 (in bounds even when t0 ≥ T: a column block past the end) and
    # zeroed by a select, not a masked load: on the H200 the key-gradient pair kernels run
    # 0.3-0.7 ms faster with it (the forward pair kernels slower: docs/kernels.md, "DPLR and KDA")
    p = _x_base(x, bh, t0, T, H, D) + tl.minimum(rows, T - 1 - t0)[:, None] * (H * D) + cols[None, :]
    return tl.where(_x_mask(t0, rows, nv, T)[:, None], tl.load(p), 0.0)


@triton.jit
def _x_ld1(x, bh, t0, rows, nv, T, H):
    """Steps t0 + rows of head b·h of a contiguous [B, T, H] array (β), masked as `_x_ld`."""
    return tl.load(_x_base(x, bh, t0, T, H, 1) + rows * H, mask=_x_mask(t0, rows, nv, T), other=0.0)


@triton.jit
def _x_st(x, val, bh, t0, rows, cols, nv, T, H, D):
    """Stores the tile `val` at [t0 + rows, cols] of head b·h of a contiguous [B, T, H, D] array
    (cast to its dtype), where `_x_mask` is true."""
    p = _x_base(x, bh, t0, T, H, D) + rows[:, None] * (H * D) + cols[None, :]
    tl.store(p, val, mask=_x_mask(t0, rows, nv, T)[:, None])


@triton.jit
def _chunk_rows(tab, n, L: tl.constexpr, VARLEN: tl.constexpr):
    """(seq, t0, nv) of chunk n: its sequence (−1: a spare chunk of the varlen table, which does
    nothing), its first row and its number of valid rows (≤ L)."""
    if VARLEN:
        seq = tl.load(tab + n * 4)
        t0 = tl.load(tab + n * 4 + 1)
        nv = tl.minimum(tl.load(tab + n * 4 + 2) - t0, L)
    else:
        seq = 0
        t0 = n * L
        nv = L
    return seq, t0, nv


@triton.jit
def _chunk_prog(tab, n, bh, L: tl.constexpr, VARLEN: tl.constexpr):
    """The prologue of a per-chunk program (chunk n, b·h bh): (bh as int64, seq, t0, nv, rows [L],
    m1 [L] the valid rows, m = m1 [L, 1]). seq < 0: a spare chunk of the varlen table — the
    kernel returns."""
    seq, t0, nv = _chunk_rows(tab, n, L, VARLEN)
    rows = tl.arange(0, L)
    m1 = rows < nv
    return bh.to(tl.int64), seq, t0, nv, rows, m1, m1[:, None]


@triton.jit
def _pair_block(tab, L: tl.constexpr, S: tl.constexpr, VARLEN: tl.constexpr):
    """The prologue of a pair-matrix program (grid: chunk × L/S column blocks, b·h): (n, j0, bh,
    seq, t0, nv, rows [L], cols [S], mx [L, 1], my [S, 1] the valid rows and block columns, below
    and inblk [L] the rows below / inside the block)."""
    pid = tl.program_id(0)
    n = pid // (L // S)
    j0 = (pid % (L // S)) * S
    bh, seq, t0, nv, rows, m1, mx = _chunk_prog(tab, n, tl.program_id(1), L, VARLEN)
    cols = tl.arange(0, S)
    my = (j0 + cols < nv)[:, None]
    below = rows >= j0 + S
    inblk = (rows >= j0) & (rows < j0 + S)
    return n, j0, bh, seq, t0, nv, rows, cols, mx, my, below, inblk


@triton.jit
def _seq_chunks(sinfo, H, NC, VARLEN: tl.constexpr):
    """The program of a sequential state kernel (grid: V-tile, b·h, or n·H + h with VARLEN):
    (lay, sid, c0, c1): lay the b·h of the chunk-layout tensors (h with VARLEN: batch 1), sid the
    row of the [B·H or N·H, K, V] initial/final states, [c0, c1) the chunks it walks."""
    pid = tl.program_id(1)
    if VARLEN:
        s = pid // H
        lay = (pid % H).to(tl.int64)
        c0 = tl.load(sinfo + s * 4 + 2)
        c1 = tl.load(sinfo + s * 4 + 3)
    else:
        lay = pid.to(tl.int64)
        c0 = 0
        c1 = NC
    return lay, pid.to(tl.int64), c0, c1


@triton.jit
def _ld(p, m, VARLEN: tl.constexpr):
    """tl.load(p), zeros where the mask m is false with VARLEN (rows past the sequence's end)."""
    if VARLEN:
        x = tl.load(p, mask=m, other=0.0)
    else:
        x = tl.load(p)
    return x


@triton.jit
def _st(p, x, m, VARLEN: tl.constexpr):
    """tl.store(p, x), only where the mask m is true with VARLEN."""
    if VARLEN:
        tl.store(p, x, mask=m)
    else:
        tl.store(p, x)


@triton.jit
def _last(rows, nv, VARLEN: tl.constexpr):
    """Rows (of one chunk) clamped to its last valid row: where G is read (module docstring)."""
    if VARLEN:
        r = tl.minimum(rows, nv - 1)
    else:
        r = rows
    return r


@triton.jit
def _g_fallback(Gc):
    """[BK]: the last finite value of each column of a chunk's G [L, BK] (0 if none). A NaN
    log-decay makes G NaN from its step to the chunk's end; G is non-increasing, so the last
    finite value is the smallest (the clamp of gk to ≤ 0 in the public ops guarantees that)."""
    return tl.min(tl.where(Gc == Gc, Gc, 0.0), axis=0)


@triton.jit
def _finite_g(g, fallback):
    """g with NaN (g != g) replaced by `fallback` (`_g_fallback`, broadcast to g's shape).

    What the products over a chunk's steps take (pair matrices, B ⊙ e^G): in a dot a NaN at step
    t would reach the rows before t through their zero entries (0·NaN), i.e. travel backwards
    in time; as if those log-decays were 0 every factor keeps its bound. The NaN itself reaches
    the outputs from t on through Q ⊙ e^G and the state through e^{G_L}, which keep it
    (../chunkwise.py, `finite_log_gamma`, the same rule)."""
    return tl.where(g == g, g, fallback)


@triton.jit
def _ref_factors(G, Gx, py, bh, t0, j0, kk, below, inblk, nv, Tp, K, S: tl.constexpr,
                 VARLEN: tl.constexpr):
    """The decay factors of one column block (steps t0 + j0 … t0 + j0 + S − 1) of the pair
    matrices, with the block's two reference points (package docstring, gate safety): rows below
    the block take G_end, rows inside it G_mid. Gx [L, BK]: the chunk's G (float64); py: the
    offsets of the block's rows [S, BK] in G; kk: the BK channels; nv: the chunk's valid rows. Returns fx_off, fx_in [L, BK] (0 outside their rows)
    and fy_off (≤ 1), fy_in (≤ e^{40}) [S, BK], all float32. The pair matrices take G without its
    NaNs (`_finite_g`)."""
    g_fin = _g_fallback(Gx)
    Gx = _finite_g(Gx, g_fin)
    g_end = _finite_g(tl.load(G + _row(bh, t0 + _last(j0 + S - 1, nv, VARLEN), kk, Tp, K)), g_fin)
    g_mid = _finite_g(tl.load(G + _row(bh, t0 + _last(j0 + S // 2 - 1, nv, VARLEN), kk, Tp, K)), g_fin)
    fx_off = tl.exp(tl.where(below[:, None], Gx - g_end[None, :], float("-inf")).to(tl.float32))
    fx_in = tl.exp(tl.where(inblk[:, None], Gx - g_mid[None, :], float("-inf")).to(tl.float32))
    if VARLEN:
        Gy = tl.load(G + _offs(bh, t0, _last(j0 + tl.arange(0, S), nv, VARLEN), kk, Tp, K))
    else:
        Gy = tl.load(G + py)
    Gy = _finite_g(Gy, g_fin[None, :])
    fy_off = tl.exp((g_end[None, :] - Gy).to(tl.float32))
    fy_in = tl.exp((g_mid[None, :] - Gy).to(tl.float32))
    return fx_off, fx_in, fy_off, fy_in


@triton.jit
def _sub_block(tab, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, VARLEN: tl.constexpr):
    """The prologue of a key-gradient pair program (grid: chunk × L/S sub-chunks, K-tile, b·h):
    (n, i, bh, seq, t0, nv, sr [S] = 0 … S − 1, ri [S] the rows of sub-chunk i, kr [BK] the
    K-tile's channels); seq < 0: a spare chunk of the varlen table — the kernel returns."""
    pid = tl.program_id(0)
    n = pid // (L // S)
    i = pid % (L // S)
    bh, seq, t0, nv, _, _, _ = _chunk_prog(tab, n, tl.program_id(2), L, VARLEN)
    sr = tl.arange(0, S)
    return n, i, bh, seq, t0, nv, sr, i * S + sr, tl.program_id(1) * BK + tl.arange(0, BK)


@triton.jit
def _sub_refs(G, bh, t0, i0, kk, nv, Tp, K, S: tl.constexpr, VARLEN: tl.constexpr):
    """The reference points of the key gradient's pair kernels for the S rows i0 … i0 + S − 1
    (one sub-chunk) and the BK channels kk: (Gi [S, BK] their G, g_end [BK] G at their last row,
    fx, fy [S, BK] the factors of the diagonal block, e^{Gi − G_mid} and e^{G_mid − Gi})."""
    Gi = tl.load(G + _offs(bh, t0, _last(i0 + tl.arange(0, S), nv, VARLEN), kk, Tp, K))
    g_end = tl.load(G + _row(bh, t0 + _last(i0 + S - 1, nv, VARLEN), kk, Tp, K))
    g_mid = tl.load(G + _row(bh, t0 + _last(i0 + S // 2 - 1, nv, VARLEN), kk, Tp, K))
    return (Gi, g_end, tl.exp((Gi - g_mid[None, :]).to(tl.float32)),
            tl.exp((g_mid[None, :] - Gi).to(tl.float32)))


@triton.jit
def _earlier_refs(G, Gi, bh, t0, j0, kk, nv, Tp, K, S: tl.constexpr, VARLEN: tl.constexpr):
    """The factors of an earlier block j0 … j0 + S − 1 (reference: its last row, G_e) for rows of
    G Gi [S, BK] below it: (e^{Gi − G_e} for those rows, e^{G_e − G_j} for the block's rows)."""
    ge = tl.load(G + _row(bh, t0 + _last(j0 + S - 1, nv, VARLEN), kk, Tp, K))
    Gj = tl.load(G + _offs(bh, t0, _last(j0 + tl.arange(0, S), nv, VARLEN), kk, Tp, K))
    ey = tl.exp((ge[None, :] - Gj).to(tl.float32))
    return tl.exp((Gi - ge[None, :]).to(tl.float32)), ey


@triton.jit
def _dk_state_side(G, U, V2, Hs, dO, dH, GCb, bh, n, t0, nv, rows, m, kr, Tp, NC, T, H,
                   K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr, VARLEN: tl.constexpr,
                   GEN: tl.constexpr):
    """The state-side part of the key gradient for one chunk and K-tile `kr`: the chunk's G and
    its decays (Gc, e^G, e^{G_L − G}, e^{G_L}), U δh'ᵀ, V2 δh'ᵀ, δO hᵀ, −GC hᵀ ([L, BK] each)
    and Σ_v h⊙δh' ([BK]). The general op (GEN): U = v (the caller's layout, as δO), its δKd and
    δAd apart; KDA: U = β v + V2 (scratch; a = k merges them), V2 unused and its product zero."""
    Gc = tl.load(G + _offs(bh, t0, _last(rows, nv, VARLEN), kr, Tp, K))
    g_last = tl.load(G + _row(bh, t0 + nv - 1, kr, Tp, K))
    eG = tl.exp(Gc.to(tl.float32))
    dec = tl.exp((g_last[None, :] - Gc).to(tl.float32))
    eGl = tl.exp(g_last.to(tl.float32))
    dKU, dAd, dQg, GW = _zeros4(L, BK)
    hdh = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = _offs(bh, t0, rows, vv, Tp, V)
        ph = _offs(bh * NC + n, 0, kr, vv, K, V)
        hs = tl.load(Hs + ph)
        dh = tl.load(dH + ph)
        if GEN:
            u = _x_ld(U, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        else:
            u = _ld(U + pv, m, VARLEN)
        dKU += _mm(u, tl.trans(dh), LO, PREC)
        if GEN:
            dAd += _mm(_ld(V2 + pv, m, VARLEN), tl.trans(dh), LO, PREC)
        do = _x_ld(dO, bh, t0, rows, vv, nv, T, H, V).to(tl.float32)
        dQg += _mm(do, tl.trans(hs), LO, PREC)
        GW -= _mm(_ld(GCb + pv, m, VARLEN), tl.trans(hs), LO, PREC)
        hdh += tl.sum(hs * dh, axis=1)
    return Gc, eG, dec, eGl, dKU, dAd, dQg, GW, hdh


@triton.jit
def _gate_grad(up, down, eGl, hdh):
    """δgk of one chunk and K-tile from its terms grouped by which gk_j each factor contains
    (chunkwise.py explains why): up [L, BK] (e^{G_r} factors, and the pairs e^{G_r − G_i} as +at
    r, −at i) → reverse cumsum; down [L, BK] (e^{G_L − G_r}) → exclusive forward cumsum;
    Diag(γ_L) h (e^{G_L} [BK] times Σ_v h⊙δh' [BK]) → every row."""
    dgk = tl.cumsum(up, axis=0, reverse=True) + (tl.cumsum(down, axis=0) - down)
    return dgk + (eGl * hdh)[None, :]


@triton.jit
def _zeros4(M: tl.constexpr, N: tl.constexpr):
    """Four float32 [M, N] accumulators (one per pair matrix A_qk, A_qa, A_bk, A_ba, or per
    operand gradient)."""
    return (tl.zeros([M, N], dtype=tl.float32), tl.zeros([M, N], dtype=tl.float32),
            tl.zeros([M, N], dtype=tl.float32), tl.zeros([M, N], dtype=tl.float32))


@triton.jit
def _mm(x, y, LO: tl.constexpr, PREC: tl.constexpr):
    """Product of float32 tiles for results that only reach 16-bit outputs (package docstring,
    "Precision modes"): LO = 0 at PREC, 1 single-pass TF32, 2 bfloat16 operands, 3 float16
    operands (tests under the interpreter, which has no bfloat16); float32 accumulation always."""
    if LO == 1:
        r = tl.dot(x, y, input_precision="tf32")
    elif LO == 2:
        r = tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16))
    elif LO == 3:
        r = tl.dot(x.to(tl.float16), y.to(tl.float16))
    else:
        r = tl.dot(x, y, input_precision=PREC)
    return r
