"""Fused Triton sLSTM: one launch runs all T steps forward, one launch runs them backward.

    slstm_recurrent_triton(x_gates [B,T,4,H,D], r [4,H,D,D], b [4,H,D], *, initial_state,
                           output_final_state, forget_gate, recurrent_grad_clip)
        -> (h [B,T,H,D], (h, c, n, m) each [B,H,D] or None)
    slstm_step_triton(x_gates [B,4,H,D], r, b, state, *, forget_gate) -> (h [B,H,D], state)

Maths: DESIGN.md §1 and the stabilized backward of `recurrent.py` (paper eqs. 41–51 with the
adjoints of c and n carried scaled by n_t, and the stabilizer's adjoint routed through the max the
way torch.maximum does), so the gradients equal autograd of `naive.slstm_recurrent_naive`.

Work split: one program per (tile of BT = 16 batch entries, head); the time loop runs inside the
program, so a step costs no launch, and programs never wait for each other (the recurrence only
mixes units inside one head). Tiles are [D, BT] (units x batch): the step's recurrent matmul is
g̃_gᵀ = R_gᵀ [D, D] @ h_{t-1}ᵀ [D, BT] per gate, so the weights are the large A operand (wgmma
on Hopper for D >= 64) and, loaded once before the loop, stay in shared memory for all steps
(up to D = 128 in bf16). Larger heads loop over K chunks, h_{t-1} going through an L1-resident
scratch and R through L2.

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

from .naive import State


def supports(op: str, **_) -> str | None:
    """backend.choose_backend's question: the sLSTM kernels take every call the op validates."""
    return None

