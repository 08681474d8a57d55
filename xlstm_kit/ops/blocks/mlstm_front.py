"""Triton kernels of the paper mLSTM layer's front: the causal conv + SiLU of x_m, the head-wise
(block-diagonal) q/k/v maps and the gate pre-activations, in one pass over x_m each way (the
training cell of xlstm_kit/layers/mlstm_cell.py).

- `xlstm_kit::mlstm_front_fwd(x, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates, config)
      -> (x_conv, q, k, v, g)`
- `xlstm_kit::mlstm_front_bwd(dq, dk, dv, dg, dx_conv, x, pos, conv_w, conv_b, wq, wk, wv, w_conv,
      w_m, config) -> (dx, dconv_w, dconv_b, dwq, dwk, dwv, dw_conv, dw_m, db)`: two passes, the
  first writes the conv pre-activation's gradient (float32 scratch) and each program's sums of
  the weight gradients, the second its transposed conv plus the v map's and the gates' parts.
  x [B, T, C] contiguous (the activations' dtype), conv_w [C, K], conv_b [C] (any float dtype),
  wq, wk, wv [C/d, d, d] and w_conv, w_m [2H, C], b [2H] in x's dtype; x_conv = SiLU(conv(x)),
  q = blockdiag(wq) x_conv, k likewise, v = blockdiag(wv) x, g = x_conv w_convᵀ + x w_mᵀ + b
  [B·T, 2H] (gates=False, the backward's recomputation: q, k, v only; x_conv and g empty). pos: int32 [T] (packed
  documents, B = 1; see ops/blocks/triton.py) or None. Conv kernels up to 4 taps.

One program per tile of `bt` steps walks all C channels in `bc`-wide tiles: the gate
pre-activations are sums over every channel, kept in registers (no partial sums in memory, no
atomics: deterministic). Each map's d x d blocks are gathered into one dense bc x bc tile
(zeros off the diagonal blocks) and applied as a tensor-core product, on x_conv rounded to x's
dtype as the unfused path rounds it; products accumulate in float32.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._config import KernelConfig
from ..backend import assume_constant_result
from .triton import _conv_rows, _row_pos


@dataclasses.dataclass(frozen=True)
class FrontKernelConfig(KernelConfig):
    """Launch parameters of the front kernels: tiles of `bt` steps x `bc` channels (a multiple
    of the head-wise block size) for the forward (`warps`, at most `maxnreg` registers per
    thread; 0: no cap) and the backward's first pass (`bwd_warps`, `bwd_maxnreg`, at most
    `programs` programs along the steps), `dx_bt` x `dx_bc` tiles on `dx_warps` for its second.

    Defaults measured at the `125M` layer (C = 1536, 4 heads, blocks of 4) on an H100, bf16
    (benchmarks/front_variants.py, docs/kernels.md): the forward capped at 128 registers
    (0.48 ms at batch 16 x 2048 against 0.56 uncapped: ptxas otherwise takes 158 and fewer
    programs fit per SM); the first backward pass on 4 warps with up to 256 programs along the
    steps (1.50 ms at batch 16 against 1.63 with 512, 1.85 with 1024 and 2.22 on 8 warps with
    128; 0.52 at batch 4, where 256 programs are all there are). Larger tiles, tighter caps and
    more warps measured slower."""
    bt: int = 32
    bc: int = 32
    warps: int = 4
    bwd_warps: int = 4
    programs: int = 256
    dx_bt: int = 64
    dx_bc: int = 64
    dx_warps: int = 8
    maxnreg: int = 128
    bwd_maxnreg: int = 0


def supports(op: str, *, dtype: torch.dtype, block_size: int = 4, taps: int = 4, **_) -> str | None:
    """backend.choose_backend's question: do these kernels ("mlstm_front") take this call?
    block_size: the head-wise maps' block width; taps: the conv's kernel size."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton {op} kernels take float16, bfloat16 or float32 activations, got {dtype}"
    cfg = FrontKernelConfig()
    if cfg.bc % block_size or cfg.dx_bc % block_size:
        return f"the Triton {op} kernels need head-wise blocks that divide {cfg.bc}, got {block_size}"
    if taps > 4:
        return f"the Triton {op} kernels take convolutions of at most 4 taps, got {taps}"
    return None


