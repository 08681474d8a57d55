"""The sLSTM block's one-token step (decode) in three launches.

    x1 = x + norm(h') · w_n,   x' = x1 + down(GELU(g) · u),  (g, u) = up(LayerNorm(x1)),
    h' = the sLSTM cell on the gates  W_g · in_g + R_g^T h + b_g  of  xn = LayerNorm(x),
    in_i = in_f = SiLU(conv(xn)) (xn without a convolution),  in_z = in_o = xn

1. `_cell_kernel`, one program per (head, tile of the head's units): the LayerNorm (statistics
   recomputed from the row), the causal conv + SiLU of the head's channels, the four gates'
   head-wise input and recurrent products, and the stabilised cell update of the tile's units;
   the new h, c, n, m and conv state are written to new buffers, since other programs of the
   head still read the old h and conv state;
2. `_ffn_up_kernel`: x1 (head norm of h' + residual) and its LayerNorm recomputed as the
   prologue of the gated up-projection GEMV, GELU(g) · u as its epilogue; program 0 also keeps
   x1 for the last launch;
3. the down-projection GEMV plus the residual x1 (large_decode's `_out_kernel`).

Everything is float32 inside (the PyTorch step rounds xn, the gates, x1 and the feed-forward's
hidden units to the activation dtype), batch <= 8 (decode.MAX_BATCH), no feed-forward bias, no gradient.
The custom op `xlstm_kit::slstm_block_step` keeps the three launches opaque to torch.compile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import on_device
from .decode import _row_stats, step_refusal
from .large_decode import _out_kernel, gemv_config


def supports(op: str, *, dtype: torch.dtype, batch: int = 1, requires_grad: bool = False,
             bias: bool = False, **_) -> str | None:
    """backend.choose_backend's question: does the fused sLSTM block step take this call?"""
    return step_refusal("sLSTM", dtype=dtype, batch=batch, requires_grad=requires_grad, bias=bias)


@triton.jit
def _cell_kernel(x_ptr, lnw_ptr, cs_ptr, cw_ptr, cb_ptr, gw_ptr, r_ptr, bias_ptr, h_ptr, c_ptr, n_ptr, m_ptr,
                 cs_new_ptr, h_new_ptr, c_new_ptr, n_new_ptr, m_new_ptr, eps,
                 DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, KC: tl.constexpr, NT: tl.constexpr,
                 BO: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr):
    """Program (head · NT + unit tile, batch row). gw [4, H, D_out, D_in], r [4, H, D_in, D_out],
    bias [4, H, D]; h, c, n, m [B, H, D] and the conv state [B, KC-1, DM] float32 (KC = 0: no
    convolution)."""
    hh = tl.program_id(0) // NT
    t = tl.program_id(0) % NT
    b = tl.program_id(1).to(tl.int64)
    mean, rstd = _row_stats(x_ptr + b * DM, DM, BK, eps)
    o = t * BO + tl.arange(0, BO)
    mo = o < D
    acc_i = tl.zeros([BO, BJ], dtype=tl.float32)
    acc_f = tl.zeros([BO, BJ], dtype=tl.float32)
    acc_z = tl.zeros([BO, BJ], dtype=tl.float32)
    acc_o = tl.zeros([BO, BJ], dtype=tl.float32)
    GS: tl.constexpr = H * D * D   # one gate's weights
    for j0 in range(0, D, BJ):
        j = j0 + tl.arange(0, BJ)
        mj = j < D
        ch = hh * D + j
        xn = (tl.load(x_ptr + b * DM + ch, mask=mj, other=0.0).to(tl.float32) - mean) * rstd \
            * tl.load(lnw_ptr + ch, mask=mj, other=0.0).to(tl.float32)
        xn = tl.where(mj, xn, 0.0)
        if KC > 0:
            conv = tl.load(cb_ptr + ch, mask=mj, other=0.0).to(tl.float32) \
                + tl.load(cw_ptr + ch * KC + (KC - 1), mask=mj, other=0.0).to(tl.float32) * xn
            for s in tl.static_range(KC - 1):
                conv += tl.load(cw_ptr + ch * KC + s, mask=mj, other=0.0).to(tl.float32) \
                    * tl.load(cs_ptr + (b * (KC - 1) + s) * DM + ch, mask=mj, other=0.0)
            xc = conv * tl.sigmoid(conv)
        else:
            xc = xn
        hp = tl.load(h_ptr + (b * H + hh) * D + j, mask=mj, other=0.0)
        m2 = mo[:, None] & mj[None, :]
        wo = (hh * D + o[:, None]) * D + j[None, :]      # W[g, hh, o, j]
        ro = (hh * D + j[None, :]) * D + o[:, None]      # R[g, hh, j, o]
        acc_i += tl.load(gw_ptr + wo, mask=m2, other=0.0).to(tl.float32) * xc[None, :] \
            + tl.load(r_ptr + ro, mask=m2, other=0.0).to(tl.float32) * hp[None, :]
        acc_f += tl.load(gw_ptr + GS + wo, mask=m2, other=0.0).to(tl.float32) * xc[None, :] \
            + tl.load(r_ptr + GS + ro, mask=m2, other=0.0).to(tl.float32) * hp[None, :]
        acc_z += tl.load(gw_ptr + 2 * GS + wo, mask=m2, other=0.0).to(tl.float32) * xn[None, :] \
            + tl.load(r_ptr + 2 * GS + ro, mask=m2, other=0.0).to(tl.float32) * hp[None, :]
        acc_o += tl.load(gw_ptr + 3 * GS + wo, mask=m2, other=0.0).to(tl.float32) * xn[None, :] \
            + tl.load(r_ptr + 3 * GS + ro, mask=m2, other=0.0).to(tl.float32) * hp[None, :]
    bo = hh * D + o
    gi = tl.sum(acc_i, axis=1) + tl.load(bias_ptr + bo, mask=mo, other=0.0).to(tl.float32)
    gf = tl.sum(acc_f, axis=1) + tl.load(bias_ptr + H * D + bo, mask=mo, other=0.0).to(tl.float32)
    gz = tl.sum(acc_z, axis=1) + tl.load(bias_ptr + 2 * H * D + bo, mask=mo, other=0.0).to(tl.float32)
    go = tl.sum(acc_o, axis=1) + tl.load(bias_ptr + 3 * H * D + bo, mask=mo, other=0.0).to(tl.float32)
    so = (b * H + hh) * D + o
    c = tl.load(c_ptr + so, mask=mo, other=0.0)
    n = tl.load(n_ptr + so, mask=mo, other=0.0)
    m = tl.load(m_ptr + so, mask=mo, other=0.0)
    log_f = tl.minimum(gf, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(gf)))   # logsigmoid, stable both ways
    m_new = tl.maximum(log_f + m, gi)
    ig = tl.exp(gi - m_new)
    fg = tl.exp(log_f + m - m_new)
    tz = 2.0 * tl.sigmoid(2.0 * gz) - 1.0                              # tanh
    c_new = fg * c + ig * tz
    n_new = fg * n + ig
    tl.store(h_new_ptr + so, tl.sigmoid(go) * c_new / n_new, mask=mo)
    tl.store(c_new_ptr + so, c_new, mask=mo)
    tl.store(n_new_ptr + so, n_new, mask=mo)
    tl.store(m_new_ptr + so, m_new, mask=mo)
    if KC > 1:   # the new conv state of this tile's channels: shifted by one, then xn
        for s in tl.static_range(KC - 2):
            tl.store(cs_new_ptr + (b * (KC - 1) + s) * DM + bo,
                     tl.load(cs_ptr + (b * (KC - 1) + s + 1) * DM + bo, mask=mo, other=0.0), mask=mo)
        xo = (tl.load(x_ptr + b * DM + bo, mask=mo, other=0.0).to(tl.float32) - mean) * rstd \
            * tl.load(lnw_ptr + bo, mask=mo, other=0.0).to(tl.float32)
        tl.store(cs_new_ptr + (b * (KC - 1) + KC - 2) * DM + bo, xo, mask=mo)