BLOCK_B = 16  # batch entries per program: the N side of the step's matmul (any MMA takes 16)


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
def _load_r(R, RLO, g, hd, NH, D, rows, cols, EVEN_D: tl.constexpr, TRANS: tl.constexpr,
            MM: tl.constexpr):
    """The tile [rows, cols] of R[g, hd] (TRANS=False) or of R[g, hd]ᵀ (TRANS=True)."""
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
def _slstm_fwd_kernel(
    X, R, RLO, BIAS, H0, C0, N0, M0,          # inputs
    HOUT, HS, G, CS, NS, MS, HT, CT, NT, MT,  # outputs (HS..MS only when SAVE)
    HX,                                       # scratch [B, 2, H, D] for the K-chunked matmul
    B, T, NH, D,
    BT: tl.constexpr, BD: tl.constexpr, KC: tl.constexpr, EVEN: tl.constexpr,
    EVEN_D: tl.constexpr, EXP_FORGET: tl.constexpr, HAS_INIT: tl.constexpr, SAVE: tl.constexpr,
    SAVE_H: tl.constexpr, MM: tl.constexpr, R_RESIDENT: tl.constexpr, PREFETCH: tl.constexpr,
):
    # X [B,T,4,H,D], HOUT/HS/CS/NS/MS [B,T,H,D], G [B,T,4,H,D], states [B,H,D]; all contiguous.
    # Tiles are [BD, BT]: the D units of one head (rows) for BT batch entries (columns), so that
    # the step's matmul is g̃_gᵀ [BD, BT] = R_gᵀ [BD, BD] @ h_{t-1}ᵀ [BD, BT]: the weights are
    # the A operand with M = D (the tensor cores' large side, wgmma on Hopper for D >= 64), the
    # state the small B operand (N = BT). The weights never change, so when R_RESIDENT the
    # compiler keeps them in shared memory for the whole loop.
    # KC < BD (large heads): h_{t-1} goes through the L1-resident scratch HX and the matmul
    # loops over K in chunks of KC, reloading R per chunk (it stays in L2).
    pid_b = tl.program_id(0)
    hd = tl.program_id(1)
    sdt = CT.dtype.element_ty
    rb = pid_b * BT + tl.arange(0, BT)
    rd = tl.arange(0, BD)
    md = rd < D
    mask_b = (rb < B)[None, :]
    mask = md[:, None] & mask_b
    rb64 = rb.to(tl.int64)
    HD = NH * D
    # Batch parts of the addresses [1, BT] (int64: B*T*4*H*D may pass 2^31); the unit part,
    # which carries the time step, is added inside the loop, so that no [BD, BT] address tensor
    # is hoisted out of it and kept live in registers across all steps.
    col_s = rb64[None, :] * HD + hd * D            # [B, H, D]
    col_q = rb64[None, :] * T * HD + hd * D        # [B, T, H, D]
    col_x = rb64[None, :] * T * 4 * HD + hd * D    # [B, T, 4, H, D]
    col_h = rb64[None, :] * 2 * HD + hd * D        # HX [B, 2, H, D]
    u0 = rd[:, None]

    if HAS_INIT:
        h = _ld(H0 + col_s + u0, mask, EVEN).to(sdt)
        c = _ld(C0 + col_s + u0, mask, EVEN).to(sdt)
        n = _ld(N0 + col_s + u0, mask, EVEN).to(sdt)
        m = _ld(M0 + col_s + u0, mask, EVEN).to(sdt)
    else:
        h = tl.zeros([BD, BT], sdt)
        c = tl.zeros([BD, BT], sdt)
        n = tl.zeros([BD, BT], sdt)
        m = tl.zeros([BD, BT], sdt)

    b_i = _ld(BIAS + (0 * NH + hd) * D + rd, md, EVEN_D).to(sdt)[:, None]
    b_f = _ld(BIAS + (1 * NH + hd) * D + rd, md, EVEN_D).to(sdt)[:, None]
    b_z = _ld(BIAS + (2 * NH + hd) * D + rd, md, EVEN_D).to(sdt)[:, None]
    b_o = _ld(BIAS + (3 * NH + hd) * D + rd, md, EVEN_D).to(sdt)[:, None]

    if R_RESIDENT:
        r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, EVEN_D, True, MM)
        r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, EVEN_D, True, MM)
        r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, EVEN_D, True, MM)
        r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, EVEN_D, True, MM)
    if KC < BD:
        _st(HX + col_h + 1 * HD + u0, h, mask, EVEN)  # h_{-1} in slot (−1) mod 2
        tl.debug_barrier()

    # The inputs of step t do not depend on the recurrence: load them one step ahead so their
    # latency hides behind the previous step's matmul (the last prefetch re-reads step T-1).
    x_i = _ld(X + col_x + 0 * HD + u0, mask, EVEN)
    x_f = _ld(X + col_x + 1 * HD + u0, mask, EVEN)
    x_z = _ld(X + col_x + 2 * HD + u0, mask, EVEN)
    x_o = _ld(X + col_x + 3 * HD + u0, mask, EVEN)
    for t in range(T):
        t64 = tl.cast(t, tl.int64)
        ux = (t64 * 4 * HD + rd)[:, None]
        if PREFETCH:
            un = (tl.minimum(t64 + 1, T - 1) * 4 * HD + rd)[:, None]
            xn_i = _ld(X + col_x + 0 * HD + un, mask, EVEN)
            xn_f = _ld(X + col_x + 1 * HD + un, mask, EVEN)
            xn_z = _ld(X + col_x + 2 * HD + un, mask, EVEN)
            xn_o = _ld(X + col_x + 3 * HD + un, mask, EVEN)
        else:
            x_i = _ld(X + col_x + 0 * HD + ux, mask, EVEN)
            x_f = _ld(X + col_x + 1 * HD + ux, mask, EVEN)
            x_z = _ld(X + col_x + 2 * HD + ux, mask, EVEN)
            x_o = _ld(X + col_x + 3 * HD + ux, mask, EVEN)

        g_i = x_i.to(sdt) + b_i
        g_f = x_f.to(sdt) + b_f
        g_z = x_z.to(sdt) + b_z
        g_o = x_o.to(sdt) + b_o
        if KC < BD:
            slot = (t + 1) % 2  # h_{t-1}
            for kc in range(0, BD, KC):
                rk = kc + tl.arange(0, KC)
                h_k = _ld(HX + col_h + slot * HD + rk[:, None], (rk < D)[:, None] & mask_b, EVEN)
                r_c, rc_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rk, EVEN_D, True, MM)
                g_i = _mm(r_c, rc_lo, h_k, g_i, MM)
                r_c, rc_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rk, EVEN_D, True, MM)
                g_f = _mm(r_c, rc_lo, h_k, g_f, MM)
                r_c, rc_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rk, EVEN_D, True, MM)
                g_z = _mm(r_c, rc_lo, h_k, g_z, MM)
                r_c, rc_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rk, EVEN_D, True, MM)
                g_o = _mm(r_c, rc_lo, h_k, g_o, MM)
        else:
            if not R_RESIDENT:
                r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, EVEN_D, True, MM)
            g_i = _mm(r_i, ri_lo, h, g_i, MM)
            if not R_RESIDENT:
                r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, EVEN_D, True, MM)
            g_f = _mm(r_f, rf_lo, h, g_f, MM)
            if not R_RESIDENT:
                r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, EVEN_D, True, MM)
            g_z = _mm(r_z, rz_lo, h, g_z, MM)
            if not R_RESIDENT:
                r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, EVEN_D, True, MM)
            g_o = _mm(r_o, ro_lo, h, g_o, MM)

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

        uq = (t64 * HD + rd)[:, None]
        _st(HOUT + col_q + uq, h.to(HOUT.dtype.element_ty), mask, EVEN)
        if SAVE:
            _st(G + col_x + 0 * HD + ux, g_i, mask, EVEN)
            _st(G + col_x + 1 * HD + ux, g_f, mask, EVEN)
            _st(G + col_x + 2 * HD + ux, g_z, mask, EVEN)
            _st(G + col_x + 3 * HD + ux, g_o, mask, EVEN)
            _st(CS + col_q + uq, c, mask, EVEN)
            _st(NS + col_q + uq, n, mask, EVEN)
            _st(MS + col_q + uq, m, mask, EVEN)
            if SAVE_H:
                _st(HS + col_q + uq, h, mask, EVEN)
        if KC < BD:
            _st(HX + col_h + (t % 2) * HD + u0, h, mask, EVEN)
            tl.debug_barrier()  # h_t visible to the whole program before step t+1 reads it
        if PREFETCH:
            x_i = xn_i
            x_f = xn_f
            x_z = xn_z
            x_o = xn_o

    _st(HT + col_s + u0, h, mask, EVEN)
    _st(CT + col_s + u0, c, mask, EVEN)
    _st(NT + col_s + u0, n, mask, EVEN)
    _st(MT + col_s + u0, m, mask, EVEN)


