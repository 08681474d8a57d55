"""Helpers shared by the mLSTM kernels: the padded-step constant, the two product forms and
the offset of a sequence tensor's rows."""
from __future__ import annotations

import triton
import triton.language as tl

# Finite "minus infinity" for the input gate of padded steps: exp() of it is 0 and, unlike
# -inf, it never meets another infinity in a subtraction (no NaN).
NEG = -1e30
_NEG = tl.constexpr(NEG)  # the same, visible inside kernels (a module-level float is not)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def _seq_base(bh, row0, T, H, D):
    """int64 element offset of (b, row0, h, 0) in a contiguous [B, T, H, D] tensor, b·h = bh;
    row t of that head is then + t·(H·D)."""
    return _row_base(bh, row0, T, H, D, H * D)


@triton.jit
def _row_base(bh, row0, T, H, D, ST):
    """_seq_base for a [B, T, H, D] tensor whose rows (tokens) are ST elements apart (batch
    stride T·ST, heads packed): q, k, v as column slices of one projection GEMM's output."""
    b = bh // H
    h = bh % H
    return (b.to(tl.int64) * T + row0) * ST + h * D


@triton.jit
def _dot_l(a, b, MODE: tl.constexpr, PREC: tl.constexpr):
    """a (float32, weighted or a state) @ b (input dtype). MODE 0: a rounded to b's dtype;
    1: a split into two parts of b's dtype (hi + lo, ~16 more bits for one more product);
    2: float32 operands at PREC."""
    if MODE == 0:
        return tl.dot(a.to(b.dtype), b, input_precision=PREC)
    elif MODE == 1:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        return tl.dot(lo, b, acc=tl.dot(hi, b, input_precision=PREC), input_precision=PREC)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _dot_r(a, b, MODE: tl.constexpr, PREC: tl.constexpr):
    """a (input dtype) @ b (float32 or stored state); modes as in _dot_l."""
    if MODE == 0:
        return tl.dot(a, b.to(a.dtype), input_precision=PREC)
    elif MODE == 1:
        hi = b.to(a.dtype)
        lo = (b.to(tl.float32) - hi.to(tl.float32)).to(a.dtype)
        return tl.dot(a, lo, acc=tl.dot(a, hi, input_precision=PREC), input_precision=PREC)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _affine_combine(a1, b1, a2, b2):
    """Compose g ↦ b2 + a2·g after g ↦ b1 + a1·g (the left operand is the later step)."""
    return a2 * a1, b2 + a2 * b1


@triton.jit
def _span(i, B: tl.constexpr, N):
    """Tile i of width B along an extent N: its offsets [B] and their in-bounds mask."""
    offs = i * B + tl.arange(0, B)
    return offs, offs < N


@triton.jit
def _chunk_program(c_off, T, NC, tab_ptr, L: tl.constexpr, BH_AXIS: tl.constexpr, VARLEN: tl.constexpr):
    """Chunk c = program 0 + c_off of b·h = program BH_AXIS: (c, bh, bh64, offs_l [L], rows [L]
    (its steps in the [B, T, ...] inputs), rmask (rows inside its sequence), g_base (the b·h's
    start in the [B,H,NC·L] per-row tensors), prow [L] (the chunk's rows there, c·L + offs_l),
    row0 (its first step), seq (its sequence; −1 for a spare chunk of the varlen table)).
    VARLEN (batch 1, b·h = h): rows, rmask and seq from the chunk table tab_ptr (varlen.py);
    else rows = prow, rmask = rows < T, seq = 0."""
    c = tl.program_id(0) + c_off
    bh = tl.program_id(BH_AXIS)
    bh64 = bh.to(tl.int64)
    offs_l = tl.arange(0, L)
    prow = c * L + offs_l
    if VARLEN:
        seq = tl.load(tab_ptr + c * 4)
        row0 = tl.load(tab_ptr + c * 4 + 1)
        end = tl.load(tab_ptr + c * 4 + 2)
    else:
        seq = c * 0
        row0 = c * L
        end = T
    rows = row0 + offs_l
    return c, bh, bh64, offs_l, rows, rows < end, bh64 * NC * L, prow, row0, seq


@triton.jit
def _seq_program(pid, sinfo_ptr, T, H, NC, VARLEN: tl.constexpr):
    """The sequence walked by program `pid` of a kernel that runs along whole sequences (one
    program per b·h, or per n·H + h with VARLEN): (hb, n, bos, eos, c0, c1): hb the head's
    b·h in the [B,T,H,...] inputs and [B,H,...] per-chunk tensors, n its sequence, rows
    [bos, eos), global chunks [c0, c1). Without VARLEN: (pid, 0, 0, T, 0, NC)."""
    if VARLEN:
        n = pid // H
        hb = pid % H
        bos = tl.load(sinfo_ptr + n * 4)
        eos = tl.load(sinfo_ptr + n * 4 + 1)
        c0 = tl.load(sinfo_ptr + n * 4 + 2)
        c1 = tl.load(sinfo_ptr + n * 4 + 3)
    else:
        n = 0
        hb = pid
        bos = 0
        eos = T
        c0 = 0
        c1 = NC
    return hb, n, bos, eos, c0, c1


@triton.jit
def _load_rows(base, rows, rmask, offs, m, HD):
    """Tile [rows, offs] of one head of a [B, T, H, D] tensor at base (HD = H·D), zeros outside
    rmask × m, in the tensor's dtype."""
    return tl.load(base + rows[:, None] * HD + offs[None, :], mask=rmask[:, None] & m[None, :], other=0.0)