@triton.jit
def _ffn_up_kernel(x_ptr, h_ptr, nw_ptr, lnw_ptr, w_ptr, x1_ptr, u_ptr, hn_eps, ln_eps,
                   DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DMP: tl.constexpr, F: tl.constexpr,
                   BN: tl.constexpr):
    """Program (row tile, batch row): x1 = x + norm(h') · nw (float32, kept by program 0), then
    u[rows] = GELU(W_g[rows] @ LN(x1)) · (W_u[rows] @ LN(x1)) with W = [W_g; W_u] [2F, DM].
    The whole row is one tile (DMP: DM's power-of-two cover): x1, its statistics and the
    products come from one round of loads (each round costs a program about a microsecond);
    a head's statistics are masked sums over the row (D need not be a power of two)."""
    b = tl.program_id(1).to(tl.int64)
    kk = tl.arange(0, DMP)
    mk = kk < DM
    hv = tl.load(h_ptr + b * DM + kk, mask=mk, other=0.0)   # h' [B, H, D] is [B, DM]
    head = kk // D
    h_mean = tl.zeros([DMP], dtype=tl.float32)
    h_rstd = tl.zeros([DMP], dtype=tl.float32)
    for hh in tl.static_range(H):
        sel = mk & (head == hh)
        mu = tl.sum(tl.where(sel, hv, 0.0), axis=0) / D
        dv = tl.where(sel, hv - mu, 0.0)
        h_mean = tl.where(sel, mu, h_mean)
        h_rstd = tl.where(sel, 1.0 / tl.sqrt(tl.sum(dv * dv, axis=0) / D + hn_eps), h_rstd)
    x1 = tl.load(x_ptr + b * DM + kk, mask=mk, other=0.0).to(tl.float32) \
        + (hv - h_mean) * h_rstd * tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
    tl.store(x1_ptr + b * DM + kk, x1, mask=mk & (tl.program_id(0) == 0))
    mean = tl.sum(x1, axis=0) / DM
    dv = tl.where(mk, x1 - mean, 0.0)
    xn = dv / tl.sqrt(tl.sum(dv * dv, axis=0) / DM + ln_eps) * tl.load(lnw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mr = rows < F
    m2 = mr[:, None] & mk[None, :]
    w = w_ptr + rows[:, None].to(tl.int64) * DM + kk[None, :]
    g = tl.sum(tl.load(w, mask=m2, other=0.0).to(tl.float32) * xn[None, :], axis=1)
    up = tl.sum(tl.load(w + F * DM, mask=m2, other=0.0).to(tl.float32) * xn[None, :], axis=1)
    tl.store(u_ptr + b * F + rows, 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)) * up, mask=mr)