@triton.jit
def _load_step(G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, rd, mask, t, HD,
               HAS_DH: tl.constexpr, EVEN: tl.constexpr, sdt: tl.constexpr):
    """Everything step t's backward reads that does not depend on the reverse recurrence:
    the gate pre-activations and δh^ext of step t, and the state (c, n, m) before step t
    (the initial state when t = 0). t < 0 is clamped (a harmless re-read, never used)."""
    tc = tl.cast(tl.maximum(t, 0), tl.int64)
    ux = (tc * 4 * HD + rd)[:, None]
    g_i = _ld(G + col_x + 0 * HD + ux, mask, EVEN)
    g_f = _ld(G + col_x + 1 * HD + ux, mask, EVEN)
    g_z = _ld(G + col_x + 2 * HD + ux, mask, EVEN)
    g_o = _ld(G + col_x + 3 * HD + ux, mask, EVEN)
    if HAS_DH:
        dh = _ld(DH + col_q + (tc * HD + rd)[:, None], mask, EVEN).to(sdt)
    else:
        dh = tl.zeros(g_i.shape, sdt)
    up = (tl.maximum(tc - 1, 0) * HD + rd)[:, None]
    first = t <= 0
    c_p = tl.where(first, c0, _ld(CS + col_q + up, mask, EVEN))
    n_p = tl.where(first, n0, _ld(NS + col_q + up, mask, EVEN))
    m_p = tl.where(first, m0, _ld(MS + col_q + up, mask, EVEN))
    return g_i, g_f, g_z, g_o, dh, c_p, n_p, m_p


