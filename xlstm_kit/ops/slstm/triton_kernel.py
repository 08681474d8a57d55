"""Fused Triton sLSTM: one launch runs all T steps forward, one launch runs them backward.

    slstm_recurrent_triton(x_gates [B,T,4,H,D], r [4,H,D,D], b [4,H,D], *, initial_state,
                           output_final_state, forget_gate, recurrent_grad_clip)
        -> (h [B,T,H,D], (h, c, n, m) each [B,H,D] or None)
    slstm_step_triton(x_gates [B,4,H,D], r, b, state, *, forget_gate) -> (h [B,H,D], state)

Maths: DESIGN.md §1 and the stabilized backward of `recurrent.py` (paper eqs. 41–51 with the
adjoints of c and n carried scaled by n_t, and the stabilizer's adjoint routed through the max the
way torch.maximum does), so the gradients equal autograd of `naive.slstm_recurrent_naive`.

Work split: one program per (tile of BT batch rows, head). The time loop runs inside the program,
so a step costs no launch; the recurrent matmul of a step is h_{t-1} [BT, D] @ R_g [D, D] for the
four gates g. For D <= 64 the four R_g stay in registers for the whole loop (R_RESIDENT); larger
heads reload R_g every step (it stays in L2). Programs never wait for each other: the recurrence
only mixes units inside one head, and batch rows are independent.

Precision: states and gate arithmetic in float32 (float64 for float64 inputs). The matmul keeps
float32 accuracy on the tensor cores by splitting the float32 operand into a bf16 head and a bf16
tail (two bf16 MMAs for bf16 weights, three when the weights are float32/float16 and are split
too). Under TRITON_INTERPRET=1 (no bf16 there) the dot runs directly in the state dtype.

Forward saves, per step, the gate pre-activations and (c, n, m) (and h in the state dtype when
the output is 16-bit); the backward kernel writes δg̃ = δx_gates per step in the state dtype.
δR = Σ_t h_{t-1}ᵀ δg̃_t and δb = Σ_t δg̃_t are plain batched reductions over all (b, t) done
afterwards by torch: an accumulator for δR ([D, 4D] per program) would not fit on chip.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from ..backend import TRITON_OPS
from .naive import State

TRITON_OPS.update({"slstm_recurrent", "slstm_step"})

BLOCK_B = 16  # batch rows per program: the smallest M of a tensor-core MMA


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------

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
def _mm(a, r_hi, r_lo, acc, MM: tl.constexpr):
    """acc + a @ r; a [BT, K] in the state dtype, r [K, N].

    MM 0: one dot in the state dtype (interpreter, float64). MM 1: r is bf16 (exact); a is split
    into bf16 head + tail so the product keeps ~16 mantissa bits. MM 2: r is split as well
    (r_hi + r_lo); the tail x tail term is below float32 rounding and is skipped.
    """
    if MM == 0:
        acc = tl.dot(a, r_hi, acc, input_precision="ieee", out_dtype=acc.dtype)
    else:
        a_hi = a.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(a_hi, r_hi, acc)
        acc = tl.dot(a_lo, r_hi, acc)
        if MM == 2:
            acc = tl.dot(a_hi, r_lo, acc)
    return acc


@triton.jit
def _load_r(R, RLO, g, hd, NH, D, rk, rn, rmask, TRANS: tl.constexpr, MM: tl.constexpr):
    """One D x D block of R as a [BD, BD] tile: R[g, hd] (TRANS=False) or its transpose."""
    base = (g * NH + hd).to(tl.int64) * D * D
    if TRANS:
        off = rn[None, :] * D + rk[:, None]
    else:
        off = rk[:, None] * D + rn[None, :]
    r_hi = tl.load(R + base + off, mask=rmask, other=0.0)
    if MM == 2:
        r_lo = tl.load(RLO + base + off, mask=rmask, other=0.0)
    else:
        r_lo = r_hi
    return r_hi, r_lo


@triton.jit
def _slstm_fwd_kernel(
    X, R, RLO, BIAS, H0, C0, N0, M0,          # inputs
    HOUT, HS, G, CS, NS, MS, HT, CT, NT, MT,  # outputs (HS..MS only when SAVE)
    B, T, NH, D,
    BT: tl.constexpr, BD: tl.constexpr, EXP_FORGET: tl.constexpr, HAS_INIT: tl.constexpr,
    SAVE: tl.constexpr, SAVE_H: tl.constexpr, WRITE_FINAL: tl.constexpr, MM: tl.constexpr,
    R_RESIDENT: tl.constexpr,
):
    # X [B,T,4,H,D], HOUT/HS/CS/NS/MS [B,T,H,D], G [B,T,4,H,D], states [B,H,D]; all contiguous.
    pid_b = tl.program_id(0)
    hd = tl.program_id(1)
    sdt = CT.dtype.element_ty
    rb = pid_b * BT + tl.arange(0, BT)
    rd = tl.arange(0, BD)
    md = rd < D
    mask = (rb < B)[:, None] & md[None, :]
    rmask = md[:, None] & md[None, :]
    rb64 = rb.to(tl.int64)
    HD = NH * D
    st = rb64[:, None] * HD + hd * D + rd[None, :]          # [BT, BD] into [B, H, D]
    sq = rb64[:, None] * T * HD + hd * D + rd[None, :]      # into [B, T, H, D] at t = 0
    sx = rb64[:, None] * T * 4 * HD + hd * D + rd[None, :]  # into [B, T, 4, H, D] at t = 0, g = 0

    if HAS_INIT:
        h = tl.load(H0 + st, mask=mask, other=0.0).to(sdt)
        c = tl.load(C0 + st, mask=mask, other=0.0).to(sdt)
        n = tl.load(N0 + st, mask=mask, other=0.0).to(sdt)
        m = tl.load(M0 + st, mask=mask, other=0.0).to(sdt)
    else:
        h = tl.zeros([BT, BD], sdt)
        c = tl.zeros([BT, BD], sdt)
        n = tl.zeros([BT, BD], sdt)
        m = tl.zeros([BT, BD], sdt)

    b_i = tl.load(BIAS + (0 * NH + hd) * D + rd, mask=md, other=0.0).to(sdt)[None, :]
    b_f = tl.load(BIAS + (1 * NH + hd) * D + rd, mask=md, other=0.0).to(sdt)[None, :]
    b_z = tl.load(BIAS + (2 * NH + hd) * D + rd, mask=md, other=0.0).to(sdt)[None, :]
    b_o = tl.load(BIAS + (3 * NH + hd) * D + rd, mask=md, other=0.0).to(sdt)[None, :]

    if R_RESIDENT:
        r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, rmask, False, MM)
        r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, rmask, False, MM)
        r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, rmask, False, MM)
        r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, rmask, False, MM)

    # The inputs of step t do not depend on the recurrence: load them one step ahead so their
    # latency hides behind the previous step's matmul.
    x_i = tl.load(X + sx + 0 * HD, mask=mask, other=0.0)
    x_f = tl.load(X + sx + 1 * HD, mask=mask, other=0.0)
    x_z = tl.load(X + sx + 2 * HD, mask=mask, other=0.0)
    x_o = tl.load(X + sx + 3 * HD, mask=mask, other=0.0)
    for t in range(T):
        nmask = mask & (t + 1 < T)
        xo = sx + (t + 1) * 4 * HD
        xn_i = tl.load(X + xo + 0 * HD, mask=nmask, other=0.0)
        xn_f = tl.load(X + xo + 1 * HD, mask=nmask, other=0.0)
        xn_z = tl.load(X + xo + 2 * HD, mask=nmask, other=0.0)
        xn_o = tl.load(X + xo + 3 * HD, mask=nmask, other=0.0)

        if not R_RESIDENT:
            r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, rmask, False, MM)
        g_i = _mm(h, r_i, ri_lo, x_i.to(sdt) + b_i, MM)
        if not R_RESIDENT:
            r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, rmask, False, MM)
        g_f = _mm(h, r_f, rf_lo, x_f.to(sdt) + b_f, MM)
        if not R_RESIDENT:
            r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, rmask, False, MM)
        g_z = _mm(h, r_z, rz_lo, x_z.to(sdt) + b_z, MM)
        if not R_RESIDENT:
            r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, rmask, False, MM)
        g_o = _mm(h, r_o, ro_lo, x_o.to(sdt) + b_o, MM)

        if EXP_FORGET:
            log_f = g_f
        else:
            log_f = _log_sigmoid(g_f)
        a = log_f + m
        m = tl.maximum(a, g_i)
        i_p = tl.exp(g_i - m)
        f_p = tl.exp(a - m)
        c = f_p * c + i_p * _tanh(g_z)
        n = f_p * n + i_p
        h = _sigmoid(g_o) * c / n

        so = sq + t * HD
        tl.store(HOUT + so, h.to(HOUT.dtype.element_ty), mask=mask)
        if SAVE:
            go = sx + t * 4 * HD
            tl.store(G + go + 0 * HD, g_i, mask=mask)
            tl.store(G + go + 1 * HD, g_f, mask=mask)
            tl.store(G + go + 2 * HD, g_z, mask=mask)
            tl.store(G + go + 3 * HD, g_o, mask=mask)
            tl.store(CS + so, c, mask=mask)
            tl.store(NS + so, n, mask=mask)
            tl.store(MS + so, m, mask=mask)
            if SAVE_H:
                tl.store(HS + so, h, mask=mask)
        x_i = xn_i
        x_f = xn_f
        x_z = xn_z
        x_o = xn_o

    if WRITE_FINAL:
        tl.store(HT + st, h, mask=mask)
        tl.store(CT + st, c, mask=mask)
        tl.store(NT + st, n, mask=mask)
        tl.store(MT + st, m, mask=mask)


@triton.jit
def _load_step(G, DH, CS, NS, MS, C0, N0, M0, sx, sq, mask, t, HD, T,
               HAS_DH: tl.constexpr, sdt: tl.constexpr):
    """Everything step t's backward reads that does not depend on the reverse recurrence:
    the gate pre-activations and δh^ext of step t, and the state (c, n, m) before step t."""
    ok = mask & (t >= 0)
    tc = tl.maximum(t, 0)
    go = sx + tc * 4 * HD
    g_i = tl.load(G + go + 0 * HD, mask=ok, other=0.0)
    g_f = tl.load(G + go + 1 * HD, mask=ok, other=0.0)
    g_z = tl.load(G + go + 2 * HD, mask=ok, other=0.0)
    g_o = tl.load(G + go + 3 * HD, mask=ok, other=0.0)
    if HAS_DH:
        dh = tl.load(DH + sq + tc * HD, mask=ok, other=0.0).to(sdt)
    else:
        dh = tl.zeros(g_i.shape, sdt)
    okp = mask & (t >= 1)
    po = sq + tl.maximum(t - 1, 0) * HD
    first = t <= 0
    c_p = tl.where(first, C0, tl.load(CS + po, mask=okp, other=0.0))
    n_p = tl.where(first, N0, tl.load(NS + po, mask=okp, other=0.0))
    m_p = tl.where(first, M0, tl.load(MS + po, mask=okp, other=0.0))
    return g_i, g_f, g_z, g_o, dh, c_p, n_p, m_p


@triton.jit
def _slstm_bwd_kernel(
    R, RLO, DH, G, CS, NS, MS, C0, N0, M0,   # R here holds R (we index its transpose)
    DHT, DCT, DNT, DMT,                      # gradients of the final state
    DG, DH0, DC0, DN0, DM0,                  # outputs
    B, T, NH, D, clip,
    BT: tl.constexpr, BD: tl.constexpr, EXP_FORGET: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_DFINAL: tl.constexpr, CLIP: tl.constexpr, MM: tl.constexpr,
    R_RESIDENT: tl.constexpr,
):
    pid_b = tl.program_id(0)
    hd = tl.program_id(1)
    sdt = DG.dtype.element_ty
    rb = pid_b * BT + tl.arange(0, BT)
    rd = tl.arange(0, BD)
    md = rd < D
    mask = (rb < B)[:, None] & md[None, :]
    rmask = md[:, None] & md[None, :]
    rb64 = rb.to(tl.int64)
    HD = NH * D
    st = rb64[:, None] * HD + hd * D + rd[None, :]
    sq = rb64[:, None] * T * HD + hd * D + rd[None, :]
    sx = rb64[:, None] * T * 4 * HD + hd * D + rd[None, :]

    if HAS_INIT:
        c0 = tl.load(C0 + st, mask=mask, other=0.0).to(sdt)
        n0 = tl.load(N0 + st, mask=mask, other=0.0).to(sdt)
        m0 = tl.load(M0 + st, mask=mask, other=0.0).to(sdt)
    else:
        c0 = tl.zeros([BT, BD], sdt)
        n0 = tl.zeros([BT, BD], sdt)
        m0 = tl.zeros([BT, BD], sdt)

    # State after the last step; padding gets n = 1 so that 1/n stays finite there.
    lo = sq + (T - 1) * HD
    c_cur = tl.load(CS + lo, mask=mask, other=0.0)
    n_cur = tl.load(NS + lo, mask=mask, other=1.0)
    m_cur = tl.load(MS + lo, mask=mask, other=0.0)
    if HAS_DFINAL:
        # δh_T joins δh^ext of the last step unclipped: it is not a recurrent gradient.
        dh_rec = tl.load(DHT + st, mask=mask, other=0.0).to(sdt)
        c_hat = tl.load(DCT + st, mask=mask, other=0.0).to(sdt) * n_cur  # n_T δc_T
        n_hat = tl.load(DNT + st, mask=mask, other=0.0).to(sdt) * n_cur  # n_T δn_T
        dm = tl.load(DMT + st, mask=mask, other=0.0).to(sdt)
    else:
        dh_rec = tl.zeros([BT, BD], sdt)
        c_hat = tl.zeros([BT, BD], sdt)
        n_hat = tl.zeros([BT, BD], sdt)
        dm = tl.zeros([BT, BD], sdt)
    rho = tl.full([BT, BD], 1.0, sdt)   # ρ_{t+1}; none before the last step
    f_over_n = tl.zeros([BT, BD], sdt)  # f'_t / n_t of the last step done (t = 0 at the end)

    if R_RESIDENT:
        r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, rmask, True, MM)
        r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, rmask, True, MM)
        r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, rmask, True, MM)
        r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, rmask, True, MM)

    g_i, g_f, g_z, g_o, dh_x, c_p, n_p, m_p = _load_step(
        G, DH, CS, NS, MS, c0, n0, m0, sx, sq, mask, T - 1, HD, T, HAS_DH, sdt)
    for tt in range(T):
        t = T - 1 - tt
        gn_i, gn_f, gn_z, gn_o, dhn_x, cn_p, nn_p, mn_p = _load_step(
            G, DH, CS, NS, MS, c0, n0, m0, sx, sq, mask, t - 1, HD, T, HAS_DH, sdt)

        dh = dh_x + dh_rec                                       # (41)
        if EXP_FORGET:
            log_f = g_f
        else:
            log_f = _log_sigmoid(g_f)
        a = log_f + m_p
        i_p = tl.exp(g_i - m_cur)
        f_p = tl.exp(a - m_cur)
        inv_n = 1.0 / n_cur
        z = _tanh(g_z)
        o = _sigmoid(g_o)
        oh = o * c_cur * inv_n                                   # o_t h̃_t
        c_hat = rho * c_hat + o * dh                             # n_t δc_t   (42)
        n_hat = rho * n_hat - oh * dh                            # n_t δn_t   (43)
        kappa = i_p * inv_n
        rho = f_p * n_p * inv_n
        phi = f_p * c_p * inv_n
        f_over_n = f_p * inv_n
        d_o = dh * oh * (1.0 - o)                                # (47)
        d_z = c_hat * kappa * (1.0 - z * z)                      # (46)
        p = c_hat * phi + n_hat * rho                            # f' δf'     (44)
        q = (c_hat * z + n_hat) * kappa                          # i' δi'     (45)
        # m_t = max(a, ĩ): the adjoint left to m_t goes to the larger side, halved on a tie.
        w = tl.where(a > g_i, 1.0, tl.where(a == g_i, 0.5, 0.0))
        da = p + (dm - p - q) * w                                # δ(log f_t + m_{t-1})
        d_i = dm - da
        if EXP_FORGET:
            d_f = da
        else:
            d_f = da * _sigmoid(-g_f)
        dm = da
        d_i = tl.where(mask, d_i, 0.0)
        d_f = tl.where(mask, d_f, 0.0)
        d_z = tl.where(mask, d_z, 0.0)
        d_o = tl.where(mask, d_o, 0.0)
        go = sx + t * 4 * HD
        tl.store(DG + go + 0 * HD, d_i, mask=mask)
        tl.store(DG + go + 1 * HD, d_f, mask=mask)
        tl.store(DG + go + 2 * HD, d_z, mask=mask)
        tl.store(DG + go + 3 * HD, d_o, mask=mask)

        # (49): δh^R_{t-1} = Σ_g δg̃_g R_gᵀ
        acc = tl.zeros([BT, BD], sdt)
        if not R_RESIDENT:
            r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, rmask, True, MM)
        acc = _mm(d_i, r_i, ri_lo, acc, MM)
        if not R_RESIDENT:
            r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, rmask, True, MM)
        acc = _mm(d_f, r_f, rf_lo, acc, MM)
        if not R_RESIDENT:
            r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, rmask, True, MM)
        acc = _mm(d_z, r_z, rz_lo, acc, MM)
        if not R_RESIDENT:
            r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, rmask, True, MM)
        acc = _mm(d_o, r_o, ro_lo, acc, MM)
        if CLIP:
            acc = tl.minimum(tl.maximum(acc, -clip), clip)
        dh_rec = acc

        c_cur = c_p
        n_cur = tl.where(mask, n_p, 1.0)
        m_cur = m_p
        g_i = gn_i
        g_f = gn_f
        g_z = gn_z
        g_o = gn_o
        dh_x = dhn_x
        c_p = cn_p
        n_p = nn_p
        m_p = mn_p

    tl.store(DH0 + st, dh_rec, mask=mask)
    # δc_0 = f'_0 δc (after step 0) = (f'_0 / n_0) Ĉ_0: no division by the initial n (0 by default).
    tl.store(DC0 + st, f_over_n * c_hat, mask=mask)
    tl.store(DN0 + st, f_over_n * n_hat, mask=mask)
    tl.store(DM0 + st, dm, mask=mask)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

class KernelConfig(NamedTuple):
    """Launch choices: warps per program and whether R stays in registers across steps."""
    num_warps: int
    r_resident: bool


def default_config(dim: int) -> KernelConfig:
    bd = _block_d(dim)
    if bd <= 64:
        return KernelConfig(num_warps=4, r_resident=True)
    return KernelConfig(num_warps=8, r_resident=False)


def _block_d(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _prepare_r(r: torch.Tensor, state_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, int]:
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


def _fwd(x, r_hi, r_lo, mm, b, init, exp_forget, save, config):
    """Launch the forward. x [B,T,4,H,D] contiguous; init (h,c,n,m) [B,H,D] or None."""
    batch, steps, _, heads, dim = x.shape
    sdt = r_hi.dtype if mm == 0 else torch.float32
    dev = x.device
    h_out = torch.empty(batch, steps, heads, dim, dtype=x.dtype, device=dev)
    final = [torch.empty(batch, heads, dim, dtype=sdt, device=dev) for _ in range(4)]
    save_h = save and x.dtype != sdt
    if save:
        g = torch.empty(batch, steps, 4, heads, dim, dtype=sdt, device=dev)
        cs, ns, ms = (torch.empty(batch, steps, heads, dim, dtype=sdt, device=dev) for _ in range(3))
        hs = torch.empty_like(cs) if save_h else h_out
    else:
        g = cs = ns = ms = hs = h_out  # never touched (SAVE=False)
    bias = b.to(sdt).contiguous()
    h0, c0, n0, m0 = init if init is not None else (final[0],) * 4
    grid = (triton.cdiv(batch, BLOCK_B), heads)
    _slstm_fwd_kernel[grid](
        x, r_hi, r_lo, bias, h0, c0, n0, m0,
        h_out, hs, g, cs, ns, ms, *final,
        batch, steps, heads, dim,
        BT=BLOCK_B, BD=_block_d(dim), EXP_FORGET=exp_forget, HAS_INIT=init is not None,
        SAVE=save, SAVE_H=save_h, WRITE_FINAL=True, MM=mm, R_RESIDENT=config.r_resident,
        num_warps=config.num_warps, num_stages=1,
    )
    saved = (hs, g, cs, ns, ms) if save else None
    return h_out, tuple(final), saved


def _bwd(r_hi, r_lo, mm, saved, init, dh_out, d_final, exp_forget, clip, config):
    """Launch the backward; returns δg̃ [B,T,4,H,D] and the initial state's (δh, δc, δn, δm)."""
    hs, g, cs, ns, ms = saved
    batch, steps, _, heads, dim = g.shape
    sdt = g.dtype
    dev = g.device
    dg = torch.empty_like(g)
    d_init = [torch.empty(batch, heads, dim, dtype=sdt, device=dev) for _ in range(4)]
    c0, n0, m0 = init[1:] if init is not None else (d_init[0],) * 3
    has_dfinal = d_final is not None
    if has_dfinal:
        d_final = [torch.zeros(batch, heads, dim, dtype=sdt, device=dev) if d is None
                   else d.contiguous() for d in d_final]
    else:
        d_final = (d_init[0],) * 4
    has_dh = dh_out is not None
    dh_out = dh_out.contiguous() if has_dh else dg
    grid = (triton.cdiv(batch, BLOCK_B), heads)
    _slstm_bwd_kernel[grid](
        r_hi, r_lo, dh_out, g, cs, ns, ms, c0, n0, m0,
        *d_final, dg, *d_init,
        batch, steps, heads, dim, float(clip) if clip is not None else 0.0,
        BT=BLOCK_B, BD=_block_d(dim), EXP_FORGET=exp_forget, HAS_INIT=init is not None,
        HAS_DH=has_dh, HAS_DFINAL=has_dfinal, CLIP=clip is not None, MM=mm,
        R_RESIDENT=config.r_resident, num_warps=config.num_warps, num_stages=1,
    )
    return dg, d_init


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------

class SLSTMTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_gates, r, b, h0, c0, n0, m0, forget_gate: str, clip: Optional[float],
                config: KernelConfig):
        sdt = torch.float64 if torch.float64 in (x_gates.dtype, r.dtype, b.dtype) else torch.float32
        r_hi, r_lo, mm = _prepare_r(r, sdt)
        has_init = h0 is not None
        init = tuple(s.to(sdt).contiguous() for s in (h0, c0, n0, m0)) if has_init else None
        x = x_gates.contiguous()
        exp_forget = forget_gate == "exp"
        save = any(ctx.needs_input_grad[:7])
        h, final, saved = _fwd(x, r_hi, r_lo, mm, b, init, exp_forget, save, config)
        if save:
            ctx.save_for_backward(r_hi, r_lo, *saved, *(init if has_init else ()))
        ctx.meta = (mm, has_init, exp_forget, clip, config,
                    (x_gates.dtype, r.dtype, b.dtype), tuple(None if s is None else s.dtype
                                                             for s in (h0, c0, n0, m0)))
        ctx.set_materialize_grads(False)
        return (h, *final)

    @staticmethod
    def backward(ctx, dh_out, dh_T, dc_T, dn_T, dm_T):
        mm, has_init, exp_forget, clip, config, (x_dt, r_dt, b_dt), init_dts = ctx.meta
        r_hi, r_lo, hs, g, cs, ns, ms, *init = ctx.saved_tensors
        init = init if has_init else None
        d_final = (dh_T, dc_T, dn_T, dm_T)
        if all(d is None for d in d_final):
            d_final = None
        dg, d_init = _bwd(r_hi, r_lo, mm, (hs, g, cs, ns, ms), init, dh_out, d_final,
                          exp_forget, clip, config)
        grads = [None] * 10
        if ctx.needs_input_grad[0]:
            grads[0] = dg.to(x_dt)
        if ctx.needs_input_grad[1]:
            # (50) δR_g = Σ_{b,t} h_{t-1}ᵀ δg̃_t per head; h_{-1} is the initial h.
            d_r = torch.einsum("bthi,btghj->ghij", hs[:, :-1], dg[:, 1:])
            if has_init:
                d_r = d_r + torch.einsum("bhi,bghj->ghij", init[0], dg[:, 0])
            grads[1] = d_r.to(r_dt)
        if ctx.needs_input_grad[2]:
            grads[2] = dg.sum(dim=(0, 1)).to(b_dt)
        for k in range(4):
            if ctx.needs_input_grad[3 + k]:
                grads[3 + k] = d_init[k].to(init_dts[k])
        return tuple(grads)


