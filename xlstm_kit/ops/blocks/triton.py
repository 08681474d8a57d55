"""Triton kernels of the layers' elementwise parts: the mLSTM output tail (below), the head-wise
norm (the same kernels without skip and gate), the head-wise norm times the large block's
sigmoid output gate (the same kernels again) and the causal conv + SiLU (further down).

The mLSTM output tail u = (norm(h) · w + skip · x_conv) · SiLU(z) (the
down-projection stays a cuBLAS matmul), as `torch.library` custom ops opaque to torch.compile:

- `xlstm_kit::mlstm_tail_fwd(h, x_conv, z, w, skip, eps, config) -> (u, mean, rstd)`
- `xlstm_kit::mlstm_tail_bwd(h, x_conv, z, w, skip, mean, rstd, du, config)
      -> (u, dh, dx_conv, dz, dw, dskip)`  (u recomputed for the down-projection's weight gradient)

h [N, H, D], x_conv, z, du [N, H·D] in one dtype (float16, bfloat16 or float32), w, skip [H·D]
(any float dtype), mean, rstd [N, H] float32. One pass over the activations each way, float32
arithmetic; dw and dskip are summed per program, then over programs.
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


@dataclasses.dataclass(frozen=True)
class TailKernelConfig(KernelConfig):
    """Launch parameters of the tail kernels: `rows` tokens per tile, `warps` (forward),
    `bwd_warps`, and at most `programs` programs along the tokens in the backward (each sums its
    tiles' dw, dskip). Defaults: the fastest of benchmarks/blocks_tune.py on the H200 at the
    125M model's [32768, 4, 384] (backward 0.43 ms, 2.3x its bandwidth time; the former 4 rows
    on 8 warps took 1.35 ms)."""
    rows: int = 8
    warps: int = 4
    bwd_warps: int = 4
    programs: int = 2048


def supports(op: str, *, dtype: torch.dtype, head_dim: int = 0, gate_dtype: torch.dtype | None = None,
             **_) -> str | None:
    """backend.choose_backend's question: do these kernels ("mlstm_output", "head_norm",
    "gated_head_norm" with its gate's `gate_dtype`, "conv_silu") take this call?"""
    for dt in (dtype, gate_dtype or dtype):
        if dt not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the Triton {op} kernels take float16, bfloat16 or float32 activations, got {dt}"
    if head_dim > 4096:
        return f"the Triton tail kernels hold a head in one tile; head_dim {head_dim} > 4096"
    return None