@triton.jit
def _slstm_bwd_kernel(
    R, RLO, DH, G, CS, NS, MS, C0, N0, M0,   # R: the forward's weights
    DHT, DCT, DNT, DMT,                      # gradients of the final state
    DG, DH0, DC0, DN0, DM0,                  # outputs
    B, T, NH, D, clip,
    BT: tl.constexpr, BD: tl.constexpr, KC: tl.constexpr, EVEN: tl.constexpr,
    EVEN_D: tl.constexpr, EXP_FORGET: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_DFINAL: tl.constexpr, CLIP: tl.constexpr, MM: tl.constexpr,
    R_RESIDENT: tl.constexpr, PREFETCH: tl.constexpr,
):
    # Same tiles as the forward ([BD, BT]); the step's matmul is
    # δh^Rᵀ [BD, BT] = Σ_g R_g [BD, BD] @ δg̃_gᵀ [BD, BT].
    pid_b = tl.program_id(0)
    hd = tl.program_id(1)
    sdt = DG.dtype.element_ty
    rb = pid_b * BT + tl.arange(0, BT)
    rd = tl.arange(0, BD)
    md = rd < D
    mask_b = (rb < B)[None, :]
    mask = md[:, None] & mask_b
    rb64 = rb.to(tl.int64)
    HD = NH * D
    col_s = rb64[None, :] * HD + hd * D
    col_q = rb64[None, :] * T * HD + hd * D
    col_x = rb64[None, :] * T * 4 * HD + hd * D
    u0 = rd[:, None]

    if HAS_INIT:
        c0 = _ld(C0 + col_s + u0, mask, EVEN).to(sdt)
        n0 = _ld(N0 + col_s + u0, mask, EVEN).to(sdt)
        m0 = _ld(M0 + col_s + u0, mask, EVEN).to(sdt)
    else:
        c0 = tl.zeros([BD, BT], sdt)
        n0 = tl.zeros([BD, BT], sdt)
        m0 = tl.zeros([BD, BT], sdt)

    # State after the last step; padding gets n = 1 so that 1/n stays finite there.
    ul = (tl.cast(T - 1, tl.int64) * HD + rd)[:, None]
    c_cur = _ld(CS + col_q + ul, mask, EVEN)
    n_cur = _ld(NS + col_q + ul, mask, EVEN)
    if not EVEN:
        n_cur = tl.where(mask, n_cur, 1.0)
    m_cur = _ld(MS + col_q + ul, mask, EVEN)
    if HAS_DFINAL:
        # δh_T joins δh^ext of the last step unclipped: it is not a recurrent gradient.
        dh_rec = _ld(DHT + col_s + u0, mask, EVEN).to(sdt)
        c_hat = _ld(DCT + col_s + u0, mask, EVEN).to(sdt) * n_cur  # n_T δc_T
        n_hat = _ld(DNT + col_s + u0, mask, EVEN).to(sdt) * n_cur  # n_T δn_T
        dm = _ld(DMT + col_s + u0, mask, EVEN).to(sdt)
    else:
        dh_rec = tl.zeros([BD, BT], sdt)
        c_hat = tl.zeros([BD, BT], sdt)
        n_hat = tl.zeros([BD, BT], sdt)
        dm = tl.zeros([BD, BT], sdt)
    rho = tl.full([BD, BT], 1.0, sdt)   # ρ_{t+1}; none before the last step
    f_over_n = tl.zeros([BD, BT], sdt)  # f'_t / n_t of the step just done (t = 0 at the end)

    if R_RESIDENT:
        r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, EVEN_D, False, MM)
        r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, EVEN_D, False, MM)
        r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, EVEN_D, False, MM)
        r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, EVEN_D, False, MM)

    if PREFETCH:
        g_i, g_f, g_z, g_o, dh_x, c_p, n_p, m_p = _load_step(
            G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, rd, mask, T - 1, HD, HAS_DH, EVEN, sdt)
    for tt in range(T):
        t = T - 1 - tt
        if PREFETCH:
            gn_i, gn_f, gn_z, gn_o, dhn_x, cn_p, nn_p, mn_p = _load_step(
                G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, rd, mask, t - 1, HD, HAS_DH, EVEN, sdt)
        else:
            g_i, g_f, g_z, g_o, dh_x, c_p, n_p, m_p = _load_step(
                G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, rd, mask, t, HD, HAS_DH, EVEN, sdt)

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
        if not EVEN:  # padding must not feed the matmul below
            d_i = tl.where(mask, d_i, 0.0)
            d_f = tl.where(mask, d_f, 0.0)
            d_z = tl.where(mask, d_z, 0.0)
            d_o = tl.where(mask, d_o, 0.0)
        ux = (tl.cast(t, tl.int64) * 4 * HD + rd)[:, None]
        _st(DG + col_x + 0 * HD + ux, d_i, mask, EVEN)
        _st(DG + col_x + 1 * HD + ux, d_f, mask, EVEN)
        _st(DG + col_x + 2 * HD + ux, d_z, mask, EVEN)
        _st(DG + col_x + 3 * HD + ux, d_o, mask, EVEN)

        # (49): δh^R_{t-1} = Σ_g δg̃_g R_gᵀ, here transposed: Σ_g R_g @ δg̃_gᵀ
        acc = tl.zeros([BD, BT], sdt)
        if KC < BD:
            # K-chunked (large heads): read this step's δg̃ back from DG in chunks of KC.
            tl.debug_barrier()
            for kc in range(0, BD, KC):
                rk = kc + tl.arange(0, KC)
                uk = (tl.cast(t, tl.int64) * 4 * HD + rk)[:, None]
                lm = (rk < D)[:, None] & mask_b
                dg_k = _ld(DG + col_x + 0 * HD + uk, lm, EVEN)
                r_c, rc_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rk, EVEN_D, False, MM)
                acc = _mm(r_c, rc_lo, dg_k, acc, MM)
                dg_k = _ld(DG + col_x + 1 * HD + uk, lm, EVEN)
                r_c, rc_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rk, EVEN_D, False, MM)
                acc = _mm(r_c, rc_lo, dg_k, acc, MM)
                dg_k = _ld(DG + col_x + 2 * HD + uk, lm, EVEN)
                r_c, rc_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rk, EVEN_D, False, MM)
                acc = _mm(r_c, rc_lo, dg_k, acc, MM)
                dg_k = _ld(DG + col_x + 3 * HD + uk, lm, EVEN)
                r_c, rc_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rk, EVEN_D, False, MM)
                acc = _mm(r_c, rc_lo, dg_k, acc, MM)
        else:
            if not R_RESIDENT:
                r_i, ri_lo = _load_r(R, RLO, 0, hd, NH, D, rd, rd, EVEN_D, False, MM)
            acc = _mm(r_i, ri_lo, d_i, acc, MM)
            if not R_RESIDENT:
                r_f, rf_lo = _load_r(R, RLO, 1, hd, NH, D, rd, rd, EVEN_D, False, MM)
            acc = _mm(r_f, rf_lo, d_f, acc, MM)
            if not R_RESIDENT:
                r_z, rz_lo = _load_r(R, RLO, 2, hd, NH, D, rd, rd, EVEN_D, False, MM)
            acc = _mm(r_z, rz_lo, d_z, acc, MM)
            if not R_RESIDENT:
                r_o, ro_lo = _load_r(R, RLO, 3, hd, NH, D, rd, rd, EVEN_D, False, MM)
            acc = _mm(r_o, ro_lo, d_o, acc, MM)
        if CLIP:
            acc = tl.minimum(tl.maximum(acc, -clip), clip)
        dh_rec = acc

        c_cur = c_p
        if EVEN:
            n_cur = n_p
        else:
            n_cur = tl.where(mask, n_p, 1.0)
        m_cur = m_p
        if PREFETCH:
            g_i = gn_i
            g_f = gn_f
            g_z = gn_z
            g_o = gn_o
            dh_x = dhn_x
            c_p = cn_p
            n_p = nn_p
            m_p = mn_p

    _st(DH0 + col_s + u0, dh_rec, mask, EVEN)
    # δc_0 = f'_0 δc (after step 0) = (f'_0 / n_0) Ĉ_0: no division by the initial n (0 by default).
    _st(DC0 + col_s + u0, f_over_n * c_hat, mask, EVEN)
    _st(DN0 + col_s + u0, f_over_n * n_hat, mask, EVEN)
    _st(DM0 + col_s + u0, dm, mask, EVEN)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------

