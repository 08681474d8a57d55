"""sLSTM backward: one launch runs all T steps in reverse.

    backward(r_hi, r_lo, mm, saved (hs, g, cs, ns, ms), init, dh_out, d_final, exp_forget,
             clip, config, sms, cu_seqlens) -> (δg̃ [B,T,4,H,D], (δh_0, δc_0, δn_0, δm_0) each [B,H,D])

Maths: docs/design.md ("sLSTM") and the stabilized backward of `..recurrent` (paper eqs. 41–51
with the
adjoints of c and n carried scaled by n_t, and the stabilizer's adjoint routed through the max the
way torch.maximum does), so the gradients equal autograd of `naive.slstm_recurrent_naive`.
The kernel writes δg̃ = δx_gates per step in the state dtype. δR = Σ_t h_{t-1}ᵀ δg̃_t and
δb = Σ_t δg̃_t are plain batched reductions over all (b, t) left to torch (`op.py`): an
accumulator for δR ([D, 4D] per program) would not fit on chip. A head split over P programs
(`config.SLSTMKernelConfig.block_u`) exchanges δg̃_t through δx_gates itself and a barrier per
step, as the forward exchanges h_t. Packed sequences: as in the forward, one column per
sequence, each walked back from its own last step with its own final-state gradient.
`backward_reference` is the same computation through autograd of the PyTorch op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_ld, _ld_gates, _ld_init, _ld_shared, _live, _load_r, _load_r_chunks, _log_sigmoid,
                     _mm, _sigmoid, _st, _st_gates, _sync, _tanh, _tile)
from .config import SLSTMKernelConfig, flags, grid_of, launch


@triton.jit
def _load_step(G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, ru, mask, lens, t, HD,
               HAS_DH: tl.constexpr, EVEN: tl.constexpr, sdt: tl.constexpr, VARLEN: tl.constexpr):
    """Everything step t's backward reads that does not depend on the reverse recurrence:
    the gate pre-activations (a tuple i, f, z, o) and δh^ext of step t, and the state (c, n, m)
    before step t (the initial state when t = 0). t < 0 is clamped (a harmless re-read, never
    used). VARLEN: the inputs of step t only for the columns whose sequence has a step t, the
    state before it also for those whose sequence ends at step t - 1 (their final state, the
    state after their last step: see the kernel)."""
    live = _live(mask, lens, t, VARLEN)
    tc = tl.cast(tl.maximum(t, 0), tl.int64)
    ux = (tc * 4 * HD + ru)[:, None]
    g = _ld_gates(G + col_x, ux, HD, live, EVEN)
    if HAS_DH:
        dh = _ld(DH + col_q + (tc * HD + ru)[:, None], live, EVEN).to(sdt)
    else:
        dh = tl.zeros(g[0].shape, sdt)
    up = (tl.maximum(tc - 1, 0) * HD + ru)[:, None]
    first = t <= 0
    before = _live(mask, lens, t - 1, VARLEN)
    c_p = tl.where(first, c0, _ld(CS + col_q + up, before, EVEN))
    n_p = tl.where(first, n0, _ld(NS + col_q + up, before, EVEN))
    m_p = tl.where(first, m0, _ld(MS + col_q + up, before, EVEN))
    return g, dh, c_p, n_p, m_p


@triton.jit
def _dh_by_partials(dg, rs, R, RLO, PX, CNT, grp, slot, k, P, PS, hd, NH, D, ru, md,
                    BU: tl.constexpr, BT: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr,
                    EVEN_D: tl.constexpr, MM: tl.constexpr, R_RESIDENT: tl.constexpr, SYNC: tl.constexpr):
    """δh^R_{t-1} of the program's units by partial sums: the program multiplies its own units'
    δg̃_t (K = BU per gate) by their columns of R_g, which gives their share of δh for the whole
    head in chunks of KC rows (M = KC: products a warpgroup's wgmma takes, δg̃ its B operand,
    put in shared memory once for all chunks), writes it to its place in slot `slot` of PX
    [group, 2, P, PS] (PS = BT × rows, units fastest, as the state tiles are laid out, so that
    the sums read back need no layout conversion), meets the group at barrier k, and sums the
    P shares of its own units. The other exchange reads every unit's δg̃ (K = 4·D) for
    products of M = BU rows."""
    rows = (grp * 2 + slot).to(tl.int64) * P
    cols = tl.arange(0, BT)[None, :] * (PS // BT)  # units fastest, as the other [BU, BT] tiles
    mine = PX + (rows + tl.program_id(0)) * PS
    for c in tl.static_range(NKC):
        rk = c * KC + tl.arange(0, KC)
        part = tl.zeros([KC, BT], dtype=dg[0].dtype)
        for g in tl.static_range(4):
            if R_RESIDENT:
                r_hi, r_lo = rs[g * NKC + c]
            else:
                r_hi, r_lo = _load_r(R, RLO, g, hd, NH, D, rk, ru, EVEN_D, False, MM)
            part = _mm(r_hi, r_lo, dg[g], part, MM)
        tl.store(mine + rk[:, None] + cols, part)
    _sync(CNT + grp, k, P, SYNC)
    acc = tl.zeros([BU, BT], dtype=dg[0].dtype)
    for q in range(P):
        acc += _ld_shared(PX + (rows + q) * PS + ru[:, None] + cols, md[:, None], EVEN_D, SYNC)
    return acc


@triton.jit
def _slstm_bwd_kernel(
    R, RLO, DH, G, CS, NS, MS, C0, N0, M0,   # R: the forward's weights
    DHT, DCT, DNT, DMT,                      # gradients of the final state
    DG, DH0, DC0, DN0, DM0,                  # outputs
    CNT, CU, PX,                             # barrier counters [groups], cu_seqlens, partial sums
    B, T, NH, D, P, PS, clip,
    BT: tl.constexpr, BU: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr, EVEN: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_HK: tl.constexpr, EXP_FORGET: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_DFINAL: tl.constexpr, CLIP: tl.constexpr, MM: tl.constexpr,
    R_RESIDENT: tl.constexpr, PREFETCH: tl.constexpr, SCRATCH: tl.constexpr, SYNC: tl.constexpr,
    VARLEN: tl.constexpr, PARTIALS: tl.constexpr,
):
    # Same tiles as the forward ([BU, BT]); the step's matmul is
    # δh^Rᵀ [BU, BT] = Σ_g R_g[units, :] [BU, D] @ δg̃_gᵀ [D, BT]. SCRATCH: every program
    # writes its units' δg̃_t to DG (the output), and after the group's barrier (SYNC) reads
    # the whole δg̃_t back in K chunks; each step has its own place in DG, so no slots.
    # VARLEN: column j is packed sequence j (see the forward). The loop runs t from the tile's
    # longest length down to 0; a column joins at its own last step, starting from its own
    # final-state gradient: until then it keeps its adjoints (δh^R, Ĉ, N̂, δm by selects, ρ = 1),
    # and its state (c, n, m) "after the step" is its final state, read at step len_j (the
    # state before step t is read up to t = len_j; nothing else is selected: a kept tile lives
    # across the whole step, in registers). Every column ends at its t = 0, so the
    # initial-state gradients are those of the last step for all.
    # PARTIALS: the exchange is of partial sums of δh instead (_dh_by_partials); DG is then
    # only the output.
    sdt = DG.dtype.element_ty
    hd, grp, ru, rb64, md, mask_b, mask, HD, col_s, col_q, col_x, lens, steps = _tile(
        B, T, NH, D, CU, BT, BU, VARLEN)
    u0 = ru[:, None]
    c0 = _ld_init(C0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)
    n0 = _ld_init(N0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)
    m0 = _ld_init(M0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)

    # State after the last step; padding gets n = 1 so that 1/n stays finite there.
    if VARLEN:
        ul = (lens - 1)[None, :] * HD + ru[:, None]
    else:
        ul = (tl.cast(T - 1, tl.int64) * HD + ru)[:, None]
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
        dh_rec = tl.zeros([BU, BT], sdt)
        c_hat = tl.zeros([BU, BT], sdt)
        n_hat = tl.zeros([BU, BT], sdt)
        dm = tl.zeros([BU, BT], sdt)
    rho = tl.full([BU, BT], 1.0, sdt)   # ρ_{t+1}; none before the last step
    f_over_n = tl.zeros([BU, BT], sdt)  # f'_t / n_t of the step just done (t = 0 at the end)

    rs = ()
    if R_RESIDENT:
        if PARTIALS:
            for g in tl.static_range(4):
                for kc in tl.static_range(NKC):
                    rk = kc * KC + tl.arange(0, KC)
                    rs = rs + (_load_r(R, RLO, g, hd, NH, D, rk, ru, EVEN_D, False, MM),)
        else:
            rs = _load_r_chunks(R, RLO, hd, NH, D, ru, KC, NKC, EVEN_D, False, MM)

    if PREFETCH:
        g, dh_x, c_p, n_p, m_p = _load_step(G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, ru, mask,
                                            lens, steps - 1, HD, HAS_DH, EVEN, sdt, VARLEN)
    for tt in range(steps):
        t = steps - 1 - tt
        live = _live(mask, lens, t, VARLEN)
        if VARLEN:  # the adjoints, kept until the column's sequence has a step t
            held = (dh_rec, c_hat, n_hat, dm)
        if PREFETCH:
            g_next, dh_x_next, c_p_next, n_p_next, m_p_next = _load_step(
                G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, ru, mask, lens, t - 1, HD, HAS_DH, EVEN,
                sdt, VARLEN)
        else:
            g, dh_x, c_p, n_p, m_p = _load_step(G, DH, CS, NS, MS, c0, n0, m0, col_x, col_q, ru, mask,
                                                lens, t, HD, HAS_DH, EVEN, sdt, VARLEN)

        g_i, g_f, g_z, g_o = g
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
        dg = (d_i, d_f, d_z, d_o)
        if not EVEN:  # padding (and VARLEN: columns without a step t) must not feed the matmul
            masked = ()
            for k in tl.static_range(4):
                masked = masked + (tl.where(live, dg[k], 0.0),)
            dg = masked
        ux = (tl.cast(t, tl.int64) * 4 * HD + ru)[:, None]
        _st_gates(DG + col_x, ux, HD, dg, live, EVEN)

        # (49): δh^R_{t-1} = Σ_g δg̃_g R_gᵀ, here transposed: Σ_g R_g @ δg̃_gᵀ
        # (an if/else, not an early return: the compiler would still build what follows a return)
        if PARTIALS:
            acc = _dh_by_partials(dg, rs, R, RLO, PX, CNT, grp, tt % 2, tt + 1, P, PS, hd, NH, D, ru, md,
                                  BU, BT, KC, NKC, EVEN_D, MM, R_RESIDENT, SYNC)
        else:
            if SCRATCH:
                _sync(CNT + grp, tt + 1, P, SYNC)  # δg̃_t of all units visible to the group
            acc = tl.zeros([BU, BT], sdt)
            for c in tl.static_range(NKC):
                rk = c * KC + tl.arange(0, KC)
                uk = (tl.cast(t, tl.int64) * 4 * HD + rk)[:, None]
                lm = (rk < D)[:, None] & _live(mask_b, lens, t, VARLEN)
                for k in tl.static_range(4):
                    if SCRATCH:
                        dg_k = _ld_shared(DG + col_x + k * HD + uk, lm, EVEN_HK, SYNC)
                    else:
                        dg_k = dg[k]
                    if R_RESIDENT:
                        r_k, rk_lo = rs[k * NKC + c]
                    else:
                        r_k, rk_lo = _load_r(R, RLO, k, hd, NH, D, ru, rk, EVEN_D, False, MM)
                    acc = _mm(r_k, rk_lo, dg_k, acc, MM)
        if CLIP:
            acc = tl.minimum(tl.maximum(acc, -clip), clip)
        dh_rec = acc

        c_cur = c_p
        if EVEN:
            n_cur = n_p
        else:  # (VARLEN: also where nothing was read, so that 1/n stays finite)
            n_cur = tl.where(_live(mask, lens, t - 1, VARLEN), n_p, 1.0)
        m_cur = m_p
        if VARLEN:
            dh_rec = tl.where(live, dh_rec, held[0])
            c_hat = tl.where(live, c_hat, held[1])
            n_hat = tl.where(live, n_hat, held[2])
            dm = tl.where(live, dm, held[3])
            rho = tl.where(live, rho, 1.0)  # its value before the last step
        if PREFETCH:
            g = g_next
            dh_x = dh_x_next
            c_p = c_p_next
            n_p = n_p_next
            m_p = m_p_next

    _st(DH0 + col_s + u0, dh_rec, mask, EVEN)
    # δc_0 = f'_0 δc (after step 0) = (f'_0 / n_0) Ĉ_0: no division by the initial n (0 by default).
    _st(DC0 + col_s + u0, f_over_n * c_hat, mask, EVEN)
    _st(DN0 + col_s + u0, f_over_n * n_hat, mask, EVEN)
    _st(DM0 + col_s + u0, dm, mask, EVEN)


def backward(r_hi, r_lo, mm: int, saved, init, dh_out, d_final, exp_forget: bool, clip,
             config: SLSTMKernelConfig, sms=None, cu_seqlens=None):
    """Launch the backward. saved = `forward`'s (hs, g, cs, ns, ms); init (h, c, n, m) as given
    to `forward` or None; dh_out [B,T,H,D] or None; d_final a 4-tuple of [B,H,D] gradients
    (entries may be None) or None; sms and cu_seqlens as for `forward.forward` (packed: the
    states and their gradients [N,H,D]). Returns δg̃ [B,T,4,H,D] and [δh_0, δc_0, δn_0, δm_0]
    [B,H,D] ([N,H,D] packed), all in the state dtype."""
    hs, g, cs, ns, ms = saved
    batch, steps, _, heads, dim = g.shape
    varlen = cu_seqlens is not None
    if varlen:
        batch = cu_seqlens.shape[0] - 1
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
    lc = launch(config, dim)
    bt = config.block_b
    grid = grid_of(batch, heads, bt, lc, sms)
    cnt = torch.zeros(grid[1] * heads, dtype=torch.int32, device=dev)
    # partial sums [group, 2 slots, P, rows, BT]: rows cover both the K chunks and the units
    ps = max(lc.p * lc.bu, lc.nkc * lc.kc) * bt
    px = torch.empty(grid[1] * heads * 2 * lc.p * ps if config.bwd_partials else 0, dtype=sdt, device=dev)
    _slstm_bwd_kernel[grid](
        r_hi, r_lo, dh_out, g, cs, ns, ms, c0, n0, m0,
        *d_final, dg, *d_init, cnt, cu_seqlens if varlen else cnt, px,
        batch, steps, heads, dim, lc.p, ps, float(clip) if clip is not None else 0.0,
        BT=bt, BU=lc.bu, KC=lc.kc, NKC=lc.nkc, **flags(batch, dim, bt, lc, varlen),
        EXP_FORGET=exp_forget, HAS_INIT=init is not None, HAS_DH=has_dh,
        HAS_DFINAL=has_dfinal, CLIP=clip is not None, MM=mm, R_RESIDENT=config.r_resident,
        PREFETCH=config.prefetch, SCRATCH=lc.scratch, SYNC=lc.p > 1, VARLEN=varlen,
        PARTIALS=config.bwd_partials, num_warps=config.num_warps, num_stages=1,
    )
    return dg, d_init


def backward_reference(x, r, b, init, dh_out, d_final, exp_forget: bool = False, clip=None):
    """What `backward` computes, in float64 through autograd of the PyTorch op (tests):
    δx_gates = δg̃ [B,T,4,H,D] and the initial state's (δh, δc, δn, δm)."""
    from ..recurrent import slstm_recurrent_torch

    x = x.detach().double().requires_grad_(True)
    state = [s.detach().double().requires_grad_(True) for s in init]
    h, final = slstm_recurrent_torch(x, r.double(), b.double(), initial_state=tuple(state),
                                     output_final_state=True,
                                     forget_gate="exp" if exp_forget else "sigmoid",
                                     recurrent_grad_clip=clip)
    loss = (h * dh_out.double()).sum() + sum((f * d.double()).sum() for f, d in zip(final, d_final))
    grads = torch.autograd.grad(loss, [x, *state])
    return grads[0], grads[1:]