# GATE (constexpr) picks what the kernels compute around the norm a = norm(h) · w:
#   0: a (head_norm), 1: (a + skip · x_conv) · SiLU(z) (the mLSTM tail),
#   2: a · sigmoid(o) (the large block's output gate; o read through z_ptr with row stride
#      stride_z, so a column slice of the input GEMM's output needs no copy).
# Modes 0 and 1 index z at the rows' contiguous offsets and ignore stride_z.
@triton.jit
def _tail_fwd(h_ptr, xc_ptr, z_ptr, w_ptr, s_ptr, u_ptr, mean_ptr, rstd_ptr, N, H, D, eps, stride_z,
              ROWS: tl.constexpr, BD: tl.constexpr, GATE: tl.constexpr):
    hh = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    rmask = rows < N
    cmask = cols < D
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * (H * D) + hh * D + cols[None, :]
    x = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / D
    xm = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xm * xm, 1) / D + eps)
    w = tl.load(w_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    u = xm * rstd[:, None] * w[None, :]
    if GATE == 1:
        sk = tl.load(s_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
        xc = tl.load(xc_ptr + offs, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = (u + sk[None, :] * xc) * (z * tl.sigmoid(z))
    elif GATE == 2:
        o_offs = rows[:, None].to(tl.int64) * stride_z + hh * D + cols[None, :]
        o = tl.load(z_ptr + o_offs, mask=m, other=0.0).to(tl.float32)
        u = u * tl.sigmoid(o)
    tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=m)
    tl.store(mean_ptr + rows * H + hh, mean, mask=rmask)
    tl.store(rstd_ptr + rows * H + hh, rstd, mask=rmask)


@triton.jit
def _tail_bwd(h_ptr, xc_ptr, z_ptr, w_ptr, s_ptr, mean_ptr, rstd_ptr, du_ptr,
              u_ptr, dh_ptr, dxc_ptr, dz_ptr, dw_part, ds_part, N, H, D, stride_z,
              ROWS: tl.constexpr, BD: tl.constexpr, GATE: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    hh = tl.program_id(1)
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    sk = tl.load(s_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_w = tl.zeros((BD,), dtype=tl.float32)
    acc_s = tl.zeros((BD,), dtype=tl.float32)
    for start in range(pid * ROWS, N, P * ROWS):
        rows = start + tl.arange(0, ROWS)
        rmask = rows < N
        m = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * (H * D) + hh * D + cols[None, :]
        mean = tl.load(mean_ptr + rows * H + hh, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows * H + hh, mask=rmask, other=0.0)
        x = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        da = tl.load(du_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if GATE == 1:
            xc = tl.load(xc_ptr + offs, mask=m, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
            a = xhat * w[None, :] + sk[None, :] * xc
            sz = tl.sigmoid(z)
            silz = z * sz
            tl.store(u_ptr + offs, (a * silz).to(u_ptr.dtype.element_ty), mask=m)
            tl.store(dz_ptr + offs, (da * a * sz * (1.0 + z * (1.0 - sz))).to(dz_ptr.dtype.element_ty), mask=m)
            da = da * silz
            tl.store(dxc_ptr + offs, (da * sk[None, :]).to(dxc_ptr.dtype.element_ty), mask=m)
            acc_s += tl.sum(da * xc, 0)
        elif GATE == 2:
            o = tl.load(z_ptr + rows[:, None].to(tl.int64) * stride_z + hh * D + cols[None, :],
                        mask=m, other=0.0).to(tl.float32)
            so = tl.sigmoid(o)
            # do = dy · a · σ'(o), a = x̂ w; dz_ptr is contiguous [N, H·D] (not o's stride)
            tl.store(dz_ptr + offs, (da * xhat * w[None, :] * so * (1.0 - so)).to(dz_ptr.dtype.element_ty),
                     mask=m)
            da = da * so
        acc_w += tl.sum(da * xhat, 0)
        dxhat = da * w[None, :]
        c1 = tl.sum(dxhat * xhat, 1) / D
        c2 = tl.sum(dxhat, 1) / D
        dh = rstd[:, None] * (dxhat - c2[:, None] - xhat * c1[:, None])
        tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * (H * D) + hh * D + cols, acc_w, mask=cmask)
    if GATE == 1:
        tl.store(ds_part + pid * (H * D) + hh * D + cols, acc_s, mask=cmask)


def _stats(h: Tensor) -> tuple[Tensor, Tensor]:
    N, H, _ = h.shape
    return (torch.empty(N, H, device=h.device, dtype=torch.float32),
            torch.empty(N, H, device=h.device, dtype=torch.float32))


@torch.library.custom_op("xlstm_kit::mlstm_tail_fwd", mutates_args=())
def mlstm_tail_fwd(h: Tensor, x_conv: Tensor, z: Tensor, w: Tensor, skip: Tensor, eps: float,
                   config: str) -> tuple[Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = h.shape
    u = torch.empty_like(x_conv)
    mean, rstd = _stats(h)
    if N:
        grid = (triton.cdiv(N, cfg.rows), H)
        _tail_fwd[grid](h, x_conv, z, w, skip, u, mean, rstd, N, H, D, eps, H * D,
                        ROWS=cfg.rows, BD=triton.next_power_of_2(D), GATE=1, num_warps=cfg.warps)
    return u, mean, rstd


@mlstm_tail_fwd.register_fake
def _(h, x_conv, z, w, skip, eps, config):
    return (torch.empty_like(x_conv), *_stats(h))


@torch.library.custom_op("xlstm_kit::mlstm_tail_bwd", mutates_args=())
def mlstm_tail_bwd(h: Tensor, x_conv: Tensor, z: Tensor, w: Tensor, skip: Tensor, mean: Tensor, rstd: Tensor,
                   du: Tensor, config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = h.shape
    u, dxc, dz = torch.empty_like(x_conv), torch.empty_like(x_conv), torch.empty_like(z)
    dh = torch.empty_like(h)
    P = max(1, min(cfg.programs, triton.cdiv(N, cfg.rows)))
    dw_part = torch.zeros(P, H * D, device=h.device, dtype=torch.float32)
    ds_part = torch.zeros(P, H * D, device=h.device, dtype=torch.float32)
    if N:
        _tail_bwd[(P, H)](h, x_conv, z, w, skip, mean, rstd, du, u, dh, dxc, dz, dw_part, ds_part, N, H, D, H * D,
                          ROWS=cfg.rows, BD=triton.next_power_of_2(D), GATE=1, num_warps=cfg.bwd_warps)
    return u, dh, dxc, dz, dw_part.sum(0).to(w.dtype), ds_part.sum(0).to(skip.dtype)


@mlstm_tail_bwd.register_fake
def _(h, x_conv, z, w, skip, mean, rstd, du, config):
    return (torch.empty_like(x_conv), torch.empty_like(h), torch.empty_like(x_conv), torch.empty_like(z),
            torch.empty_like(w), torch.empty_like(skip))


@assume_constant_result
def config_key() -> str:
    """The default configuration's key (a constant to torch.compile, which cannot trace json)."""
    return _DEFAULT_KEY


_DEFAULT_KEY = TailKernelConfig().key()


# ----------------------------------------------------------------------------- head-wise norm
# xlstm_kit::head_norm_fwd(x, w, eps, config) -> (y, mean, rstd) and
# xlstm_kit::head_norm_bwd(x, w, mean, rstd, dy, config) -> (dx, dw): the tail kernels without
# the skip and the gate (GATE=0), for MultiHeadNorm (x, y [N, H, D]).

@torch.library.custom_op("xlstm_kit::head_norm_fwd", mutates_args=())
def head_norm_fwd(x: Tensor, w: Tensor, eps: float, config: str) -> tuple[Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = x.shape
    y = torch.empty_like(x)
    mean, rstd = _stats(x)
    if N:
        _tail_fwd[(triton.cdiv(N, cfg.rows), H)](x, x, x, w, w, y, mean, rstd, N, H, D, eps, H * D,
                                                  ROWS=cfg.rows, BD=triton.next_power_of_2(D), GATE=0, num_warps=cfg.warps)
    return y, mean, rstd


@head_norm_fwd.register_fake
def _(x, w, eps, config):
    return (torch.empty_like(x), *_stats(x))


@torch.library.custom_op("xlstm_kit::head_norm_bwd", mutates_args=())
def head_norm_bwd(x: Tensor, w: Tensor, mean: Tensor, rstd: Tensor, dy: Tensor, config: str) -> tuple[Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = x.shape
    dx = torch.empty_like(x)
    P = max(1, min(cfg.programs, triton.cdiv(N, cfg.rows)))
    dw_part = torch.zeros(P, H * D, device=x.device, dtype=torch.float32)
    if N:
        _tail_bwd[(P, H)](x, x, x, w, w, mean, rstd, dy, x, dx, x, x, dw_part, dw_part, N, H, D, H * D,
                          ROWS=cfg.rows, BD=triton.next_power_of_2(D), GATE=0, num_warps=cfg.bwd_warps)
    return dx, dw_part.sum(0).to(w.dtype)


@head_norm_bwd.register_fake
def _(x, w, mean, rstd, dy, config):
    return torch.empty_like(x), torch.empty_like(w)


# ----------------------------------------------------------------------------- gated head-wise norm
# xlstm_kit::gated_head_norm_fwd(x, o, w, eps, config) -> (y, mean, rstd) and
# xlstm_kit::gated_head_norm_bwd(x, o, w, mean, rstd, dy, config) -> (dx, do, dw): the large
# block's output gate y = sigmoid(o) · norm(x) · w (GATE=2) for x [N, H, D] contiguous, o [N, H·D]
# with any row stride (columns contiguous: a column slice of a GEMM's output), y, dy, do
# [N, H·D] contiguous in o's dtype, dx in x's.

def _gate_rows(o: Tensor) -> Tensor:
    # the kernels take o's row stride but assume unit column stride
    return o if o.stride(-1) == 1 else o.contiguous()


@torch.library.custom_op("xlstm_kit::gated_head_norm_fwd", mutates_args=())
def gated_head_norm_fwd(x: Tensor, o: Tensor, w: Tensor, eps: float, config: str) -> tuple[Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = x.shape
    o = _gate_rows(o)
    y = torch.empty(N, H * D, device=o.device, dtype=o.dtype)
    mean, rstd = _stats(x)
    if N:
        _tail_fwd[(triton.cdiv(N, cfg.rows), H)](x, x, o, w, w, y, mean, rstd, N, H, D, eps, o.stride(0),
                                                  ROWS=cfg.rows, BD=triton.next_power_of_2(D), GATE=2,
                                                  num_warps=cfg.warps)
    return y, mean, rstd


@gated_head_norm_fwd.register_fake
def _(x, o, w, eps, config):
    N, H, D = x.shape
    return (o.new_empty(N, H * D), *_stats(x))


@torch.library.custom_op("xlstm_kit::gated_head_norm_bwd", mutates_args=())
def gated_head_norm_bwd(x: Tensor, o: Tensor, w: Tensor, mean: Tensor, rstd: Tensor, dy: Tensor,
                        config: str) -> tuple[Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = x.shape
    o, dy = _gate_rows(o), dy.contiguous()
    dx = torch.empty_like(x)
    do = torch.empty(N, H * D, device=o.device, dtype=o.dtype)
    P = max(1, min(cfg.programs, triton.cdiv(N, cfg.rows)))
    dw_part = torch.zeros(P, H * D, device=x.device, dtype=torch.float32)
    if N:
        _tail_bwd[(P, H)](x, x, o, w, w, mean, rstd, dy, x, dx, x, do, dw_part, dw_part, N, H, D, o.stride(0),
                          ROWS=cfg.rows, BD=triton.next_power_of_2(D), GATE=2, num_warps=cfg.bwd_warps)
    return dx, do, dw_part.sum(0).to(w.dtype)


@gated_head_norm_bwd.register_fake
def _(x, o, w, mean, rstd, dy, config):
    N, H, D = x.shape
    return torch.empty_like(x), o.new_empty(N, H * D), torch.empty_like(w)


# ----------------------------------------------------------------------------- causal conv + SiLU
# xlstm_kit::conv_fwd(x, state, w, b, act, config) -> out and xlstm_kit::conv_bwd(dout, x, state,
# w, b, act, config) -> (dx, dstate, dw, db): the depthwise causal convolution of x [B, T, C]
# (state [B, K-1, C]: the inputs before x, or None for zeros), w [C, K], b [C], followed by SiLU
# when `act`. The backward recomputes the pre-activation (K² loads per tile, from cache).
# pos (int32 [T], or None): each step's position in its document (packed documents, B = 1): tap
# input x[t - shift] counts only where pos[t] >= shift, so no step sees an earlier document
# (nor the state: pass None with pos).

@dataclasses.dataclass(frozen=True)
class ConvKernelConfig(KernelConfig):
    """Launch parameters of the conv kernels: tiles of `bt` steps x `bc` channels, `warps`
    (forward), `bwd_warps` (both backward passes). Defaults: the fastest of
    benchmarks/blocks_tune.py on the H200 at the 125M model's [16, 2048, 1536] (backward 0.45 ms;
    the former one-pass backward took 1.22 ms at its default, 0.67 ms at its best tiles)."""
    bt: int = 64
    bc: int = 128
    warps: int = 4
    bwd_warps: int = 4


@triton.jit
def _tap_input(xb, sb, rows, c, cmask, T, C, shift, K: tl.constexpr, HAS_STATE: tl.constexpr, pos, HAS_POS: tl.constexpr):
    """x[rows - shift, c] (float32), reading the state before t = 0 (zeros without a state);
    with HAS_POS only where pos (the rows' positions in their documents) >= shift."""
    tt = rows - shift
    ok = (tt >= 0) & (tt < T)
    if HAS_POS:
        ok = ok & (pos >= shift)
    xv = tl.load(xb + tt[:, None] * C + c[None, :], mask=ok[:, None] & cmask[None, :],
                 other=0.0).to(tl.float32)
    if HAS_STATE:
        sm = (tt < 0) & (tt >= -(K - 1))
        xv += tl.load(sb + (tt + K - 1)[:, None] * C + c[None, :], mask=sm[:, None] & cmask[None, :],
                      other=0.0).to(tl.float32)
    return xv


@triton.jit
def _row_pos(p_ptr, rows, T, HAS_POS: tl.constexpr):
    """The rows' positions in their documents (HAS_POS), else a placeholder."""
    if HAS_POS:
        return tl.load(p_ptr + rows, mask=rows < T, other=0)
    return rows


@triton.jit
def _conv_rows(x_ptr, s_ptr, w_ptr, b_ptr, rows, c, cmask, T, C, K: tl.constexpr, HAS_STATE: tl.constexpr,
               pos, HAS_POS: tl.constexpr):
    """Pre-activation y[rows, c] (float32) for the batch row that x_ptr, s_ptr point at; rows
    outside [0, T) give garbage that callers mask."""
    bias = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    w0 = tl.load(w_ptr + c * K, mask=cmask, other=0.0).to(tl.float32)
    acc = _tap_input(x_ptr, s_ptr, rows, c, cmask, T, C, K - 1, K, HAS_STATE, pos, HAS_POS) * w0[None, :] + bias[None, :]
    for j in tl.static_range(1, K):
        xv = _tap_input(x_ptr, s_ptr, rows, c, cmask, T, C, K - 1 - j, K, HAS_STATE, pos, HAS_POS)
        wj = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    return acc


@triton.jit
def _conv_fwd(x_ptr, s_ptr, p_ptr, w_ptr, b_ptr, out_ptr, T, C, K: tl.constexpr, HAS_STATE: tl.constexpr,
              HAS_POS: tl.constexpr, ACT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    bi = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    xb = x_ptr + bi * T * C
    sb = s_ptr + bi * (K - 1) * C
    pos = _row_pos(p_ptr, rows, T, HAS_POS)
    y = _conv_rows(xb, sb, w_ptr, b_ptr, rows, c, cmask, T, C, K, HAS_STATE, pos, HAS_POS)
    if ACT:
        y = y * tl.sigmoid(y)
    m = (rows < T)[:, None] & cmask[None, :]
    tl.store(out_ptr + bi * T * C + rows[:, None] * C + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_dpre(g_ptr, x_ptr, s_ptr, p_ptr, w_ptr, b_ptr, d_ptr, dw_part, db_part, T, C, NT,
               K: tl.constexpr, HAS_STATE: tl.constexpr, HAS_POS: tl.constexpr, ACT: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr):
    """d = ∂L/∂(pre-activation) [B, T, C] float32 (recomputing the pre-activation), and this
    tile's sums of d (bias) and of d times each tap's input (weights) into the partials."""
    pid_t = tl.program_id(0)
    bi = tl.program_id(2).to(tl.int64)
    rows = pid_t * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    xb = x_ptr + bi * T * C
    sb = s_ptr + bi * (K - 1) * C
    m = (rows < T)[:, None] & cmask[None, :]
    off = bi * T * C + rows[:, None] * C + c[None, :]
    d = tl.load(g_ptr + off, mask=m, other=0.0).to(tl.float32)
    pos = _row_pos(p_ptr, rows, T, HAS_POS)
    if ACT:
        y = _conv_rows(xb, sb, w_ptr, b_ptr, rows, c, cmask, T, C, K, HAS_STATE, pos, HAS_POS)
        sg = tl.sigmoid(y)
        d = d * sg * (1.0 + y * (1.0 - sg))
    tl.store(d_ptr + off, d, mask=m)
    part = (bi * NT + pid_t) * (K + 1)
    tl.store(db_part + part * C + c, tl.sum(d, 0), mask=cmask)
    for j in tl.static_range(K):
        # tap j reads x[t - (K-1-j)] (the state before x); its tile is in L1 from _conv_rows
        xv = _tap_input(xb, sb, rows, c, cmask, T, C, K - 1 - j, K, HAS_STATE, pos, HAS_POS)
        tl.store(dw_part + (part + 1 + j) * C + c, tl.sum(d * xv, 0), mask=cmask)


@triton.jit
def _conv_dx(d_ptr, p_ptr, w_ptr, dx_ptr, ds_ptr, T, C, K: tl.constexpr, HAS_STATE: tl.constexpr,
             HAS_POS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, KP: tl.constexpr):
    """dx[t] = Σ_s d[t + s] w[K-1-s] (the transposed convolution of _conv_dpre's d; with HAS_POS
    only where pos[t + s] >= s), and the state's gradient (the inputs before t = 0) in the first
    tile of each batch row."""
    pid_t = tl.program_id(0)
    bi = tl.program_id(2).to(tl.int64)
    rows = pid_t * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = c < C
    db = d_ptr + bi * T * C
    dx = tl.zeros((BT, BC), dtype=tl.float32)
    for s in tl.static_range(K):
        r = rows + s
        rok = r < T
        if HAS_POS:
            rok = rok & (tl.load(p_ptr + r, mask=r < T, other=0) >= s)
        dv = tl.load(db + r[:, None] * C + c[None, :], mask=rok[:, None] & cmask[None, :], other=0.0)
        wj = tl.load(w_ptr + c * K + (K - 1 - s), mask=cmask, other=0.0).to(tl.float32)
        dx += dv * wj[None, :]
    m = (rows < T)[:, None] & cmask[None, :]
    tl.store(dx_ptr + bi * T * C + rows[:, None] * C + c[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
    if HAS_STATE:
        if pid_t == 0:
            p = tl.arange(0, KP) - (K - 1)  # the state's positions, before t = 0
            dst = tl.zeros((KP, BC), dtype=tl.float32)
            for s in tl.static_range(K):
                r_st = p + s
                ok = ((r_st >= 0) & (r_st < T))[:, None] & cmask[None, :]
                d_st = tl.load(db + r_st[:, None] * C + c[None, :], mask=ok, other=0.0)
                w_st = tl.load(w_ptr + c * K + (K - 1 - s), mask=cmask, other=0.0).to(tl.float32)
                dst += d_st * w_st[None, :]
            q = p + (K - 1)
            tl.store(ds_ptr + bi * (K - 1) * C + q[:, None] * C + c[None, :], dst.to(ds_ptr.dtype.element_ty),
                     mask=(q < K - 1)[:, None] & cmask[None, :])


def _conv_grid(x: Tensor, cfg: ConvKernelConfig):
    B, T, C = x.shape
    return (triton.cdiv(T, cfg.bt), triton.cdiv(C, cfg.bc), B)


@torch.library.custom_op("xlstm_kit::conv_fwd", mutates_args=())
def conv_fwd(x: Tensor, state: Optional[Tensor], w: Tensor, b: Tensor, act: bool, config: str,
             pos: Optional[Tensor] = None) -> Tensor:
    cfg = ConvKernelConfig.from_key(config)
    B, T, C = x.shape
    out = torch.empty_like(x)
    if x.numel():
        _conv_fwd[_conv_grid(x, cfg)](x, x if state is None else state, x if pos is None else pos, w, b, out, T, C,
                                      K=w.shape[1], HAS_STATE=state is not None, HAS_POS=pos is not None, ACT=act,
                                      BT=cfg.bt, BC=cfg.bc, num_warps=cfg.warps)
    return out


@conv_fwd.register_fake
def _(x, state, w, b, act, config, pos=None):
    return torch.empty_like(x)


@torch.library.custom_op("xlstm_kit::conv_bwd", mutates_args=())
def conv_bwd(dout: Tensor, x: Tensor, state: Optional[Tensor], w: Tensor, b: Tensor, act: bool,
             config: str, pos: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    cfg = ConvKernelConfig.from_key(config)
    B, T, C = x.shape
    K = w.shape[1]
    grid = _conv_grid(x, cfg)
    dx = torch.empty_like(x)
    ds = torch.zeros(B, K - 1, C, device=x.device, dtype=x.dtype) if state is not None else x.new_empty(0)
    parts = torch.empty(B * grid[0], K + 1, C, device=x.device, dtype=torch.float32)  # all written
    if x.numel():
        # two passes: ∂L/∂pre-activation once per element (float32 scratch), then its transposed
        # convolution; one pass recomputing it at the K shifts costed K² loads and ~230 registers
        d = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
        p = x if pos is None else pos
        _conv_dpre[grid](dout, x, x if state is None else state, p, w, b, d, parts, parts, T, C, grid[0],
                         K=K, HAS_STATE=state is not None, HAS_POS=pos is not None, ACT=act, BT=cfg.bt, BC=cfg.bc,
                         num_warps=cfg.bwd_warps)
        _conv_dx[grid](d, p, w, dx, ds, T, C, K=K, HAS_STATE=state is not None, HAS_POS=pos is not None,
                       BT=cfg.bt, BC=cfg.bc, KP=triton.next_power_of_2(max(K - 1, 1)), num_warps=cfg.bwd_warps)
    sums = parts.sum(0)  # [K + 1, C]: db, then the taps
    return dx, ds, torch.empty_like(w).copy_(sums[1:].t()), torch.empty_like(b).copy_(sums[0])


@conv_bwd.register_fake
def _(dout, x, state, w, b, act, config, pos=None):
    B, T, C = x.shape
    K = w.shape[1]
    ds = x.new_empty(B, K - 1, C) if state is not None else x.new_empty(0)
    return torch.empty_like(x), ds, torch.empty_like(w), torch.empty_like(b)


@assume_constant_result
def conv_config_key() -> str:
    return _CONV_KEY


_CONV_KEY = ConvKernelConfig().key()
