"""The xLSTM-7B ("large") block's one-token step (decode) in five launches.

    x1 = x + out_proj(LN_heads(h) · w_h · sigmoid(o)),  h = the mLSTM cell step on
         q, k, v, o = W_{q,k,v,o} RMSNorm(x),  i, f = soft_cap(W_{i,f} RMSNorm(x) + b_{i,f}),
    x' = x1 + proj_down(SiLU(W_g RMSNorm(x1)) · W_u RMSNorm(x1))

1. `_in_kernel`: the RMSNorm as the prologue of one GEMV over the six input maps, each
   program taking a row tile of one map (the weights are not concatenated: a per-token cat
   would copy every weight each token), the last one both gates (bias, soft cap);
2. the mLSTM cell step kernel (ops/mlstm/triton/step.py; C updated in place);
3. `_out_kernel`: the per-head LayerNorm × sigmoid(o) as the prologue of the out_proj GEMV,
   plus the residual;
4. `_ffn_up_kernel`: the RMSNorm of x1 as the prologue of the SwiGLU's two up GEMVs, rows
   paired so that a program writes SiLU(g) · up;
5. `_out_kernel` again, without the norm: x1 + proj_down @ u.

The step is the streaming of the weights (the 7B: ~0.4 GB per block in bf16), so each GEMV
program takes `block_n` rows and walks K in `block_k`-wide tiles, accumulating in a float32
[block_n, block_k] register tile summed once at the end (`GemvConfig`). The norm statistics
are recomputed by every program from the row (a few KB from L2 beside a tile of weights).
Everything inside is float32, intermediates included, so the step is at least as accurate as
the PyTorch step (which rounds q, k, v, o, the gates, h and x1 to the activation dtype). No
projection bias (the presets' layout), batch ≤ 8, no gradient. The custom op
`xlstm_kit::large_block_step_` (C updated in place) keeps the launches opaque to torch.compile.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import on_device
from ..mlstm.triton.step import _step_
from ..slstm.triton.common import _tanh
from .decode import _head_stats, step_refusal


def supports(op: str, *, dtype: torch.dtype, batch: int = 1, requires_grad: bool = False,
             bias: bool = False, **_) -> str | None:
    """backend.choose_backend's question: does the fused block step take this call?"""
    # batch 1 only: its programs read a weight tile once per batch row and the rows' programs
    # do not share it through L2 (H200, 2026-12-02: 7B at batch 4, 445 tokens/s fused against
    # 690 for the compiled PyTorch step; 1.3B a tie; docs/kernels.md, "Decode kernels")
    return step_refusal("large", dtype=dtype, batch=batch, requires_grad=requires_grad, bias=bias, max_batch=1)


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of one GEMV: weight rows per program, width of the K tiles, warps."""

    block_n: int
    block_k: int
    num_warps: int = 8


def gemv_config(rows: int, k: int, programs: int = 512, tile: int = 4096, num_warps: int = 8,
                min_rows: int = 4) -> GemvConfig:
    """The launch of one GEMV over a [rows, k] weight: `programs` programs per batch row where
    the rows allow (a few hundred keep enough loads in flight to stream the weights), 16 down to
    `min_rows` rows per program (each program also loads its x and norm tiles), [block_n,
    block_k] tiles of `tile` elements. The defaults are the H200's best of the sweep in
    benchmarks/large_tune.py (docs/kernels.md, "Decode kernels")."""
    bn = 16
    while bn > min_rows and rows < programs * bn:
        bn //= 2
    return GemvConfig(bn, min(tile // bn, triton.next_power_of_2(k)), num_warps)


@triton.jit
def _rms_matvec(x_row, nw_ptr, w_ptr, rows, n_rows, eps, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """W[rows] @ (RMSNorm(x) · nw) → [BN] float32 (0 where rows ≥ n_rows); W [n_rows, D]. The
    norm only scales x, so 1/rms multiplies the sums at the end and x is read in one pass."""
    mr = rows < n_rows
    w_rows = w_ptr + rows[:, None].to(tl.int64) * D   # the 7B's maps stay below 2^31 elements; wider ones need not
    ss = tl.zeros([BK], dtype=tl.float32)
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        xv = tl.load(x_row + kk, mask=mk, other=0.0).to(tl.float32)
        ss += xv * xv
        xn = xv * tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        acc += w.to(tl.float32) * xn[None, :]
    return tl.sum(acc, axis=1) / tl.sqrt(tl.sum(ss, axis=0) / D + eps)


@triton.jit
def _map_tile(x_row, nw_ptr, w_ptr, out_row, t, N: tl.constexpr, eps, D: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr):
    """Row tile t of one input map: out[rows] = W[rows] @ (RMSNorm(x) · nw), W [N, D]."""
    rows = t * BN + tl.arange(0, BN)
    tl.store(out_row + rows, _rms_matvec(x_row, nw_ptr, w_ptr, rows, N, eps, D, BN, BK), mask=rows < N)


@triton.jit
def _in_kernel(x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr, wi_ptr, wf_ptr, bi_ptr, bf_ptr,
               q_ptr, k_ptr, v_ptr, o_ptr, i_ptr, f_ptr, eps, cap,
               D: tl.constexpr, QK: tl.constexpr, V: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """Program (batch row b, tile t): tiles [0, TQ) are row tiles of q, then of k, v (TV), o; the
    last both gates. Writes q, k [B, QK], v, o [B, V], i, f [B, H] (float32)."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    TQ: tl.constexpr = (QK + BN - 1) // BN
    TV: tl.constexpr = (V + BN - 1) // BN
    xb = x_ptr + b * D
    if t < TQ:
        _map_tile(xb, nw_ptr, wq_ptr, q_ptr + b * QK, t, QK, eps, D, BN, BK)
    elif t < 2 * TQ:
        _map_tile(xb, nw_ptr, wk_ptr, k_ptr + b * QK, t - TQ, QK, eps, D, BN, BK)
    elif t < 2 * TQ + TV:
        _map_tile(xb, nw_ptr, wv_ptr, v_ptr + b * V, t - 2 * TQ, V, eps, D, BN, BK)
    elif t < 2 * TQ + 2 * TV:
        _map_tile(xb, nw_ptr, wo_ptr, o_ptr + b * V, t - 2 * TQ - TV, V, eps, D, BN, BK)
    else:
        hr = tl.arange(0, HP)
        mh = hr < H
        gi = _rms_matvec(xb, nw_ptr, wi_ptr, hr, H, eps, D, HP, BK) \
            + tl.load(bi_ptr + hr, mask=mh, other=0.0).to(tl.float32)
        gf = _rms_matvec(xb, nw_ptr, wf_ptr, hr, H, eps, D, HP, BK) \
            + tl.load(bf_ptr + hr, mask=mh, other=0.0).to(tl.float32)
        tl.store(i_ptr + b * H + hr, cap * _tanh(gi / cap), mask=mh)
        tl.store(f_ptr + b * H + hr, cap * _tanh(gf / cap), mask=mh)