# ----------------------------------------------------------------------------------------------
# public functions (inputs validated by xlstm_kit.ops.slstm)
# ----------------------------------------------------------------------------------------------

def slstm_recurrent_triton(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor, *,
                           initial_state: Optional[State] = None, output_final_state: bool = False,
                           forget_gate: str = "sigmoid", recurrent_grad_clip: Optional[float] = None,
                           config: Optional[KernelConfig] = None
                           ) -> Tuple[torch.Tensor, Optional[State]]:
    """sLSTM over a sequence with the fused Triton kernels.

    x_gates [B, T, 4, H, D] (gates i, f, z, o), r [4, H, D, D], b [4, H, D], initial_state
    (h, c, n, m) each [B, H, D] or None (zeros). Returns h [B, T, H, D] in x_gates' dtype and,
    when output_final_state, the final (h, c, n, m), each [B, H, D] in float32 (float64 for
    float64 inputs). `config` overrides the launch choices (benchmarks).
    """
    if config is None:
        config = default_config(x_gates.shape[-1])
    h0, c0, n0, m0 = initial_state if initial_state is not None else (None,) * 4
    clip = None if recurrent_grad_clip is None else float(recurrent_grad_clip)
    h, h_T, c_T, n_T, m_T = SLSTMTritonFunction.apply(x_gates, r, b, h0, c0, n0, m0,
                                                      forget_gate, clip, config)
    return h, ((h_T, c_T, n_T, m_T) if output_final_state else None)


def slstm_step_triton(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor,
                      state: Optional[State] = None, *, forget_gate: str = "sigmoid"
                      ) -> Tuple[torch.Tensor, State]:
    """One sLSTM step: x_gates [B, 4, H, D] -> (h [B, H, D], (h, c, n, m) each [B, H, D])."""
    h, final = slstm_recurrent_triton(x_gates.unsqueeze(1), r, b, initial_state=state,
                                      output_final_state=True, forget_gate=forget_gate)
    return h[:, 0], final
