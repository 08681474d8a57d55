"""Helpers shared by the DPLR kernels: the low-precision product `_mm` and the one offset rule.

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