@triton.jit
def _ffn_up_kernel(x_ptr, nw_ptr, wg_ptr, wu_ptr, u_ptr, eps, D: tl.constexpr, F: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
    """Program (batch row b, row tile): u[b, rows] = SiLU(W_g[rows] @ xn) · (W_u[rows] @ xn),
    xn = RMSNorm(x[b]) · nw; u [B, F] float32."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    xb = x_ptr + b * D
    g = _rms_matvec(xb, nw_ptr, wg_ptr, rows, F, eps, D, BN, BK)
    up = _rms_matvec(xb, nw_ptr, wu_ptr, rows, F, eps, D, BN, BK)
    tl.store(u_ptr + b * F + rows, g * tl.sigmoid(g) * up, mask=rows < F)


@triton.jit
def _out_kernel(u_ptr, o_ptr, nw_ptr, w_ptr, r_ptr, out_ptr, eps,
                N: tl.constexpr, K: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, NORM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    """Program (batch row b, row tile): out[b, rows] = r[b, rows] + W[rows] @ a with W [N, K] and
    a = u[b] (u [B, K]), or with NORM a = LayerNorm of each HD-wide head of u[b] (statistics
    recomputed here; HDP: HD rounded up to a power of two) · nw · sigmoid(o[b])."""
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    mr = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    ub = u_ptr + b * K
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for hh in range(K // HD):
        if NORM:
            mean, rstd = _head_stats(ub + hh * HD, HD, HDP, eps)
        for k0 in range(0, HD, BK):
            kk = k0 + tl.arange(0, BK)
            mk = kk < HD
            c = hh * HD + kk
            a = tl.load(ub + c, mask=mk, other=0.0)
            if NORM:
                og = tl.load(o_ptr + b * K + c, mask=mk, other=0.0)
                a = (a - mean) * rstd * tl.load(nw_ptr + c, mask=mk, other=0.0).to(tl.float32) * tl.sigmoid(og)
            w = tl.load(w_rows + c[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :]
    r = tl.load(r_ptr + b * N + rows, mask=mr, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * N + rows, (r + tl.sum(acc, axis=1)).to(out_ptr.dtype.element_ty), mask=mr)


def _large_block_step_(x: Tensor, norm_w: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, wi: Tensor,
                       wf: Tensor, bi: Tensor, bf: Tensor, head_w: Tensor, w_out: Tensor, ffn_norm_w: Tensor,
                       w_gate: Tensor, w_up: Tensor, w_down: Tensor, C: Tensor, n: Tensor, m: Tensor,
                       norm_eps: float, ffn_norm_eps: float, head_eps: float, cap: float,
                       eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, d]; the block's parameters (contiguous, as `LargeBlock` holds them); C [B, H, K, V]
    float32, updated in place; n [B, H, K], m [B, H] float32 → (x' [B, d] in x's dtype, n', m')."""
    B, d = x.shape
    H, K, V = C.shape[1:]
    QK, VD, F = H * K, H * V, w_up.shape[0]
    f32 = dict(device=x.device, dtype=torch.float32)
    q, k = torch.empty(B, QK, **f32), torch.empty(B, QK, **f32)
    v, o = torch.empty(B, VD, **f32), torch.empty(B, VD, **f32)
    i, f = torch.empty(B, H, **f32), torch.empty(B, H, **f32)
    # x1 in float32: the PyTorch step rounds it to x's dtype, an error of the residual stream
    # that both later launches would inherit; it is only B·d·4 bytes
    x1 = torch.empty(B, d, **f32)
    u = torch.empty(B, F, **f32)
    out = torch.empty_like(x)
    # the batch row is the fastest grid axis: the B programs of one row tile run side by side
    # and read its weights from HBM once between them (L2 holds a tile, not a 7B matrix)
    with on_device(x):
        c = gemv_config(2 * QK + 2 * VD, d)
        tiles = 2 * triton.cdiv(QK, c.block_n) + 2 * triton.cdiv(VD, c.block_n) + 1
        _in_kernel[(B, tiles)](x, norm_w, wq, wk, wv, wo, wi, wf, bi, bf, q, k, v, o, i, f, norm_eps, cap,
                               D=d, QK=QK, V=VD, H=H, HP=triton.next_power_of_2(H), BN=c.block_n, BK=c.block_k,
                               num_warps=c.num_warps)
        h, n_new, m_new = _step_(q.view(B, H, K), k.view(B, H, K), v.view(B, H, V), i, f, C, n, m, eps, 0)
        c = gemv_config(d, VD)
        # K tiles stay inside a head (each has its own statistics)
        _out_kernel[(B, triton.cdiv(d, c.block_n))](
            h, o, head_w, w_out, x, x1, head_eps, N=d, K=VD, HD=V, HDP=triton.next_power_of_2(V), NORM=True,
            BN=c.block_n, BK=min(c.block_k, triton.next_power_of_2(V)), num_warps=c.num_warps)
        c = gemv_config(F, d)
        _ffn_up_kernel[(B, triton.cdiv(F, c.block_n))](x1, ffn_norm_w, w_gate, w_up, u, ffn_norm_eps, D=d, F=F,
                                                       BN=c.block_n, BK=c.block_k, num_warps=c.num_warps)
        c = gemv_config(d, F)
        _out_kernel[(B, triton.cdiv(d, c.block_n))](u, u, u, w_down, x1, out, 0.0, N=d, K=F, HD=F, HDP=1,
                                                    NORM=False, BN=c.block_n, BK=c.block_k,
                                                    num_warps=c.num_warps)
    return out, n_new, m_new


large_block_step_op = torch.library.custom_op("xlstm_kit::large_block_step_", _large_block_step_,
                                              mutates_args=("C",))


@large_block_step_op.register_fake
def _(x, norm_w, wq, wk, wv, wo, wi, wf, bi, bf, head_w, w_out, ffn_norm_w, w_gate, w_up, w_down, C, n, m,
      norm_eps, ffn_norm_eps, head_eps, cap, eps):
    f32 = dict(device=x.device, dtype=torch.float32)
    return torch.empty_like(x), torch.empty(C.shape[:3], **f32), torch.empty(C.shape[:2], **f32)


def large_block_step(x: Tensor, norm_w: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, wi: Tensor,
                     wf: Tensor, bi: Tensor, bf: Tensor, head_w: Tensor, w_out: Tensor, ffn_norm_w: Tensor,
                     w_gate: Tensor, w_up: Tensor, w_down: Tensor, C: Tensor, n: Tensor, m: Tensor,
                     norm_eps: float, ffn_norm_eps: float, head_eps: float, cap: float,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`LargeBlock.step` in five launches, on the block's tensors (see `_large_block_step_`; the
    layer, `LargeBlock.fused_step`, gathers them): C is updated in place → (x', n', m')."""
    # eagerly without the dispatcher (tens of microseconds, as long as the five launches at batch 1)
    return (large_block_step_op if torch.compiler.is_compiling() else _large_block_step_)(
        x, norm_w, wq, wk, wv, wo, wi, wf, bi, bf, head_w, w_out, ffn_norm_w, w_gate, w_up, w_down, C, n, m,
        norm_eps, ffn_norm_eps, head_eps, cap, eps)