class KernelConfig(NamedTuple):
    """Launch choices: warps per program, whether R is loaded once before the time loop
    (the compiler then keeps it in registers or shared memory), the K chunk of the
    recurrent matmul (None: the whole head, h_{t-1} stays in registers), and whether the
    next step's inputs are loaded one step ahead."""
    num_warps: int
    r_resident: bool
    k_chunk: Optional[int] = None
    prefetch: bool = True


def default_config(dim: int, mm: int = 1) -> KernelConfig:
    """Launch choices by head size and matmul mode (see `_mm`).

    All four R_g stay in shared memory up to D = 128 for bf16 weights (128 KiB), up to D = 64
    when they are split in two (float32/float16 weights); larger heads take the K-chunked path.
    bf16 D = 64 and D = 128 are the fastest variants measured on the H200 (2026-11-30,
    benchmarks/results/2026-11-30-h200-slstm.md); the rest follow the sm_90 register reports.
    """
    bd = _block_d(dim)
    if mm == 0:  # float64 (or the interpreter): no tensor cores, keep tiles small
        return KernelConfig(num_warps=4, r_resident=bd <= 32, k_chunk=None if bd <= 32 else 32)
    if bd <= 32 or (bd <= 64 and mm == 1):
        return KernelConfig(num_warps=4, r_resident=True)
    if bd <= 64:
        return KernelConfig(num_warps=8, r_resident=True)
    if bd <= 128 and mm == 1:
        return KernelConfig(num_warps=8, r_resident=True, prefetch=False)
    if bd <= 128:
        return KernelConfig(num_warps=8, r_resident=False, k_chunk=64)
    return KernelConfig(num_warps=16, r_resident=False, k_chunk=64)


