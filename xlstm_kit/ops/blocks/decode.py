"""The NeurIPS mLSTM block's one-token step (decode) in three launches.

    x' = x + down((norm(h) · w + skip · x_conv) · SiLU(z)),  (x_m, z) = up(LayerNorm(x)),
    x_conv = SiLU(conv(x_m)),  q, k = headwise(x_conv),  v = headwise(x_m),
    (i, f) = W_g [q; k; v] + b_g,  h = the mLSTM cell step (ops/mlstm/triton/step.py)

At batch 1 a step of a small model is launch-bound: compiled, the block's PyTorch step is about
13 kernels of a few microseconds each (docs/kernels.md, "Decode kernels"). Here it is

1. `_up_mix_kernel`: the LayerNorm (statistics recomputed by every program from the d_model-wide
   row) fused as the prologue of the up-projection GEMV, whose x_m row tiles (whole P-blocks of
   channels) go on to the causal conv + SiLU, the head-wise q, k, v, the conv state shifted in
   place and each tile's partial sums of the gate pre-activations; its z row tiles store z;
2. the cell step kernel, which adds the partial gate sums (C updated in place);
3. `_out_kernel`: head norm + skip + SiLU gate fused as the prologue of the down-projection
   GEMV, plus the residual.

Everything is float32 inside; the intermediates (z, q, k, v, x_conv, h) are float32 too, so the
step is at least as accurate as the PyTorch step it replaces (which rounds each of them to the
activation dtype). No bias in the projections (the presets' layout), batch ≤ 8 (each batch row
re-reads the weights: beyond a few rows the compiled PyTorch step's GEMMs win), no gradient.
The custom op `xlstm_kit::mlstm_block_step_` (C and the conv state updated in place) keeps the
three launches opaque to torch.compile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..backend import on_device
from ..mlstm.triton.step import _step_

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
def _up_mix_kernel(x_ptr, lnw_ptr, w_ptr, cs_ptr, cw_ptr, cb_ptr, wq_ptr, wk_ptr, wv_ptr, wi_ptr, wf_ptr,
                   bi_ptr, bf_ptr, z_ptr, q_ptr, k_ptr, v_ptr, xc_ptr, ip_ptr, fp_ptr, eps,
                   D: tl.constexpr, DP: tl.constexpr, C: tl.constexpr, KC: tl.constexpr, KCP: tl.constexpr,
                   P: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (row tile t of 2·NT, batch row b), NT = cdiv(C, BN), BN a multiple of P: the rows
    of the up-projection W [2C, D] times LayerNorm(x[b]) (no bias). Tiles t < NT own channels
    c = t·BN + [0, BN) of x_m (whole P-blocks) and go on to the rest of the block's mixing for
    them: conv + SiLU → x_conv, q, k (from x_conv), v (from x_m) (float32 [B, C]), the conv state
    [B, KC-1, C] shifted in place, and the tile's partial gate sums to ip, fp [B, H, NT] (tile 0
    adds the biases). Tiles t >= NT store z (float32 [B, C]) for channels (t - NT)·BN + [0, BN).

    The LayerNorm statistics come from the whole row in one tile (DP: D's power-of-two cover;
    KCP, HP: those of KC-1 and H): each serial round of loads costs a program about a
    microsecond, which dominates a 125M-sized GEMV. For the same reason the mixing's weights and
    the conv state are loaded before the GEMV, so their latency hides behind its loads: the
    kernel has no branch, the z tiles' mixing is masked off (loads and stores)."""
    NT: tl.constexpr = (C + BN - 1) // BN
    t = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    is_x = t < NT
    # channels as [BN/P, P]: a P-block per row, so the block-diagonal products stay in registers
    j = tl.arange(0, P)
    c = tl.where(is_x, t, t - NT) * BN + (tl.arange(0, BN // P) * P)[:, None] + j[None, :]
    mc = c < C
    mx = mc & is_x
    cs = cs_ptr + b * (KC - 1) * C
    s = tl.arange(0, KCP)[:, None, None]                  # conv state slots: [KCP, 1, 1]
    ms = (s < KC - 1) & mx[None, :, :]
    old = tl.load(cs + s * C + c[None, :, :], mask=ms, other=0.0)
    cws = tl.load(cw_ptr + c[None, :, :] * KC + s, mask=ms, other=0.0).to(tl.float32)
    cwl = tl.load(cw_ptr + c * KC + (KC - 1), mask=mx, other=0.0).to(tl.float32)
    cb = tl.load(cb_ptr + c, mask=mx, other=0.0).to(tl.float32)
    wo = c[:, :, None] * P + j[None, None, :]            # weight [C/P, P, P] flat: (c, j)
    m3 = mx[:, :, None]
    wq = tl.load(wq_ptr + wo, mask=m3, other=0.0).to(tl.float32)
    wk = tl.load(wk_ptr + wo, mask=m3, other=0.0).to(tl.float32)
    wv = tl.load(wv_ptr + wo, mask=m3, other=0.0).to(tl.float32)
    hr = tl.arange(0, HP)
    mh = hr < H
    mg = mh[:, None, None] & mx[None, :, :]
    g = hr[:, None, None] * (3 * C) + c[None, :, :]       # gate weights [H, 3C]: q | k | v columns
    wiq = tl.load(wi_ptr + g, mask=mg, other=0.0).to(tl.float32)
    wik = tl.load(wi_ptr + g + C, mask=mg, other=0.0).to(tl.float32)
    wiv = tl.load(wi_ptr + g + 2 * C, mask=mg, other=0.0).to(tl.float32)
    wfq = tl.load(wf_ptr + g, mask=mg, other=0.0).to(tl.float32)
    wfk = tl.load(wf_ptr + g + C, mask=mg, other=0.0).to(tl.float32)
    wfv = tl.load(wf_ptr + g + 2 * C, mask=mg, other=0.0).to(tl.float32)
    first = t == 0
    bi = tl.load(bi_ptr + hr, mask=mh & first, other=0.0).to(tl.float32)
    bf = tl.load(bf_ptr + hr, mask=mh & first, other=0.0).to(tl.float32)

    mean, rstd = _row_stats(x_ptr + b * D, D, DP, eps)
    rows = tl.where(is_x, c, C + c).to(tl.int64)
    acc = tl.zeros([BN // P, P, BK], dtype=tl.float32)
    for k0 in range(0, D, BK):
        kk = k0 + tl.arange(0, BK)
        mk = kk < D
        xv = tl.load(x_ptr + b * D + kk, mask=mk, other=0.0).to(tl.float32)
        xn = (xv - mean) * rstd * tl.load(lnw_ptr + kk, mask=mk, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, :, None] * D + kk[None, None, :], mask=mc[:, :, None] & mk[None, None, :],
                    other=0.0)
        acc += w.to(tl.float32) * xn[None, None, :]
    xm = tl.sum(acc, axis=2)
    tl.store(z_ptr + b * C + c, xm, mask=mc & (t >= NT))

    conv = cb + cwl * xm + tl.sum(cws * old, axis=0)
    xc = conv * tl.sigmoid(conv)
    q = tl.sum(wq * xc[:, None, :], axis=2)
    k = tl.sum(wk * xc[:, None, :], axis=2)
    v = tl.sum(wv * xm[:, None, :], axis=2)
    tl.store(q_ptr + b * C + c, q, mask=mx)
    tl.store(k_ptr + b * C + c, k, mask=mx)
    tl.store(v_ptr + b * C + c, v, mask=mx)
    tl.store(xc_ptr + b * C + c, xc, mask=mx)
    # the shift writes the old state from registers: once every thread of the program has read
    # it (no other program touches these channels), slot s moves to s - 1 and x_m fills the last
    tl.debug_barrier()
    tl.store(cs + (s - 1) * C + c[None, :, :], old, mask=ms & (s >= 1))
    tl.store(cs + (KC - 2) * C + c, xm, mask=mx)
    gi = tl.sum(tl.sum(wiq * q[None, :, :] + wik * k[None, :, :] + wiv * v[None, :, :], axis=2), axis=1)
    gf = tl.sum(tl.sum(wfq * q[None, :, :] + wfk * k[None, :, :] + wfv * v[None, :, :], axis=2), axis=1)
    tl.store(ip_ptr + (b * H + hr) * NT + t, gi + bi, mask=mh & is_x)
    tl.store(fp_ptr + (b * H + hr) * NT + t, gf + bf, mask=mh & is_x)


@triton.jit
def _out_kernel(h_ptr, xc_ptr, z_ptr, nw_ptr, skip_ptr, w_ptr, x_ptr, out_ptr, eps,
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
        z = tl.load(z_ptr + b * C + ci, mask=mk, other=0.0)
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
    B, d = x.shape
    Cn = up_w.shape[0] // 2
    H, D = C.shape[1], C.shape[2]
    P = wq.shape[-1]
    KC = conv_w.shape[-1]
    f32 = dict(device=x.device, dtype=torch.float32)
    # 4 rows per tile (P when wider: a tile owns whole q/k/v blocks): ~770 programs for the 125M
    # model's 3072 up-projection rows; each program one round of loads for the statistics and
    # the mixing's weights, then one per BK columns (a [BN, BK] tile of at most 4096 weights)
    BN = max(4, P)
    NT = triton.cdiv(Cn, BN)
    z, q, k, v, xc = (torch.empty(B, Cn, **f32) for _ in range(5))
    ip, fp = torch.empty(B, H, NT, **f32), torch.empty(B, H, NT, **f32)
    out = torch.empty_like(x)
    with on_device(x):   # Triton launches on the current device, which need not be x's
        DP = triton.next_power_of_2(d)
        _up_mix_kernel[(2 * NT, B)](x, ln_w, up_w, conv, conv_w, conv_b, wq, wk, wv, wi, wf, bi, bf, z, q, k, v,
                                    xc, ip, fp, ln_eps, D=d, DP=DP, C=Cn, KC=KC,
                                    KCP=triton.next_power_of_2(KC - 1), P=P, H=H, HP=triton.next_power_of_2(H),
                                    BN=BN, BK=min(DP, 4096 // BN), num_warps=4)
        h, n_new, m_new = _step_(q.view(B, H, D), k.view(B, H, D), v.view(B, H, D), ip, fp, C, n, m, eps, 0)
        HP = triton.next_power_of_2(D)   # a head per tile of [BN, HP]: at most 2048 weights (the
        BN = max(1, min(4, 2048 // HP))  # unrolled heads' loads are in flight together: registers)
        _out_kernel[(triton.cdiv(d, BN), B)](h, xc, z, norm_w, skip, down_w, x, out, norm_eps, C=Cn, DM=d, H=H,
                                             D=D, DP=HP, BN=BN, num_warps=4)
    return out, n_new, m_new


block_step_op = torch.library.custom_op("xlstm_kit::mlstm_block_step_", _block_step_, mutates_args=("conv", "C"))


@block_step_op.register_fake
def _(x, ln_w, up_w, conv_w, conv_b, wq, wk, wv, wi, wf, bi, bf, norm_w, skip, down_w, conv, C, n, m,
      ln_eps, norm_eps, eps):
    f32 = dict(device=x.device, dtype=torch.float32)
    return torch.empty_like(x), torch.empty(C.shape[:3], **f32), torch.empty(C.shape[:2], **f32)


def mlstm_block_step(x: Tensor, ln_w: Tensor, up_w: Tensor, conv_w: Tensor, conv_b: Tensor, wq: Tensor,
                     wk: Tensor, wv: Tensor, wi: Tensor, wf: Tensor, bi: Tensor, bf: Tensor, norm_w: Tensor,
                     skip: Tensor, down_w: Tensor, conv: Tensor, C: Tensor, n: Tensor, m: Tensor, ln_eps: float,
                     norm_eps: float, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """`MLSTMBlock.step` in three launches, on the block's tensors (see `_block_step_`; the layer,
    `MLSTMBlock.fused_step`, gathers them): conv and C are updated in place → (x', n', m')."""
    # eagerly without the dispatcher (tens of microseconds; the three launches take about ten)
    return (block_step_op if torch.compiler.is_compiling() else _block_step_)(
        x, ln_w, up_w, conv_w, conv_b, wq, wk, wv, wi, wf, bi, bf, norm_w, skip, down_w, conv, C, n, m,
        ln_eps, norm_eps, eps)
