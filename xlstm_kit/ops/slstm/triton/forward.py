"""sLSTM forward: one launch runs all T steps.

    forward(x [B,T,4,H,D], r_hi, r_lo, mm, b [4,H,D], init, exp_forget, save, config)
        -> (h [B,T,H,D], final (h, c, n, m) each [B,H,D], saved (hs, g, cs, ns, ms) or None)

Work split: one program per (tile of block_b batch entries, head); the time loop runs inside
the program, so a step costs no launch, and programs never wait for each other (the recurrence
only mixes units inside one head). Tiles are [D, BT] (units x batch): the step's recurrent
matmul is g̃_gᵀ = R_gᵀ [D, D] @ h_{t-1}ᵀ [D, BT] per gate, so the weights are the large A operand
(wgmma on Hopper for D >= 64) and, loaded once before the loop, stay in shared memory for all
steps (up to D = 128 in bf16). Larger heads loop over K chunks, h_{t-1} going through an
L1-resident scratch and R through L2.

Saved for the backward (when `save`), per step: the gate pre-activations g̃ and (c, n, m), and h
in the state dtype when the output is 16-bit. `forward_reference` is the same computation as a
PyTorch loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_ld, _ld_gates, _ld_init, _load_r, _load_r_gates, _log_sigmoid, _mm, _sigmoid, _st,
                     _st_gates, _tanh, _tile)
from .config import SLSTMKernelConfig, block_d, k_chunk


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
    # Gate quantities are tuples (i, f, z, o) of [BD, BT] tiles.
    sdt = CT.dtype.element_ty
    hd, rd, rb64, md, mask_b, mask, HD, col_s, col_q, col_x = _tile(B, T, NH, D, BT, BD)
    col_h = rb64[None, :] * 2 * HD + hd * D        # HX [B, 2, H, D]
    u0 = rd[:, None]
    h = _ld_init(H0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BD, BT)
    c = _ld_init(C0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BD, BT)
    n = _ld_init(N0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BD, BT)
    m = _ld_init(M0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BD, BT)

    bias = ()
    for k in tl.static_range(4):
        bias = bias + (_ld(BIAS + (k * NH + hd) * D + rd, md, EVEN_D).to(sdt)[:, None],)
    if R_RESIDENT:
        rs = _load_r_gates(R, RLO, hd, NH, D, rd, rd, EVEN_D, True, MM)
    if KC < BD:
        _st(HX + col_h + 1 * HD + u0, h, mask, EVEN)  # h_{-1} in slot (−1) mod 2
        tl.debug_barrier()

    # The inputs of step t do not depend on the recurrence: load them one step ahead so their
    # latency hides behind the previous step's matmul (the last prefetch re-reads step T-1).
    x = _ld_gates(X + col_x, u0, HD, mask, EVEN)
    for t in range(T):
        t64 = tl.cast(t, tl.int64)
        ux = (t64 * 4 * HD + rd)[:, None]
        if PREFETCH:
            un = (tl.minimum(t64 + 1, T - 1) * 4 * HD + rd)[:, None]
            x_next = _ld_gates(X + col_x, un, HD, mask, EVEN)
        else:
            x = _ld_gates(X + col_x, ux, HD, mask, EVEN)

        g = ()
        for k in tl.static_range(4):
            g = g + (x[k].to(sdt) + bias[k],)
        if KC < BD:
            slot = (t + 1) % 2  # h_{t-1}
            for kc in range(0, BD, KC):
                rk = kc + tl.arange(0, KC)
                h_k = _ld(HX + col_h + slot * HD + rk[:, None], (rk < D)[:, None] & mask_b, EVEN)
                acc = ()
                for k in tl.static_range(4):
                    r_c, rc_lo = _load_r(R, RLO, k, hd, NH, D, rd, rk, EVEN_D, True, MM)
                    acc = acc + (_mm(r_c, rc_lo, h_k, g[k], MM),)
                g = acc
        else:
            acc = ()
            for k in tl.static_range(4):
                if R_RESIDENT:
                    r_k, rk_lo = rs[k]
                else:
                    r_k, rk_lo = _load_r(R, RLO, k, hd, NH, D, rd, rd, EVEN_D, True, MM)
                acc = acc + (_mm(r_k, rk_lo, h, g[k], MM),)
            g = acc

        g_i, g_f, g_z, g_o = g
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
            _st_gates(G + col_x, ux, HD, g, mask, EVEN)
            _st(CS + col_q + uq, c, mask, EVEN)
            _st(NS + col_q + uq, n, mask, EVEN)
            _st(MS + col_q + uq, m, mask, EVEN)
            if SAVE_H:
                _st(HS + col_q + uq, h, mask, EVEN)
        if KC < BD:
            _st(HX + col_h + (t % 2) * HD + u0, h, mask, EVEN)
            tl.debug_barrier()  # h_t visible to the whole program before step t+1 reads it
        if PREFETCH:
            x = x_next

    _st(HT + col_s + u0, h, mask, EVEN)
    _st(CT + col_s + u0, c, mask, EVEN)
    _st(NT + col_s + u0, n, mask, EVEN)
    _st(MT + col_s + u0, m, mask, EVEN)


def forward(x, r_hi, r_lo, mm: int, b, init, exp_forget: bool, save: bool,
            config: SLSTMKernelConfig):
    """Launch the forward. x [B,T,4,H,D] contiguous; r_hi, r_lo, mm from `common.prepare_r`;
    init (h, c, n, m) [B,H,D] contiguous in the state dtype, or None (zeros).

    Returns h [B,T,H,D] in x's dtype, the final (h, c, n, m) [B,H,D] in the state dtype, and
    when `save` (hs, g [B,T,4,H,D], cs, ns, ms [B,T,H,D]) in the state dtype (hs is h itself
    when x already has the state dtype), else None.
    """
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
    bd = block_d(dim)
    kc = k_chunk(config, bd)
    hx = torch.empty(batch, 2, heads, dim, dtype=sdt, device=dev) if kc < bd else final[0]
    bt = config.block_b
    grid = (triton.cdiv(batch, bt), heads)
    _slstm_fwd_kernel[grid](
        x, r_hi, r_lo, bias, h0, c0, n0, m0,
        h_out, hs, g, cs, ns, ms, *final, hx,
        batch, steps, heads, dim,
        BT=bt, BD=bd, KC=kc, EVEN=batch % bt == 0 and dim == bd, EVEN_D=dim == bd,
        EXP_FORGET=exp_forget, HAS_INIT=init is not None, SAVE=save, SAVE_H=save_h, MM=mm,
        R_RESIDENT=config.r_resident, PREFETCH=config.prefetch,
        num_warps=config.num_warps, num_stages=1,
    )
    saved = (hs, g, cs, ns, ms) if save else None
    return h_out, tuple(final), saved


def forward_reference(x, r, b, init=None, exp_forget: bool = False):
    """What `forward` computes, as a float64 PyTorch loop (tests): returns h [B,T,H,D], the
    final (h, c, n, m) and the saved (g [B,T,4,H,D], c, n, m [B,T,H,D])."""
    x, r, b = x.double(), r.double(), b.double()
    batch, steps, _, heads, dim = x.shape
    if init is None:
        init = [x.new_zeros(batch, heads, dim) for _ in range(4)]
    h, c, n, m = (s.double() for s in init)
    hs, gs, cs, ns, ms = [], [], [], [], []
    for t in range(steps):
        g = x[:, t] + b + torch.einsum("bhi,ghij->bghj", h, r)
        g_i, g_f, g_z, g_o = g.unbind(1)
        a = (g_f if exp_forget else torch.nn.functional.logsigmoid(g_f)) + m
        m = torch.maximum(a, g_i)
        i_p, f_p = torch.exp(g_i - m), torch.exp(a - m)
        c = f_p * c + i_p * torch.tanh(g_z)
        n = f_p * n + i_p
        h = torch.sigmoid(g_o) * c / n
        for lst, v in zip((hs, gs, cs, ns, ms), (h, g, c, n, m)):
            lst.append(v)
    hs, gs, cs, ns, ms = (torch.stack(v, 1) for v in (hs, gs, cs, ns, ms))
    return hs, (h, c, n, m), (gs, cs, ns, ms)
