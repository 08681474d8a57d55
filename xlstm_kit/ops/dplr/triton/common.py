"""Helpers shared by the DPLR kernels: the low-precision product `_mm`, the one offset rule, the
reference-point decay factors of a pair-matrix column block and the accumulator set `_zeros4`.

Every tensor the kernels address is a contiguous [N, T, D] array (inputs and scratch in the chunk
layout [B·H, Tp, D], pair matrices [B·H·NC, L, L], chunk states [B·H·NC, K, V]); `_offs` gives
the flat offsets of one [rows, cols] tile of it and `_row` those of one row.
"""
from __future__ import annotations

import triton
import triton.language as tl

SUB = 16  # column sub-chunk of the pair matrices (the package docstring says why 16)


@triton.jit
def _offs(n, t0, rows, cols, T, D):
    """Offsets of the tile [t0 + rows, cols] of item n of a contiguous [N, T, D] array."""
    # the flat row index first, then × D: ptxas at sm_90a spills less with this form than with
    # n·T·D + (t0 + rows)·D (the hand-written offsets it replaced; NOTES-dplr.md, "Offsets")
    return (n * T + t0 + rows)[:, None] * D + cols[None, :]


@triton.jit
def _row(n, t, cols, T, D):
    """Offsets of row t, columns `cols`, of item n of a contiguous [N, T, D] array."""
    return (n * T + t) * D + cols


@triton.jit
def _ref_factors(G, Gx, py, bh, t_blk, kk, below, inblk, Tp, K, S: tl.constexpr):
    """The decay factors of one column block (steps t_blk … t_blk + S − 1) of the pair matrices,
    with the block's two reference points (package docstring, gate safety): rows below the block
    take G_end, rows inside it G_mid. Gx [L, BK]: the chunk's G (float64); py: the offsets of the
    block's rows [S, BK] in G; kk: the BK channels. Returns fx_off, fx_in [L, BK] (0 outside
    their rows) and fy_off (≤ 1), fy_in (≤ e^{40}) [S, BK], all float32."""
    g_end = tl.load(G + _row(bh, t_blk + S - 1, kk, Tp, K))
    g_mid = tl.load(G + _row(bh, t_blk + S // 2 - 1, kk, Tp, K))
    fx_off = tl.exp(tl.where(below[:, None], Gx - g_end[None, :], float("-inf")).to(tl.float32))
    fx_in = tl.exp(tl.where(inblk[:, None], Gx - g_mid[None, :], float("-inf")).to(tl.float32))
    Gy = tl.load(G + py)
    fy_off = tl.exp((g_end[None, :] - Gy).to(tl.float32))
    fy_in = tl.exp((g_mid[None, :] - Gy).to(tl.float32))
    return fx_off, fx_in, fy_off, fy_in


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