def _block_step(x: Tensor, ln_w: Tensor, conv_w: Tensor, conv_b: Tensor, gate_w: Tensor, r: Tensor, bias: Tensor,
                norm_w: Tensor, ffn_ln_w: Tensor, up_w: Tensor, down_w: Tensor, conv: Tensor, h: Tensor, c: Tensor,
                n: Tensor, m: Tensor, conv_kernel: int, ln_eps: float, norm_eps: float, ffn_eps: float
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """x [B, d]; the block's parameters as `SLSTMBlock` holds them (conv_w [d, KC], conv_b [d];
    any tensors when conv_kernel KC = 0: no convolution); conv [B, KC-1, d], h, c, n, m
    [B, H, D] float32 → (x' [B, d] in x's dtype, conv', h', c', n', m') (new tensors)."""
    B, d = x.shape
    _, H, D, _ = gate_w.shape
    KC = conv_kernel
    F = down_w.shape[1]
    f32 = dict(device=x.device, dtype=torch.float32)
    conv_new = torch.empty_like(conv)
    # an empty tensor's null pointer is refused at launch; the kernel reads no conv state then
    cs, cs_new = (conv, conv_new) if conv.numel() else (h, h)
    h_new, c_new, n_new, m_new = (torch.empty(B, H, D, **f32) for _ in range(4))
    BO = min(8, triton.next_power_of_2(D))   # 125M: 4 heads x 24 tiles of 8 of 192 units, 87 registers
    NT = triton.cdiv(D, BO)
    DMP = triton.next_power_of_2(d)   # a row in one tile: the LayerNorm statistics, the up GEMV
    with on_device(x):
        _cell_kernel[(H * NT, B)](x, ln_w, cs, conv_w, conv_b, gate_w, r, bias, h, c, n, m,
                                  cs_new, h_new, c_new, n_new, m_new, ln_eps, DM=d, H=H, D=D, KC=KC, NT=NT,
                                  BO=BO, BJ=min(64, triton.next_power_of_2(D)), BK=DMP, num_warps=4)
        x1, u = torch.empty(B, d, **f32), torch.empty(B, F, **f32)
        BN = max(1, 4096 // DMP)   # 125M: 4 rows x 1024 columns a program, 256 programs
        _ffn_up_kernel[(triton.cdiv(F, BN), B)](x, h_new, norm_w, ffn_ln_w, up_w, x1, u, norm_eps, ffn_eps, DM=d,
                                                H=H, D=D, DMP=DMP, F=F, BN=BN, num_warps=4)
        out = torch.empty_like(x)
        g = gemv_config(d, F)
        _out_kernel[(B, triton.cdiv(d, g.block_n))](u, u, u, down_w, x1, out, 0.0, N=d, K=F, HD=F, HDP=1,
                                                    NORM=False, BN=g.block_n, BK=g.block_k, num_warps=g.num_warps)
    return out, conv_new, h_new, c_new, n_new, m_new


block_step_op = torch.library.custom_op("xlstm_kit::slstm_block_step", _block_step, mutates_args=())


@block_step_op.register_fake
def _(x, ln_w, conv_w, conv_b, gate_w, r, bias, norm_w, ffn_ln_w, up_w, down_w, conv, h, c, n, m,
      conv_kernel, ln_eps, norm_eps, ffn_eps):
    return (torch.empty_like(x), torch.empty_like(conv), *(torch.empty(h.shape, device=x.device, dtype=torch.float32)
                                                           for _ in range(4)))


def slstm_block_step(x: Tensor, ln_w: Tensor, conv_w: Tensor, conv_b: Tensor, gate_w: Tensor, r: Tensor,
                     bias: Tensor, norm_w: Tensor, ffn_ln_w: Tensor, up_w: Tensor, down_w: Tensor, conv: Tensor,
                     h: Tensor, c: Tensor, n: Tensor, m: Tensor, conv_kernel: int, ln_eps: float, norm_eps: float,
                     ffn_eps: float) -> tuple[Tensor, ...]:
    """`SLSTMBlock.step` in three launches, on the block's tensors (see `_block_step`; the layer,
    `SLSTMBlock.fused_step`, gathers them) → (x', conv', h', c', n', m')."""
    return (block_step_op if torch.compiler.is_compiling() else _block_step)(
        x, ln_w, conv_w, conv_b, gate_w, r, bias, norm_w, ffn_ln_w, up_w, down_w, conv, h, c, n, m,
        conv_kernel, ln_eps, norm_eps, ffn_eps)
