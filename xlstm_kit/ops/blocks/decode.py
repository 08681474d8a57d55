"""The NeurIPS mLSTM block's one-token step (decode) in four launches.

    x' = x + down((norm(h) · w + skip · x_conv) · SiLU(z)),  (x_m, z) = up(LayerNorm(x)),
    x_conv = SiLU(conv(x_m)),  q, k = headwise(x_conv),  v = headwise(x_m),
    (i, f) = W_g [q; k; v] + b_g,  h = the mLSTM cell step (ops/mlstm/triton/step.py)

At batch 1 a step of a small model is launch-bound: compiled, the block's PyTorch step is about
13 kernels of a few microseconds each (benchmarks/NOTES-generate.md). Here it is

1. `_up_kernel`: the LayerNorm (statistics recomputed by every program from the d_model-wide
   row) fused as the prologue of the up-projection GEMV;
2. `_mix_kernel`, one program per channel tile: the causal conv + SiLU, the head-wise q, k, v
   (a P-wide block of the conv output is recomputed per channel, so no tile needs another's),
   the conv state shifted in place, and each tile's partial sums of the gate pre-activations;
3. the cell step kernel, which adds the partial gate sums (C updated in place);
4. `_out_kernel`: head norm + skip + SiLU gate fused as the prologue of the down-projection
   GEMV, plus the residual.

Everything is float32 inside; the intermediates (x_m, z, q, k, v, x_conv, h) are float32 too,
so the step is at least as accurate as the PyTorch step it replaces (which rounds each of them
to the activation dtype). No bias in the projections (the presets' layout), batch ≤ 8 (each
batch row re-reads the weights: beyond a few rows the compiled PyTorch step's GEMMs win), no
gradient. The custom op `xlstm_kit::mlstm_block_step_` (C and the conv state updated in place)
keeps the four launches opaque to torch.compile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import on_device

MAX_BATCH = 8


def step_refusal(block: str, *, dtype: torch.dtype, batch: int, requires_grad: bool, bias: bool,
                 max_batch: int = MAX_BATCH) -> str | None:
    """What the fused block steps (this module, slstm_decode, large_decode) share: the reason a
    call is not theirs, or None."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the fused {block} block step takes float16, bfloat16 or float32, got {dtype}"
    if requires_grad:
        return f"the fused {block} block step has no backward"
    if batch > max_batch:
        # each batch row re-reads the weights: beyond a few rows the compiled PyTorch step's GEMMs win
        return f"the fused {block} block step is for decoding at batch <= {max_batch}, got {batch}"
    if bias:
        return f"the fused {block} block step has no projection biases"
    return None


def supports(op: str, *, dtype: torch.dtype, batch: int = 1, requires_grad: bool = False,
             bias: bool = False, block_size: int = 4, conv_kernel: int = 4, **_) -> str | None:
    """backend.choose_backend's question: does the fused block step take this call?"""
    why = step_refusal("mLSTM", dtype=dtype, batch=batch, requires_grad=requires_grad, bias=bias)
    if why:
        return why
    if conv_kernel < 2:
        return f"the fused mLSTM block step needs a convolution of width >= 2, got {conv_kernel}"
    if block_size & (block_size - 1):
        return f"the fused mLSTM block step needs a power-of-two q/k/v block size, got {block_size}"
    return None