def _k_chunk(config: KernelConfig, bd: int) -> int:
    return bd if config.k_chunk is None else min(bd, config.k_chunk)


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
    bd = _block_d(dim)
    kc = _k_chunk(config, bd)
    hx = torch.empty(batch, 2, heads, dim, dtype=sdt, device=dev) if kc < bd else final[0]
    grid = (triton.cdiv(batch, BLOCK_B), heads)
    _slstm_fwd_kernel[grid](
        x, r_hi, r_lo, bias, h0, c0, n0, m0,
        h_out, hs, g, cs, ns, ms, *final, hx,
        batch, steps, heads, dim,
        BT=BLOCK_B, BD=bd, KC=kc, EVEN=batch % BLOCK_B == 0 and dim == bd, EVEN_D=dim == bd,
        EXP_FORGET=exp_forget, HAS_INIT=init is not None, SAVE=save, SAVE_H=save_h, MM=mm,
        R_RESIDENT=config.r_resident, PREFETCH=config.prefetch,
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
    bd = _block_d(dim)
    grid = (triton.cdiv(batch, BLOCK_B), heads)
    _slstm_bwd_kernel[grid](
        r_hi, r_lo, dh_out, g, cs, ns, ms, c0, n0, m0,
        *d_final, dg, *d_init,
        batch, steps, heads, dim, float(clip) if clip is not None else 0.0,
        BT=BLOCK_B, BD=bd, KC=_k_chunk(config, bd), EVEN=batch % BLOCK_B == 0 and dim == bd,
        EVEN_D=dim == bd, EXP_FORGET=exp_forget, HAS_INIT=init is not None, HAS_DH=has_dh,
        HAS_DFINAL=has_dfinal, CLIP=clip is not None, MM=mm, R_RESIDENT=config.r_resident,
        PREFETCH=config.prefetch, num_warps=config.num_warps, num_stages=1,
    )
    return dg, d_init


# ----------------------------------------------------------------------------------------------
# autograd.Function
# ----------------------------------------------------------------------------------------------

class SLSTMTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_gates, r, b, h0, c0, n0, m0, forget_gate: str, clip: Optional[float],
                config: Optional[KernelConfig], grad_enabled: bool):
        sdt = torch.float64 if torch.float64 in (x_gates.dtype, r.dtype, b.dtype) else torch.float32
        r_hi, r_lo, mm = _prepare_r(r, sdt)
        if config is None:
            config = default_config(x_gates.shape[-1], mm)
        has_init = h0 is not None
        init = tuple(s.to(sdt).contiguous() for s in (h0, c0, n0, m0)) if has_init else None
        x = x_gates.contiguous()
        exp_forget = forget_gate == "exp"
        save = grad_enabled and any(ctx.needs_input_grad[:7])  # inference keeps nothing
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
        grads = [None] * 11
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
    h0, c0, n0, m0 = initial_state if initial_state is not None else (None,) * 4
    clip = None if recurrent_grad_clip is None else float(recurrent_grad_clip)
    h, h_T, c_T, n_T, m_T = SLSTMTritonFunction.apply(x_gates, r, b, h0, c0, n0, m0,
                                                      forget_gate, clip, config,
                                                      torch.is_grad_enabled())
    return h, ((h_T, c_T, n_T, m_T) if output_final_state else None)


def slstm_step_triton(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor,
                      state: Optional[State] = None, *, forget_gate: str = "sigmoid"
                      ) -> Tuple[torch.Tensor, State]:
    """One sLSTM step: x_gates [B, 4, H, D] -> (h [B, H, D], (h, c, n, m) each [B, H, D])."""
    h, final = slstm_recurrent_triton(x_gates.unsqueeze(1), r, b, initial_state=state,
                                      output_final_state=True, forget_gate=forget_gate)
    return h[:, 0], final
