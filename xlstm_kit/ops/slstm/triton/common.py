"""Pieces shared by the sLSTM forward and backward kernels: activations, masked loads, the
split-precision matmul, the R tiles, and the per-gate tuple helpers.

The four gates (i, f, z, o) travel through the kernels as a tuple of four [BD, BT] tiles; every
per-gate operation is one `tl.static_range(4)` loop, unrolled at compile time into the same
code the hand-unrolled kernels had (same registers, same instruction order). `_tile` and
`_ld_init` (the program prologue both kernels share) left ptxas's report at sm_90a unchanged and
the kernels' PTX byte-identical (bf16 D=128, fp32 D=64, bf16 D=256: docs/kernels.md, "DPLR and KDA",
"shared kernel code as helpers").
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    # Through exp so that it runs in the interpreter too; exp overflow saturates to ±1 correctly.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _log_sigmoid(x):
    return tl.minimum(x, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _mm(r_hi, r_lo, v, acc, MM: tl.constexpr):
    """acc + r @ v; r [M, K] (weights), v [K, BT] in the state dtype.

    MM 0: one dot in the state dtype (interpreter, float64). MM 1: r is bf16 (exact); v is split
    into a bf16 head and tail so the product keeps ~16 mantissa bits. MM 2: r is split as well
    (r_hi + r_lo); the tail x tail term is below float32 rounding and is skipped.
    """
    if MM == 0:
        acc = tl.dot(r_hi, v, acc, input_precision="ieee", out_dtype=acc.dtype)
    else:
        v_hi = v.to(tl.bfloat16)
        v_lo = (v - v_hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(r_hi, v_hi, acc)
        acc = tl.dot(r_hi, v_lo, acc)
        if MM == 2:
            acc = tl.dot(r_lo, v_hi, acc)
    return acc


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr):
    # EVEN (B a multiple of BT and D == BD): no masks, so no mask tensors live across the loop.
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _st(ptr, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _tile(B, T, NH, D, CU, BT: tl.constexpr, BU: tl.constexpr, VARLEN: tl.constexpr):
    """The program's [BU, BT] tile (grid: unit block, batch tile, head; the unit block fastest,
    so that the P programs of one head and batch tile are launched side by side): (hd, grp, ru
    [BU], rb64 [BT], md [BU], mask_b [1, BT], mask [BU, BT], HD = NH·D, col_s, col_q, col_x,
    lens [BT], steps). grp numbers the (batch tile, head) group whose programs share a barrier;
    ru are the program's units (absolute indices in the head). The col_* are the batch parts of
    the addresses [1, BT] of a [B, H, D], [B, T, H, D] and [B, T, 4, H, D] tensor (int64:
    B·T·4·H·D may pass 2^31); the unit part, which carries the time step, is added inside the
    time loop, so that no [BU, BT] address tensor is hoisted out of it and kept live in
    registers across all steps.

    VARLEN (packed sequences, cu_seqlens CU [B+1]): batch entry j is sequence j, rows
    CU[j]..CU[j+1] of the one packed row; col_q and col_x then point at its first row, lens
    holds the sequence lengths (0 past the last sequence) and steps, the time loop's bound, is
    the tile's longest length. Unpacked: lens is unused and steps = T."""
    pid_u = tl.program_id(0)
    pid_b = tl.program_id(1)
    hd = tl.program_id(2)
    grp = pid_b * NH + hd
    rb = pid_b * BT + tl.arange(0, BT)
    ru = pid_u * BU + tl.arange(0, BU)
    md = ru < D
    mask_b = (rb < B)[None, :]
    mask = md[:, None] & mask_b
    rb64 = rb.to(tl.int64)
    HD = NH * D
    col_s = rb64[None, :] * HD + hd * D
    if VARLEN:
        start = tl.load(CU + rb, mask=rb < B, other=0).to(tl.int64)
        lens = tl.load(CU + rb + 1, mask=rb < B, other=0).to(tl.int64) - start
        steps = tl.max(lens, axis=0).to(tl.int32)
        col_q = start[None, :] * HD + hd * D
        col_x = start[None, :] * 4 * HD + hd * D
    else:
        lens = rb64
        steps = T
        col_q = rb64[None, :] * T * HD + hd * D
        col_x = rb64[None, :] * T * 4 * HD + hd * D
    return hd, grp, ru, rb64, md, mask_b, mask, HD, col_s, col_q, col_x, lens, steps


@triton.jit
def _live(mask, lens, t, VARLEN: tl.constexpr):
    """The mask of step t: with VARLEN only the columns whose sequence has a step t."""
    if VARLEN:
        return mask & (t < lens)[None, :]
    else:
        return mask


@triton.jit
def _ld_shared(ptr, mask, EVEN: tl.constexpr, SYNC: tl.constexpr):
    """A load of what other programs wrote this step (SYNC): through L2 (.cg), since L1 is not
    coherent between SMs. Without SYNC only this program wrote it, and L1 may serve it."""
    if SYNC:
        if EVEN:
            return tl.load(ptr, cache_modifier=".cg")
        else:
            return tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        return _ld(ptr, mask, EVEN)


