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
At batch 2-16 a program takes its row tile for a block of 16 batch rows (`batch_rows`) and
multiplies each weight tile into all of them on the tensor cores (`_dot_rows`), so the weights
are read once per step, not once per row (`matmul_config`). Everything inside is float32,
intermediates included (half-precision activations enter the products as two parts, ~16 bits), so the
step is at least as accurate as the PyTorch step (which rounds q, k, v, o, the gates, h and x1
to the activation dtype). No projection bias (the presets' layout), batch ≤ 16, no gradient. The custom op
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


BATCH_BLOCK = 16  # batch rows a program takes beyond batch 1 (tl.dot's least M)


def supports(op: str, *, dtype: torch.dtype, batch: int = 1, requires_grad: bool = False,
             bias: bool = False, **_) -> str | None:
    """backend.choose_backend's question: does the fused block step take this call?"""
    # up to one block of batch rows: beyond, the blocks re-read each weight tile and the
    # compiled PyTorch step's GEMMs take the whole batch in one pass
    return step_refusal("large", dtype=dtype, batch=batch, requires_grad=requires_grad, bias=bias,
                        max_batch=BATCH_BLOCK)


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


def batch_rows(batch: int) -> int:
    """Batch rows per program: 1 at batch 1 (the GEMV kernels), else blocks of 16 rows that
    share each weight tile through one tensor-core product (16: tl.dot's least M)."""
    return 1 if batch == 1 else BATCH_BLOCK


def matmul_config(rows: int, k: int, block_n: int = 32, tile: int = 2048, num_warps: int = 8) -> GemvConfig:
    """The launch of one weight pass for a block of batch rows (`batch_rows` > 1): `block_n`
    weight rows per program, [block_n, block_k] weight tiles of `tile` elements. The defaults:
    of the candidates in benchmarks/large_tune.py, the one whose sm_90 build has no spills at 16
    rows (108-139 registers); not yet timed against the others."""
    return GemvConfig(block_n, min(tile // block_n, max(16, triton.next_power_of_2(k))), num_warps)


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
def _dot_rows(a, w, acc, EXACT: tl.constexpr):
    """acc [BB, BN] + a [BB, BK] (float32) @ w[BN, BK]ᵀ on the tensor cores. Half-precision
    weights: a as two parts of w's dtype (a = hi + lo, twice the dtype's mantissa, where the
    PyTorch step's GEMM sees a rounded to the dtype); EXACT (float32 weights): one IEEE product."""
    wt = tl.trans(w)
    if EXACT:
        return tl.dot(a, wt, acc, input_precision="ieee")
    hi = a.to(w.dtype)
    acc = tl.dot(hi, wt, acc)
    return tl.dot((a - hi.to(tl.float32)).to(w.dtype), wt, acc)


@triton.jit
def _rms_matmul(x_ptr, b0, n_b, nw_ptr, w_ptr, rows, n_rows, eps, D: tl.constexpr, BB: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
    """`_rms_matvec` for the BB batch rows b0 + [0, BB) of x [n_b, D] at once: each weight tile
    is loaded once for all of them → [BB, BN] float32 (0 outside)."""
    bb = b0 + tl.arange(0, BB)
    mb = bb < n_b
    x_rows = x_ptr + bb[:, None].to(tl.int64) * D
    w_rows = w_ptr + rows[:, None].to(tl.int64) * D
    mr = rows < n_rows
    ss = tl.zeros([BB], dtype=tl.float32)
    acc = tl.zeros([BB, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        xv = tl.load(x_rows + kk[None, :], mask=mb[:, None] & mk[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(xv * xv, axis=1)
        xn = xv * tl.load(nw_ptr + kk, mask=mk, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        acc = _dot_rows(xn, w, acc, EXACT)
    return acc / tl.sqrt(ss / D + eps)[:, None]


@triton.jit
def _map_tile(x_ptr, b0, n_b, nw_ptr, w_ptr, out_ptr, t, N: tl.constexpr, eps, D: tl.constexpr,
              BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
    """Row tile t of one input map for the batch rows b0 + [0, BB) of x [n_b, D]:
    out[b, rows] = W[rows] @ (RMSNorm(x[b]) · nw), W [N, D], out [n_b, N]."""
    rows = t * BN + tl.arange(0, BN)
    if BB == 1:
        tl.store(out_ptr + b0 * N + rows, _rms_matvec(x_ptr + b0 * D, nw_ptr, w_ptr, rows, N, eps, D, BN, BK),
                 mask=rows < N)
    else:
        bb = b0 + tl.arange(0, BB)
        y = _rms_matmul(x_ptr, b0, n_b, nw_ptr, w_ptr, rows, N, eps, D, BB, BN, BK, EXACT)
        tl.store(out_ptr + bb[:, None] * N + rows[None, :], y, mask=(bb < n_b)[:, None] & (rows < N)[None, :])


@triton.jit
def _gates(x_ptr, b0, n_b, nw_ptr, wi_ptr, wf_ptr, bi_ptr, bf_ptr, i_ptr, f_ptr, eps, cap, D: tl.constexpr,
           H: tl.constexpr, HP: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
    """Both gates of the batch rows b0 + [0, BB): soft_cap(W_{i,f} RMSNorm(x[b]) · nw + b_{i,f}),
    H heads in an HP-row tile → i, f [n_b, H]."""
    hr = tl.arange(0, HP)
    mh = hr < H
    bias_i = tl.load(bi_ptr + hr, mask=mh, other=0.0).to(tl.float32)
    bias_f = tl.load(bf_ptr + hr, mask=mh, other=0.0).to(tl.float32)
    if BB == 1:
        xb = x_ptr + b0 * D
        gi = _rms_matvec(xb, nw_ptr, wi_ptr, hr, H, eps, D, HP, BK) + bias_i
        gf = _rms_matvec(xb, nw_ptr, wf_ptr, hr, H, eps, D, HP, BK) + bias_f
        tl.store(i_ptr + b0 * H + hr, cap * _tanh(gi / cap), mask=mh)
        tl.store(f_ptr + b0 * H + hr, cap * _tanh(gf / cap), mask=mh)
    else:
        bb = b0 + tl.arange(0, BB)
        gi = _rms_matmul(x_ptr, b0, n_b, nw_ptr, wi_ptr, hr, H, eps, D, BB, HP, BK, EXACT) + bias_i[None, :]
        gf = _rms_matmul(x_ptr, b0, n_b, nw_ptr, wf_ptr, hr, H, eps, D, BB, HP, BK, EXACT) + bias_f[None, :]
        at, m2 = bb[:, None] * H + hr[None, :], (bb < n_b)[:, None] & mh[None, :]
        tl.store(i_ptr + at, cap * _tanh(gi / cap), mask=m2)
        tl.store(f_ptr + at, cap * _tanh(gf / cap), mask=m2)


@triton.jit
def _in_kernel(x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr, wi_ptr, wf_ptr, bi_ptr, bf_ptr,
               q_ptr, k_ptr, v_ptr, o_ptr, i_ptr, f_ptr, n_b, eps, cap,
               D: tl.constexpr, QK: tl.constexpr, V: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr = 1, EXACT: tl.constexpr = False):
    """Program (batch block, tile t) of the n_b rows of x [n_b, D], BB rows a block: tiles
    [0, TQ) are row tiles of q, then of k, v (TV), o; the last both gates. Writes q, k [n_b, QK],
    v, o [n_b, V], i, f [n_b, H] (float32)."""
    b0 = tl.program_id(0).to(tl.int64) * BB
    t = tl.program_id(1)
    TQ: tl.constexpr = (QK + BN - 1) // BN
    TV: tl.constexpr = (V + BN - 1) // BN
    if t < TQ:
        _map_tile(x_ptr, b0, n_b, nw_ptr, wq_ptr, q_ptr, t, QK, eps, D, BB, BN, BK, EXACT)
    elif t < 2 * TQ:
        _map_tile(x_ptr, b0, n_b, nw_ptr, wk_ptr, k_ptr, t - TQ, QK, eps, D, BB, BN, BK, EXACT)
    elif t < 2 * TQ + TV:
        _map_tile(x_ptr, b0, n_b, nw_ptr, wv_ptr, v_ptr, t - 2 * TQ, V, eps, D, BB, BN, BK, EXACT)
    elif t < 2 * TQ + 2 * TV:
        _map_tile(x_ptr, b0, n_b, nw_ptr, wo_ptr, o_ptr, t - 2 * TQ - TV, V, eps, D, BB, BN, BK, EXACT)
    else:
        _gates(x_ptr, b0, n_b, nw_ptr, wi_ptr, wf_ptr, bi_ptr, bf_ptr, i_ptr, f_ptr, eps, cap, D, H, HP, BB, BK,
               EXACT)


@triton.jit
def _ffn_up_kernel(x_ptr, nw_ptr, wg_ptr, wu_ptr, u_ptr, n_b, eps, D: tl.constexpr, F: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, BB: tl.constexpr = 1, EXACT: tl.constexpr = False):
    """Program (batch block, row tile): u[b, rows] = SiLU(W_g[rows] @ xn) · (W_u[rows] @ xn),
    xn = RMSNorm(x[b]) · nw, for the block's BB rows b of x [n_b, D]; u [n_b, F] float32."""
    b0 = tl.program_id(0).to(tl.int64) * BB
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    if BB == 1:
        xb = x_ptr + b0 * D
        g = _rms_matvec(xb, nw_ptr, wg_ptr, rows, F, eps, D, BN, BK)
        up = _rms_matvec(xb, nw_ptr, wu_ptr, rows, F, eps, D, BN, BK)
        tl.store(u_ptr + b0 * F + rows, g * tl.sigmoid(g) * up, mask=rows < F)
    else:
        bb = b0 + tl.arange(0, BB)
        g = _rms_matmul(x_ptr, b0, n_b, nw_ptr, wg_ptr, rows, F, eps, D, BB, BN, BK, EXACT)
        up = _rms_matmul(x_ptr, b0, n_b, nw_ptr, wu_ptr, rows, F, eps, D, BB, BN, BK, EXACT)
        tl.store(u_ptr + bb[:, None] * F + rows[None, :], g * tl.sigmoid(g) * up,
                 mask=(bb < n_b)[:, None] & (rows < F)[None, :])


@triton.jit
def _head_stats_rows(h_rows, mb, D: tl.constexpr, BK: tl.constexpr, eps):
    """`_head_stats` of a head in each of BB rows: h_rows [BB] pointers to D features each
    (rows where mb is False read as zeros) → (mean, 1/std) [BB]. Two passes of BK-wide tiles
    (a [BB, D] tile would hold 16 x 512 floats in registers at the 7B's heads)."""
    s = tl.zeros([h_rows.shape[0]], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        s += tl.sum(tl.load(h_rows[:, None] + kk[None, :], mask=mb[:, None] & (kk < D)[None, :], other=0.0), axis=1)
    mean = s / D
    s = tl.zeros([h_rows.shape[0]], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        hv = tl.load(h_rows[:, None] + kk[None, :], mask=mb[:, None] & mk[None, :], other=0.0)
        dv = tl.where(mk[None, :], hv - mean[:, None], 0.0)
        s += tl.sum(dv * dv, axis=1)
    return mean, 1.0 / tl.sqrt(s / D + eps)


@triton.jit
def _out_kernel(u_ptr, o_ptr, nw_ptr, w_ptr, r_ptr, out_ptr, eps,
                N: tl.constexpr, K: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, NORM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, n_b=1, BB: tl.constexpr = 1, EXACT: tl.constexpr = False):
    """Program (batch block, row tile): out[b, rows] = r[b, rows] + W[rows] @ a with W [N, K] and
    a = u[b] (u [n_b, K]), or with NORM a = LayerNorm of each HD-wide head of u[b] (statistics
    recomputed here; HDP: HD rounded up to a power of two) · nw · sigmoid(o[b]); BB rows b a
    block (n_b is read only where BB > 1)."""
    b0 = tl.program_id(0).to(tl.int64) * BB
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    mr = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    if BB == 1:
        ub = u_ptr + b0 * K
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
                    og = tl.load(o_ptr + b0 * K + c, mask=mk, other=0.0)
                    a = (a - mean) * rstd * tl.load(nw_ptr + c, mask=mk, other=0.0).to(tl.float32) * tl.sigmoid(og)
                w = tl.load(w_rows + c[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
                acc += w.to(tl.float32) * a[None, :]
        r = tl.load(r_ptr + b0 * N + rows, mask=mr, other=0.0).to(tl.float32)
        tl.store(out_ptr + b0 * N + rows, (r + tl.sum(acc, axis=1)).to(out_ptr.dtype.element_ty), mask=mr)
    else:
        bb = b0 + tl.arange(0, BB)
        mb = bb < n_b
        u_rows = u_ptr + bb * K
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        for hh in range(K // HD):
            if NORM:
                mean, rstd = _head_stats_rows(u_rows + hh * HD, mb, HD, BK, eps)
            for k0 in range(0, HD, BK):
                kk = k0 + tl.arange(0, BK)
                mk = kk < HD
                c = hh * HD + kk
                m2 = mb[:, None] & mk[None, :]
                a = tl.load(u_rows[:, None] + c[None, :], mask=m2, other=0.0)
                if NORM:
                    og = tl.load(o_ptr + bb[:, None] * K + c[None, :], mask=m2, other=0.0)
                    nw = tl.load(nw_ptr + c, mask=mk, other=0.0).to(tl.float32)
                    a = (a - mean[:, None]) * rstd[:, None] * nw[None, :] * tl.sigmoid(og)
                w = tl.load(w_rows + c[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
                acc = _dot_rows(a, w, acc, EXACT)
        at, m2 = bb[:, None] * N + rows[None, :], mb[:, None] & mr[None, :]
        r = tl.load(r_ptr + at, mask=m2, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, (r + acc).to(out_ptr.dtype.element_ty), mask=m2)


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
    bb = batch_rows(B)
    config = gemv_config if bb == 1 else matmul_config
    # grid (batch blocks, row tiles), blocks the fastest axis: the programs of one row tile run
    # side by side and read its weights from HBM once between them (L2 holds a tile, not a 7B
    # matrix); at bb = 1 a block is one batch row
    blocks = triton.cdiv(B, bb)
    batch = dict(BB=bb, EXACT=w_up.dtype == torch.float32)
    with on_device(x):
        c = config(2 * QK + 2 * VD, d)
        tiles = 2 * triton.cdiv(QK, c.block_n) + 2 * triton.cdiv(VD, c.block_n) + 1
        _in_kernel[(blocks, tiles)](x, norm_w, wq, wk, wv, wo, wi, wf, bi, bf, q, k, v, o, i, f, B, norm_eps, cap,
                                    D=d, QK=QK, V=VD, H=H, HP=max(triton.next_power_of_2(H), 1 if bb == 1 else 16),
                                    BN=c.block_n, BK=c.block_k, num_warps=c.num_warps, **batch)
        h, n_new, m_new = _step_(q.view(B, H, K), k.view(B, H, K), v.view(B, H, V), i, f, C, n, m, eps, 0)
        c = config(d, VD)
        # K tiles stay inside a head (each has its own statistics); tl.dot takes K >= 16
        bk = max(min(c.block_k, triton.next_power_of_2(V)), 1 if bb == 1 else 16)
        _out_kernel[(blocks, triton.cdiv(d, c.block_n))](
            h, o, head_w, w_out, x, x1, head_eps, N=d, K=VD, HD=V, HDP=triton.next_power_of_2(V), NORM=True,
            BN=c.block_n, BK=bk, n_b=B, num_warps=c.num_warps, **batch)
        c = config(F, d)
        _ffn_up_kernel[(blocks, triton.cdiv(F, c.block_n))](x1, ffn_norm_w, w_gate, w_up, u, B, ffn_norm_eps, D=d,
                                                            F=F, BN=c.block_n, BK=c.block_k,
                                                            num_warps=c.num_warps, **batch)
        c = config(d, F)
        _out_kernel[(blocks, triton.cdiv(d, c.block_n))](u, u, u, w_down, x1, out, 0.0, N=d, K=F, HD=F, HDP=1,
                                                         NORM=False, BN=c.block_n, BK=c.block_k, n_b=B,
                                                         num_warps=c.num_warps, **batch)
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