@triton.jit
def _row_stats(row_ptr, D: tl.constexpr, BK: tl.constexpr, eps):
    """(mean, 1/std) of the LayerNorm of row_ptr[0:D], in two passes: the residual stream's mean
    can dwarf its spread."""
    s = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        s += tl.load(row_ptr + kk, mask=kk < D, other=0.0).to(tl.float32)
    mean = tl.sum(s, axis=0) / D
    s = tl.zeros([BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        dv = tl.where(kk < D, tl.load(row_ptr + kk, mask=kk < D, other=0.0).to(tl.float32) - mean, 0.0)
        s += dv * dv
    return mean, 1.0 / tl.sqrt(tl.sum(s, axis=0) / D + eps)


@triton.jit
def _head_stats(h_row, D: tl.constexpr, DP: tl.constexpr, eps):
    """(mean, 1/std) of one head's D features h_row[0:D] (float32; DP: D's power-of-two cover)."""
    dd = tl.arange(0, DP)
    hv = tl.load(h_row + dd, mask=dd < D, other=0.0)
    mean = tl.sum(hv, axis=0) / D
    dv = tl.where(dd < D, hv - mean, 0.0)
    return mean, 1.0 / tl.sqrt(tl.sum(dv * dv, axis=0) / D + eps)


@triton.jit
def _up_kernel(x_ptr, lnw_ptr, w_ptr, out_ptr, eps, D: tl.constexpr, DP: tl.constexpr, N: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """Program (row tile, batch row): out[b, rows] = W[rows] @ LayerNorm(x[b]) (no bias). The
    statistics come from the whole row in one tile (DP: D's power-of-two cover): each serial
    round of loads costs a program about a microsecond, which dominates a 125M-sized GEMV."""
    b = tl.program_id(1).to(tl.int64)
    mean, rstd = _row_stats(x_ptr + b * D, D, DP, eps)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mr = rows < N
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        xv = tl.load(x_ptr + b * D + kk, mask=mk, other=0.0).to(tl.float32)
        xn = (xv - mean) * rstd * tl.load(lnw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * D + kk[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        acc += w.to(tl.float32) * xn[None, :]
    tl.store(out_ptr + b * N + rows, tl.sum(acc, axis=1), mask=mr)


@triton.jit
def _mix_kernel(xz_ptr, cs_ptr, cw_ptr, cb_ptr, wq_ptr, wk_ptr, wv_ptr, wi_ptr, wf_ptr, bi_ptr, bf_ptr,
                q_ptr, k_ptr, v_ptr, xc_ptr, ip_ptr, fp_ptr,
                C: tl.constexpr, KC: tl.constexpr, P: tl.constexpr, H: tl.constexpr, HP: tl.constexpr,
                BC: tl.constexpr):
    """Program (channel tile, batch row) over channels c of [0, C): conv + SiLU, q, k, v, x_conv
    (float32 [B, C]), the conv state [B, KC-1, C] shifted in place, and this tile's partial gate
    sums to ip, fp [B, H, NT] (tile 0 adds the biases)."""
    t = tl.program_id(0)
    NT = tl.num_programs(0)
    b = tl.program_id(1).to(tl.int64)
    c = t * BC + tl.arange(0, BC)
    mc = c < C
    j = tl.arange(0, P)
    c2 = (c // P * P)[:, None] + j[None, :]               # [BC, P]: the inputs of channel c's block
    m2 = c2 < C
    xz = xz_ptr + b * 2 * C
    cs = cs_ptr + b * (KC - 1) * C
    xm2 = tl.load(xz + c2, mask=m2, other=0.0)
    conv2 = tl.load(cb_ptr + c2, mask=m2, other=0.0).to(tl.float32) \
        + tl.load(cw_ptr + c2 * KC + (KC - 1), mask=m2, other=0.0).to(tl.float32) * xm2
    xm = tl.load(xz + c, mask=mc, other=0.0)
    conv = tl.load(cb_ptr + c, mask=mc, other=0.0).to(tl.float32) \
        + tl.load(cw_ptr + c * KC + (KC - 1), mask=mc, other=0.0).to(tl.float32) * xm
    for s in tl.static_range(KC - 1):
        conv2 += tl.load(cw_ptr + c2 * KC + s, mask=m2, other=0.0).to(tl.float32) \
            * tl.load(cs + s * C + c2, mask=m2, other=0.0).to(tl.float32)
        conv += tl.load(cw_ptr + c * KC + s, mask=mc, other=0.0).to(tl.float32) \
            * tl.load(cs + s * C + c, mask=mc, other=0.0).to(tl.float32)
    xc2 = conv2 * tl.sigmoid(conv2)
    xc = conv * tl.sigmoid(conv)
    wo = c[:, None] * P + j[None, :]                      # weight [C/P, P, P] flat: (c, j)
    q = tl.sum(tl.load(wq_ptr + wo, mask=m2, other=0.0).to(tl.float32) * xc2, axis=1)
    k = tl.sum(tl.load(wk_ptr + wo, mask=m2, other=0.0).to(tl.float32) * xc2, axis=1)
    v = tl.sum(tl.load(wv_ptr + wo, mask=m2, other=0.0).to(tl.float32) * xm2, axis=1)
    tl.store(q_ptr + b * C + c, q, mask=mc)
    tl.store(k_ptr + b * C + c, k, mask=mc)
    tl.store(v_ptr + b * C + c, v, mask=mc)
    tl.store(xc_ptr + b * C + c, xc, mask=mc)
    # every thread of the tile has read the conv state of the tile's channels before any of it
    # is overwritten (the blocks c2 stay inside the tile: BC is a multiple of P)
    tl.debug_barrier()
    for s in tl.static_range(KC - 2):
        tl.store(cs + s * C + c, tl.load(cs + (s + 1) * C + c, mask=mc, other=0.0), mask=mc)
    if KC > 1:
        tl.store(cs + (KC - 2) * C + c, xm, mask=mc)
    hr = tl.arange(0, HP)
    mh = hr < H
    mg = mh[:, None] & mc[None, :]
    g = hr[:, None] * (3 * C) + c[None, :]               # gate weights [H, 3C]: q | k | v columns
    gi = tl.sum(tl.load(wi_ptr + g, mask=mg, other=0.0).to(tl.float32) * q[None, :]
                + tl.load(wi_ptr + g + C, mask=mg, other=0.0).to(tl.float32) * k[None, :]
                + tl.load(wi_ptr + g + 2 * C, mask=mg, other=0.0).to(tl.float32) * v[None, :], axis=1)
    gf = tl.sum(tl.load(wf_ptr + g, mask=mg, other=0.0).to(tl.float32) * q[None, :]
                + tl.load(wf_ptr + g + C, mask=mg, other=0.0).to(tl.float32) * k[None, :]
                + tl.load(wf_ptr + g + 2 * C, mask=mg, other=0.0).to(tl.float32) * v[None, :], axis=1)
    first = t == 0
    gi += tl.where(first, tl.load(bi_ptr + hr, mask=mh, other=0.0).to(tl.float32), 0.0)
    gf += tl.where(first, tl.load(bf_ptr + hr, mask=mh, other=0.0).to(tl.float32), 0.0)
    tl.store(ip_ptr + (b * H + hr) * NT + t, gi, mask=mh)
    tl.store(fp_ptr + (b * H + hr) * NT + t, gf, mask=mh)


@triton.jit
def _out_kernel(h_ptr, xc_ptr, xz_ptr, nw_ptr, skip_ptr, w_ptr, x_ptr, out_ptr, eps,
                C: tl.constexpr, DM: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                BN: tl.constexpr):
    """Program (row tile, batch row): out[b, rows] = x[b, rows] + W[rows] @ u with
    u = (norm(h) · nw + skip · x_conv) · SiLU(z), each head's statistics recomputed here. A head
    is one tile (DP: D's power-of-two cover), so its statistics and its products share one
    load, and the head loop is unrolled: the loads of all heads can be in flight together."""
    b = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    mr = rows < DM
    acc = tl.zeros([BN, DP], dtype=tl.float32)
    kk = tl.arange(0, DP)
    mk = kk < D
    for hh in tl.static_range(H):
        ci = hh * D + kk
        hv = tl.load(h_ptr + (b * H + hh) * D + kk, mask=mk, other=0.0)
        mean = tl.sum(hv, axis=0) / D
        dv = tl.where(mk, hv - mean, 0.0)
        hn = dv / tl.sqrt(tl.sum(dv * dv, axis=0) / D + eps)
        z = tl.load(xz_ptr + b * 2 * C + C + ci, mask=mk, other=0.0)
        u = (hn * tl.load(nw_ptr + ci, mask=mk, other=0.0).to(tl.float32)
             + tl.load(skip_ptr + ci, mask=mk, other=0.0).to(tl.float32)
             * tl.load(xc_ptr + b * C + ci, mask=mk, other=0.0)) * (z * tl.sigmoid(z))
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * C + ci[None, :], mask=mr[:, None] & mk[None, :], other=0.0)
        acc += w.to(tl.float32) * u[None, :]
    x = tl.load(x_ptr + b * DM + rows, mask=mr, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * DM + rows, (x + tl.sum(acc, axis=1)).to(out_ptr.dtype.element_ty), mask=mr)


def _block_step_(x: Tensor, ln_w: Tensor, up_w: Tensor, conv_w: Tensor, conv_b: Tensor, wq: Tensor, wk: Tensor,
                 wv: Tensor, wi: Tensor, wf: Tensor, bi: Tensor, bf: Tensor, norm_w: Tensor, skip: Tensor,
                 down_w: Tensor, conv: Tensor, C: Tensor, n: Tensor, m: Tensor, ln_eps: float, norm_eps: float,
                 eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, d]; the block's parameters (contiguous, as `MLSTMBlock` holds them); conv
    [B, KC-1, C], C [B, H, D, D] float32, both updated in place; n [B, H, D], m [B, H] float32
    → (x' [B, d] in x's dtype, n', m')."""
    from ..mlstm.triton.step import _step_

    B, d = x.shape
    Cn = up_w.shape[0] // 2
    H, D = C.shape[1], C.shape[2]
    P = wq.shape[-1]
    KC = conv_w.shape[-1]
    f32 = dict(device=x.device, dtype=torch.float32)
    xz = torch.empty(B, 2 * Cn, **f32)
    BC = max(P, min(128, triton.next_power_of_2(Cn)))
    NT = triton.cdiv(Cn, BC)
    q, k, v, xc = (torch.empty(B, Cn, **f32) for _ in range(4))
    ip, fp = torch.empty(B, H, NT, **f32), torch.empty(B, H, NT, **f32)
    out = torch.empty_like(x)
    with on_device(x):   # Triton launches on the current device, which need not be x's
        # 4 rows per program: ~770 programs for the 125M model's 3072 up-projection rows, each
        # one round of loads for the statistics and one per 1024 columns
        DP = triton.next_power_of_2(d)
        _up_kernel[(triton.cdiv(2 * Cn, 4), B)](x, ln_w, up_w, xz, ln_eps, D=d, DP=DP, N=2 * Cn, BN=4,
                                                BK=min(1024, DP), num_warps=4)
        _mix_kernel[(NT, B)](xz, conv, conv_w, conv_b, wq, wk, wv, wi, wf, bi, bf, q, k, v, xc, ip, fp,
                             C=Cn, KC=KC, P=P, H=H, HP=triton.next_power_of_2(H), BC=BC, num_warps=4)
        h, n_new, m_new = _step_(q.view(B, H, D), k.view(B, H, D), v.view(B, H, D), ip, fp, C, n, m, eps, 0)
        HP = triton.next_power_of_2(D)   # a head per tile of [BN, HP]: at most 2048 weights (the
        BN = max(1, min(4, 2048 // HP))  # unrolled heads' loads are in flight together: registers)
        _out_kernel[(triton.cdiv(d, BN), B)](h, xc, xz, norm_w, skip, down_w, x, out, norm_eps, C=Cn, DM=d, H=H,
                                             D=D, DP=HP, BN=BN, num_warps=4)
    return out, n_new, m_new


block_step_op = torch.library.custom_op("xlstm_kit::mlstm_block_step_", _block_step_, mutates_args=("conv", "C"))


@block_step_op.register_fake
def _(x, ln_w, up_w, conv_w, conv_b, wq, wk, wv, wi, wf, bi, bf, norm_w, skip, down_w, conv, C, n, m,
      ln_eps, norm_eps, eps):
    f32 = dict(device=x.device, dtype=torch.float32)
    return torch.empty_like(x), torch.empty(C.shape[:3], **f32), torch.empty(C.shape[:2], **f32)


def mlstm_block_step(block, x: Tensor, state, inplace: bool = False):
    """`MLSTMBlock.step` in four launches: x [B, d_model] and an `MLSTMState` (float32) →
    (x + layer(norm(x)) [B, d_model], new state). inplace: C and the conv state are updated in
    place (a decode loop); otherwise the old state is left as it was."""
    from ...nn.mlstm import MLSTMState

    layer = block.layer
    conv, C = state.conv, state.C
    if not inplace:
        conv, C = conv.clone(), C.clone()
    args = (x.contiguous(), block.norm.weight, layer.up_proj.weight, layer.conv.weight, layer.conv.bias,
            layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, layer.igate.weight, layer.fgate.weight,
            layer.igate.bias, layer.fgate.bias, layer.out_norm.weight, layer.skip, layer.down_proj.weight,
            conv, C, state.n.contiguous(), state.m.contiguous(),
            float(block.norm.eps), float(layer.out_norm.eps), 1e-6)
    # eagerly without the dispatcher (tens of microseconds; the four launches take about ten)
    y, n, m = (block_step_op if torch.compiler.is_compiling() else _block_step_)(*args)
    return y, MLSTMState(conv, C, n, m)