@triton.jit
def _sync(cnt_ptr, k, P, SYNC: tl.constexpr):
    """Barrier number k (1, 2, ...) among the P programs of a group: every thread's stores before
    it are visible to the group's loads after it. SYNC False: the program only (P = 1).

    The group's counter in global memory only grows: barrier k is passed when it reaches k·P.
    One thread per program adds (release: after the block barrier, its add orders the whole
    block's stores) and polls (acquire); the scalar atomic's result reaches all threads through
    shared memory, so the loop condition is uniform. Needs all P programs resident at once."""
    tl.debug_barrier()
    if SYNC:
        target = k * P
        cnt = tl.atomic_add(cnt_ptr, 1, sem="acq_rel") + 1
        while cnt < target:
            cnt = tl.atomic_add(cnt_ptr, 0, sem="acquire")
        tl.debug_barrier()


@triton.jit
def _ld_init(ptr, mask, HAS: tl.constexpr, EVEN: tl.constexpr, sdt: tl.constexpr, BD: tl.constexpr,
             BT: tl.constexpr):
    """A [BD, BT] state tile in the state dtype from ptr, or zeros when not HAS."""
    if HAS:
        x = _ld(ptr, mask, EVEN).to(sdt)
    else:
        x = tl.zeros([BD, BT], sdt)
    return x


@triton.jit
def _load_r(R, RLO, g, hd, NH, D, rows, cols, EVEN_D: tl.constexpr, TRANS: tl.constexpr,
            MM: tl.constexpr):
    """(hi, lo) of the tile [rows, cols] of R[g, hd] (TRANS=False) or of R[g, hd]ᵀ (TRANS=True)."""
    base = (g * NH + hd).to(tl.int64) * D * D
    if TRANS:
        off = cols[None, :] * D + rows[:, None]
    else:
        off = rows[:, None] * D + cols[None, :]
    rmask = (rows < D)[:, None] & (cols < D)[None, :]
    r_hi = _ld(R + base + off, rmask, EVEN_D)
    if MM == 2:
        r_lo = _ld(RLO + base + off, rmask, EVEN_D)
    else:
        r_lo = r_hi
    return r_hi, r_lo


@triton.jit
def _load_r_chunks(R, RLO, hd, NH, D, ru, KC: tl.constexpr, NKC: tl.constexpr,
                   EVEN_D: tl.constexpr, TRANS: tl.constexpr, MM: tl.constexpr):
    """The program's R tiles for all four gates and NKC K chunks, flat: entry g·NKC + c is the
    (hi, lo) [BU, KC] tile of rows ru and K columns c·KC.. of R[g, hd] (or its transpose)."""
    rs = ()
    for g in tl.static_range(4):
        for c in tl.static_range(NKC):
            rk = c * KC + tl.arange(0, KC)
            rs = rs + (_load_r(R, RLO, g, hd, NH, D, ru, rk, EVEN_D, TRANS, MM),)
    return rs


@triton.jit
def _load_r_stacked(R, RLO, hd, NH, D, BU: tl.constexpr, rk, EVEN_D: tl.constexpr, MM: tl.constexpr):
    """(hi, lo) of the four gates' R_gᵀ rows of this program's units (program 0 along the unit
    blocks) stacked into one [4·BU, KC] tile for the K columns rk: row g·BU + j is unit j of
    gate g, so one dot of M = 4·BU takes all four gates."""
    rr = tl.arange(0, 4 * BU)
    g = rr // BU
    u = tl.program_id(0) * BU + rr % BU
    off = ((g * NH + hd).to(tl.int64) * D * D)[:, None] + rk[None, :] * D + u[:, None]
    rmask = (u < D)[:, None] & (rk < D)[None, :]
    r_hi = _ld(R + off, rmask, EVEN_D)
    if MM == 2:
        r_lo = _ld(RLO + off, rmask, EVEN_D)
    else:
        r_lo = r_hi
    return r_hi, r_lo


@triton.jit
def _split_gates(acc, BU: tl.constexpr, BT: tl.constexpr):
    """The four [BU, BT] gate tiles (i, f, z, o) of a stacked [4·BU, BT] product."""
    a = tl.permute(tl.reshape(acc, [4, BU, BT]), (1, 2, 0))    # [BU, BT, 4]: gate q = 2·p + r
    a = tl.reshape(a, [BU, BT, 2, 2])
    even, odd = tl.split(a)                                     # r = 0: gates 0, 2; r = 1: gates 1, 3
    g_i, g_z = tl.split(even)
    g_f, g_o = tl.split(odd)
    return g_i, g_f, g_z, g_o


@triton.jit
def _ld_gates(base, off, HD, mask, EVEN: tl.constexpr):
    """The four gate tiles of a [.., 4, H, D] tensor: base + g * HD + off for g = i, f, z, o."""
    out = ()
    for g in tl.static_range(4):
        out = out + (_ld(base + g * HD + off, mask, EVEN),)
    return out


@triton.jit
def _st_gates(base, off, HD, vals, mask, EVEN: tl.constexpr):
    for g in tl.static_range(4):
        _st(base + g * HD + off, vals[g], mask, EVEN)


def prepare_r(r: torch.Tensor, state_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(r_hi, r_lo, MM mode) for the kernels' matmuls; see `_mm`."""
    if r.device.type != "cuda" or state_dtype == torch.float64:
        rr = r.to(state_dtype).contiguous()
        return rr, rr, 0
    if r.dtype == torch.bfloat16:
        rr = r.contiguous()
        return rr, rr, 1
    r32 = r.float()
    r_hi = r32.to(torch.bfloat16)
    r_lo = (r32 - r_hi.float()).to(torch.bfloat16)
    return r_hi.contiguous(), r_lo.contiguous(), 2