@triton.jit
def _block_diag(w_ptr, c0, C, d: tl.constexpr, BC: tl.constexpr, TRANS: tl.constexpr):
    """The dense [BC, BC] tile W[i, o] of channels c0 + i -> c0 + o of the block-diagonal map
    w [C/d, d, d] (out, in per block): y = x @ W. TRANS: W[o, i] (the map's transpose)."""
    if TRANS:
        o = tl.arange(0, BC)[:, None]
        i = tl.arange(0, BC)[None, :]
    else:
        i = tl.arange(0, BC)[:, None]
        o = tl.arange(0, BC)[None, :]
    ci = c0 + i
    co = c0 + o
    m = (i // d == o // d) & (ci < C) & (co < C)
    return tl.load(w_ptr + (co // d) * (d * d) + (co % d) * d + (ci % d), mask=m, other=0.0)


@triton.jit
def _front_fwd(x_ptr, p_ptr, cw_ptr, cb_ptr, wq_ptr, wk_ptr, wv_ptr, wgc_ptr, wgm_ptr, gb_ptr,
               xc_ptr, q_ptr, k_ptr, v_ptr, g_ptr, T, C, G2,
               K: tl.constexpr, d: tl.constexpr, HAS_POS: tl.constexpr, GATES: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, BG: tl.constexpr, PREC: tl.constexpr):
    bi = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    xb = x_ptr + bi * T * C
    pos = _row_pos(p_ptr, rows, T, HAS_POS)
    gcols = tl.arange(0, BG)
    gacc = tl.zeros((BT, BG), dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m = rmask[:, None] & cmask[None, :]
        off = bi * T * C + rows[:, None] * C + c[None, :]
        y = _conv_rows(xb, xb, cw_ptr, cb_ptr, rows, c, cmask, T, C, K, False, pos, HAS_POS)
        xc = (y * tl.sigmoid(y)).to(dt)
        xt = tl.load(x_ptr + off, mask=m, other=0.0)
        if GATES:  # the forward; the backward's recomputation needs no x_conv
            tl.store(xc_ptr + off, xc, mask=m)
        q = tl.dot(xc, _block_diag(wq_ptr, c0, C, d, BC, False), input_precision=PREC)
        tl.store(q_ptr + off, q.to(dt), mask=m)
        kk = tl.dot(xc, _block_diag(wk_ptr, c0, C, d, BC, False), input_precision=PREC)
        tl.store(k_ptr + off, kk.to(dt), mask=m)
        v = tl.dot(xt, _block_diag(wv_ptr, c0, C, d, BC, False), input_precision=PREC)
        tl.store(v_ptr + off, v.to(dt), mask=m)
        if GATES:
            gm = cmask[:, None] & (gcols < G2)[None, :]
            goff = gcols[None, :] * C + c[:, None]  # [BC, BG]: the gate weights transposed
            gacc += tl.dot(xc, tl.load(wgc_ptr + goff, mask=gm, other=0.0), input_precision=PREC)
            gacc += tl.dot(xt, tl.load(wgm_ptr + goff, mask=gm, other=0.0), input_precision=PREC)
    if GATES:
        gacc += tl.load(gb_ptr + gcols, mask=gcols < G2, other=0.0).to(tl.float32)[None, :]
        grow = bi * T + rows
        tl.store(g_ptr + grow[:, None] * G2 + gcols[None, :], gacc.to(dt),
                 mask=rmask[:, None] & (gcols < G2)[None, :])


def _prec(x: Tensor) -> str:
    # float32 activations: full-precision products (the default TF32 would round their inputs)
    return "ieee" if x.dtype == torch.float32 else "tf32"


@torch.library.custom_op("xlstm_kit::mlstm_front_fwd", mutates_args=())
def mlstm_front_fwd(x: Tensor, pos: Optional[Tensor], conv_w: Tensor, conv_b: Tensor, wq: Tensor, wk: Tensor,
                    wv: Tensor, w_conv: Tensor, w_m: Tensor, b: Tensor, gates: bool,
                    config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    cfg = FrontKernelConfig.from_key(config)
    B, T, C = x.shape
    G2 = w_conv.shape[0]
    q, k, v = (torch.empty_like(x) for _ in range(3))
    xc = torch.empty_like(x) if gates else x.new_empty(0)
    g = x.new_empty(B * T, G2) if gates else x.new_empty(0)
    if x.numel():
        _front_fwd[(triton.cdiv(T, cfg.bt), B)](
            x, x if pos is None else pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, xc, q, k, v, g, T, C, G2,
            K=conv_w.shape[1], d=wq.shape[-1], HAS_POS=pos is not None, GATES=gates, BT=cfg.bt, BC=cfg.bc,
            BG=max(16, triton.next_power_of_2(G2)), PREC=_prec(x), num_warps=cfg.warps,
            maxnreg=cfg.maxnreg or None)
    return xc, q, k, v, g


@mlstm_front_fwd.register_fake
def _(x, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates, config):
    B, T, C = x.shape
    g = x.new_empty(B * T, w_conv.shape[0]) if gates else x.new_empty(0)
    xc = torch.empty_like(x) if gates else x.new_empty(0)
    return (xc, torch.empty_like(x), torch.empty_like(x), torch.empty_like(x), g)


@triton.jit
def _front_bwd_pre(x_ptr, p_ptr, cw_ptr, cb_ptr, wq_ptr, wk_ptr, wgc_ptr, dq_ptr, dk_ptr, dv_ptr, dg_ptr, dxe_ptr,
                   d_ptr, wpart_ptr, gpart_ptr, cpart_ptr, T, C, G2, NT, NR,
                   K: tl.constexpr, d: tl.constexpr, HAS_POS: tl.constexpr, HAS_DXE: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, BG: tl.constexpr, PREC: tl.constexpr):
    """For one channel tile and the step tiles pid, pid + P, ... (over all batch rows): the
    gradient of the conv's pre-activation d [B, T, C] (float32 scratch for _front_bwd_dx), and
    this program's sums of the weight gradients: the three maps' dense [BC, BC] products
    (block diagonals kept), the gate weights' [BG, BC] (x_conv's and x's parts) and the conv's
    taps and bias."""
    pid_c = tl.program_id(0)
    pid_r = tl.program_id(1)
    P = tl.num_programs(1)
    c0 = pid_c * BC
    c = c0 + tl.arange(0, BC)
    cmask = c < C
    gcols = tl.arange(0, BG)
    gmask = gcols < G2
    dt = x_ptr.dtype.element_ty
    wqT = _block_diag(wq_ptr, c0, C, d, BC, True)
    wkT = _block_diag(wk_ptr, c0, C, d, BC, True)
    wgc = tl.load(wgc_ptr + gcols[:, None] * C + c[None, :], mask=gmask[:, None] & cmask[None, :], other=0.0)
    acc_q = tl.zeros((BC, BC), dtype=tl.float32)
    acc_k = tl.zeros((BC, BC), dtype=tl.float32)
    acc_v = tl.zeros((BC, BC), dtype=tl.float32)
    acc_gc = tl.zeros((BG, BC), dtype=tl.float32)
    acc_gm = tl.zeros((BG, BC), dtype=tl.float32)
    acc_b = tl.zeros((BC,), dtype=tl.float32)
    acc_w0 = tl.zeros((BC,), dtype=tl.float32)
    acc_w1 = tl.zeros((BC,), dtype=tl.float32)
    acc_w2 = tl.zeros((BC,), dtype=tl.float32)
    acc_w3 = tl.zeros((BC,), dtype=tl.float32)
    for rt in range(pid_r, NR, P):
        bi = (rt // NT).to(tl.int64)
        rows = (rt % NT) * BT + tl.arange(0, BT)
        rmask = rows < T
        m = rmask[:, None] & cmask[None, :]
        xb = x_ptr + bi * T * C
        off = bi * T * C + rows[:, None] * C + c[None, :]
        pos = _row_pos(p_ptr, rows, T, HAS_POS)
        y = _conv_rows(xb, xb, cw_ptr, cb_ptr, rows, c, cmask, T, C, K, False, pos, HAS_POS)
        sg = tl.sigmoid(y)
        xc = tl.where(m, y * sg, 0.0).to(dt)
        xt = tl.load(x_ptr + off, mask=m, other=0.0)
        dq = tl.load(dq_ptr + off, mask=m, other=0.0)
        dk = tl.load(dk_ptr + off, mask=m, other=0.0)
        dv = tl.load(dv_ptr + off, mask=m, other=0.0)
        grow = bi * T + rows
        dg = tl.load(dg_ptr + grow[:, None] * G2 + gcols[None, :], mask=rmask[:, None] & gmask[None, :], other=0.0)
        dxc = tl.dot(dq, wqT, input_precision=PREC)
        dxc = tl.dot(dk, wkT, dxc, input_precision=PREC)
        dxc = tl.dot(dg, wgc, dxc, input_precision=PREC)
        if HAS_DXE:
            dxc += tl.load(dxe_ptr + off, mask=m, other=0.0).to(tl.float32)
        dpre = tl.where(m, dxc * sg * (1.0 + y * (1.0 - sg)), 0.0)
        tl.store(d_ptr + off, dpre, mask=m)
        acc_q = tl.dot(tl.trans(xc), dq, acc_q, input_precision=PREC)
        acc_k = tl.dot(tl.trans(xc), dk, acc_k, input_precision=PREC)
        acc_v = tl.dot(tl.trans(xt), dv, acc_v, input_precision=PREC)
        acc_gc = tl.dot(tl.trans(dg), xc, acc_gc, input_precision=PREC)
        acc_gm = tl.dot(tl.trans(dg), xt, acc_gm, input_precision=PREC)
        acc_b += tl.sum(dpre, 0)
        # tap j reads x[t - (K-1-j)]
        acc_w3 += tl.sum(dpre * _tap(xb, rows, c, cmask, T, C, 0, pos, HAS_POS), 0)
        if K > 1:
            acc_w2 += tl.sum(dpre * _tap(xb, rows, c, cmask, T, C, 1, pos, HAS_POS), 0)
        if K > 2:
            acc_w1 += tl.sum(dpre * _tap(xb, rows, c, cmask, T, C, 2, pos, HAS_POS), 0)
        if K > 3:
            acc_w0 += tl.sum(dpre * _tap(xb, rows, c, cmask, T, C, 3, pos, HAS_POS), 0)
    # the maps' weight gradients: dense[i, o] of channel c0 + i -> c0 + o, on the d x d diagonal blocks
    i = tl.arange(0, BC)[:, None]
    o = tl.arange(0, BC)[None, :]
    keep = (i // d == o // d) & (c0 + i < C) & (c0 + o < C)
    co = c0 + o
    woff = (co // d) * (d * d) + (co % d) * d + (c0 + i) % d
    PCd = C * d  # one map's entries
    base = wpart_ptr + pid_r.to(tl.int64) * (3 * PCd)
    tl.store(base + woff, acc_q, mask=keep)
    tl.store(base + PCd + woff, acc_k, mask=keep)
    tl.store(base + 2 * PCd + woff, acc_v, mask=keep)
    gm2 = gmask[:, None] & cmask[None, :]
    gbase = gpart_ptr + pid_r.to(tl.int64) * (2 * G2 * C)
    tl.store(gbase + gcols[:, None] * C + c[None, :], acc_gc, mask=gm2)
    tl.store(gbase + G2 * C + gcols[:, None] * C + c[None, :], acc_gm, mask=gm2)
    cbase = cpart_ptr + pid_r.to(tl.int64) * (5 * C)
    tl.store(cbase + c, acc_b, mask=cmask)
    tl.store(cbase + C + c, acc_w0, mask=cmask)
    tl.store(cbase + 2 * C + c, acc_w1, mask=cmask)
    tl.store(cbase + 3 * C + c, acc_w2, mask=cmask)
    tl.store(cbase + 4 * C + c, acc_w3, mask=cmask)


@triton.jit
def _tap(xb, rows, c, cmask, T, C, shift, pos, HAS_POS: tl.constexpr):
    """x[rows - shift, c] in x's dtype, zero before the sequence's (or the document's) start."""
    tt = rows - shift
    ok = (tt >= 0) & (tt < T)
    if HAS_POS:
        ok = ok & (pos >= shift)
    return tl.load(xb + tt[:, None] * C + c[None, :], mask=ok[:, None] & cmask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _front_bwd_dx(d_ptr, p_ptr, cw_ptr, wv_ptr, wgm_ptr, dv_ptr, dg_ptr, dx_ptr, T, C, G2,
                  K: tl.constexpr, d: tl.constexpr, HAS_POS: tl.constexpr,
                  BT: tl.constexpr, BC: tl.constexpr, BG: tl.constexpr, PREC: tl.constexpr):
    """dx = the transposed conv of d (Σ_s d[t + s] w[K-1-s], within a document) + the v map's
    and the gates' parts (dv W_vᵀ + dg w_m)."""
    bi = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    c0 = tl.program_id(1) * BC
    c = c0 + tl.arange(0, BC)
    cmask = c < C
    rmask = rows < T
    m = rmask[:, None] & cmask[None, :]
    db = d_ptr + bi * T * C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for s in tl.static_range(K):
        r = rows + s
        rok = r < T
        if HAS_POS:
            rok = rok & (tl.load(p_ptr + r, mask=r < T, other=0) >= s)
        dd = tl.load(db + r[:, None] * C + c[None, :], mask=rok[:, None] & cmask[None, :], other=0.0)
        wj = tl.load(cw_ptr + c * K + (K - 1 - s), mask=cmask, other=0.0).to(tl.float32)
        acc += dd * wj[None, :]
    off = bi * T * C + rows[:, None] * C + c[None, :]
    dv = tl.load(dv_ptr + off, mask=m, other=0.0)
    acc = tl.dot(dv, _block_diag(wv_ptr, c0, C, d, BC, True), acc, input_precision=PREC)
    gcols = tl.arange(0, BG)
    gmask = gcols < G2
    grow = bi * T + rows
    dg = tl.load(dg_ptr + grow[:, None] * G2 + gcols[None, :], mask=rmask[:, None] & gmask[None, :], other=0.0)
    wgm = tl.load(wgm_ptr + gcols[:, None] * C + c[None, :], mask=gmask[:, None] & cmask[None, :], other=0.0)
    acc = tl.dot(dg, wgm, acc, input_precision=PREC)
    tl.store(dx_ptr + off, acc.to(dx_ptr.dtype.element_ty), mask=m)


@torch.library.custom_op("xlstm_kit::mlstm_front_bwd", mutates_args=())
def mlstm_front_bwd(dq: Tensor, dk: Tensor, dv: Tensor, dg: Tensor, dx_conv: Optional[Tensor], x: Tensor,
                    pos: Optional[Tensor], conv_w: Tensor, conv_b: Tensor, wq: Tensor, wk: Tensor, wv: Tensor,
                    w_conv: Tensor, w_m: Tensor,
                    config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (dx, dconv_w, dconv_b, dwq, dwk, dwv, dw_conv, dw_m, db) of mlstm_front_fwd
    from those of q, k, v [B, T, C], the gates dg [B·T, 2H] and x_conv (its other readers'; or
    None); dq, dk, dv, dg, dx_conv contiguous in x's dtype."""
    cfg = FrontKernelConfig.from_key(config)
    B, T, C = x.shape
    K, d, G2 = conv_w.shape[1], wq.shape[-1], w_conv.shape[0]
    NT = triton.cdiv(T, cfg.bt)
    P = max(1, min(cfg.programs, B * NT))
    f32 = dict(device=x.device, dtype=torch.float32)
    # _front_bwd_pre writes every entry (all channel tiles of every program along the steps):
    # no zero fill, which cost as much traffic as the partial sums themselves; zeros for empty x
    alloc = torch.empty if x.numel() else torch.zeros
    wpart = alloc(P, 3, C // d, d, d, **f32)
    gpart = alloc(P, 2, G2, C, **f32)
    cpart = alloc(P, 5, C, **f32)
    dx = torch.empty_like(x)
    if x.numel():
        dpre = torch.empty(B, T, C, **f32)
        p = x if pos is None else pos
        BG = max(16, triton.next_power_of_2(G2))
        _front_bwd_pre[(triton.cdiv(C, cfg.bc), P)](
            x, p, conv_w, conv_b, wq, wk, w_conv, dq, dk, dv, dg, x if dx_conv is None else dx_conv, dpre,
            wpart, gpart, cpart, T, C, G2, NT, B * NT, K=K, d=d, HAS_POS=pos is not None,
            HAS_DXE=dx_conv is not None, BT=cfg.bt, BC=cfg.bc, BG=BG, PREC=_prec(x), num_warps=cfg.bwd_warps,
            maxnreg=cfg.bwd_maxnreg or None)
        _front_bwd_dx[(triton.cdiv(T, cfg.dx_bt), triton.cdiv(C, cfg.dx_bc), B)](
            dpre, p, conv_w, wv, w_m, dv, dg, dx, T, C, G2, K=K, d=d, HAS_POS=pos is not None,
            BT=cfg.dx_bt, BC=cfg.dx_bc, BG=BG, PREC=_prec(x), num_warps=cfg.dx_warps)
    w = wpart.sum(0)
    g = gpart.sum(0)
    cs = cpart.sum(0)  # the bias, then the taps of 3, 2, 1, 0 steps back: taps K-4..K-1 (the last K are real)
    taps = cs[5 - K:]
    # outputs of their own (a custom op's outputs may not alias each other)
    own = lambda like, val: torch.empty_like(like).copy_(val)  # noqa: E731
    return (dx, own(conv_w, taps.t()), own(conv_b, cs[0]), own(wq, w[0]), own(wk, w[1]), own(wv, w[2]),
            own(w_conv, g[0]), own(w_m, g[1]), dg.float().sum(0).to(w_conv.dtype))


@mlstm_front_bwd.register_fake
def _(dq, dk, dv, dg, dx_conv, x, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, config):
    return (torch.empty_like(x), torch.empty_like(conv_w), torch.empty_like(conv_b), torch.empty_like(wq),
            torch.empty_like(wk), torch.empty_like(wv), torch.empty_like(w_conv), torch.empty_like(w_m),
            w_conv.new_empty(w_conv.shape[0]))


@assume_constant_result
def front_config_key() -> str:
    """The default configuration's key (a constant to torch.compile)."""
    return _FRONT_KEY


_FRONT_KEY = FrontKernelConfig().key()
