"""sLSTM forward: one launch runs all T steps.

    forward(x [B,T,4,H,D], r_hi, r_lo, mm, b [4,H,D], init, exp_forget, save, config, sms, cu_seqlens)
        -> (h [B,T,H,D], final (h, c, n, m) each [B,H,D], saved (hs, g, cs, ns, ms) or None)

Work split: one program per (block of block_u units, tile of block_b batch entries, head); the
time loop runs inside the program, so a step costs no launch. Tiles are [BU, BT] (units x
batch): the step's recurrent matmul is g̃_gᵀ = R_gᵀ[units, :] [BU, D] @ h_{t-1}ᵀ [D, BT] per gate,
so the weights are the large A operand (wgmma on Hopper for BU >= 64) and, loaded once before
the loop, stay in shared memory for all steps. With one program per head (block_u None, up to
D = 128 in bf16) programs never wait for each other: the recurrence only mixes units inside one
head. A head split over P programs (D = 192: 3 x 64 units, no padding) spreads the work over
P times as many SMs; its programs exchange h_t through a global scratch and meet at a barrier
every step (`common._sync`).

Packed sequences (cu_seqlens [N+1], batch 1): the kernels' batch entries are the N sequences.
Column j of a tile reads and writes rows cu[j] + t of the packed tensors while t is below its
length, then keeps its state (its final state) while the tile's longer sequences go on; the
time loop runs to the tile's longest length, read from cu_seqlens on the device (no host
sync). A step costs about the same for one column as for sixteen (it is latency-bound), so a
packed batch costs about as many steps as its longest sequence, not the sum of the lengths.
The barrier groups of a split head are per (tile, head): the programs of one group hold the
same sequences, so they run the same number of steps.

Saved for the backward (when `save`), per step: the gate pre-activations g̃ and (c, n, m), and h
in the state dtype when the output is 16-bit. `forward_reference` is the same computation as a
PyTorch loop.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_ld, _ld_gates, _ld_init, _ld_shared, _live, _load_r, _load_r_chunks, _load_r_stacked,
                     _log_sigmoid, _mm, _sigmoid, _split_gates, _st, _st_gates, _sync, _tanh, _tile)
from .config import SLSTMKernelConfig, flags, grid_of, launch


@triton.jit
def _h_chunk(h, HX, col_h, slot, mask_b, rk, D, HD, EVEN_HK: tl.constexpr, SCRATCH: tl.constexpr,
             SYNC: tl.constexpr):
    """K chunk rk of h_{t-1} [KC, BT]: from slot `slot` of the scratch HX (SCRATCH), else h itself
    (the program holds the whole head in one chunk)."""
    if SCRATCH:
        h_k = _ld_shared(HX + col_h + slot * HD + rk[:, None], (rk < D)[:, None] & mask_b, EVEN_HK, SYNC)
    else:
        h_k = h
    return h_k


@triton.jit
def _matvec(g, h, HX, col_h, slot, mask_b, rs, R, RLO, hd, NH, D, HD, ru,
            KC: tl.constexpr, NKC: tl.constexpr, EVEN_HK: tl.constexpr, EVEN_D: tl.constexpr,
            MM: tl.constexpr, R_RESIDENT: tl.constexpr, SCRATCH: tl.constexpr, SYNC: tl.constexpr,
            STACK: tl.constexpr, BU: tl.constexpr, BT: tl.constexpr):
    """g_k += R_kᵀ[units ru, :] @ h_{t-1}ᵀ for the four gates: h from registers (the program
    holds the whole head, one K chunk) or, with SCRATCH, from slot `slot` of HX in NKC chunks.
    STACK: the four gates' rows as one [4·BU, KC] operand (one dot of M = 4·BU per chunk instead
    of four of M = BU), the product split into the gates after the K chunks."""
    # (an if/else, not an early return: the compiler would still build what follows a return)
    if STACK:
        stacked = tl.zeros([4 * BU, BT], dtype=g[0].dtype)
        for c in tl.static_range(NKC):
            rk = c * KC + tl.arange(0, KC)
            h_k = _h_chunk(h, HX, col_h, slot, mask_b, rk, D, HD, EVEN_HK, SCRATCH, SYNC)
            if R_RESIDENT:
                r_hi, r_lo = rs[c]
            else:
                r_hi, r_lo = _load_r_stacked(R, RLO, hd, NH, D, BU, rk, EVEN_D, MM)
            stacked = _mm(r_hi, r_lo, h_k, stacked, MM)
        parts = _split_gates(stacked, BU, BT)
        g = (g[0] + parts[0], g[1] + parts[1], g[2] + parts[2], g[3] + parts[3])
    else:
        for c in tl.static_range(NKC):
            rk = c * KC + tl.arange(0, KC)
            h_k = _h_chunk(h, HX, col_h, slot, mask_b, rk, D, HD, EVEN_HK, SCRATCH, SYNC)
            acc = ()
            for k in tl.static_range(4):
                if R_RESIDENT:
                    r_k, rk_lo = rs[k * NKC + c]
                else:
                    r_k, rk_lo = _load_r(R, RLO, k, hd, NH, D, ru, rk, EVEN_D, True, MM)
                acc = acc + (_mm(r_k, rk_lo, h_k, g[k], MM),)
            g = acc
    return g


@triton.jit
def _slstm_fwd_kernel(
    X, R, RLO, BIAS, H0, C0, N0, M0,          # inputs
    HOUT, HS, G, CS, NS, MS, HT, CT, NT, MT,  # outputs (HS..MS only when SAVE)
    HX, CNT, CU,                              # scratch [B, 2, H, D], barrier counters [groups], cu_seqlens
    B, T, NH, D, P,
    BT: tl.constexpr, BU: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr, EVEN: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_HK: tl.constexpr, EXP_FORGET: tl.constexpr, HAS_INIT: tl.constexpr,
    SAVE: tl.constexpr, SAVE_H: tl.constexpr, MM: tl.constexpr, R_RESIDENT: tl.constexpr,
    PREFETCH: tl.constexpr, SCRATCH: tl.constexpr, SYNC: tl.constexpr, VARLEN: tl.constexpr,
    STACK: tl.constexpr,
):
    # X [B,T,4,H,D], HOUT/HS/CS/NS/MS [B,T,H,D], G [B,T,4,H,D], states [B,H,D]; all contiguous.
    # Tiles are [BU, BT]: BU units of one head (rows) for BT batch entries (columns), so that
    # the step's matmul is g̃_gᵀ [BU, BT] = R_gᵀ[units, :] [BU, D] @ h_{t-1}ᵀ [D, BT]: the
    # weights are the A operand (M = BU, wgmma on Hopper for BU >= 64), the state the small B
    # operand (N = BT). The weights never change, so when R_RESIDENT the compiler keeps the
    # program's slice in shared memory for the whole loop.
    # SCRATCH (the head split over P programs, or K-chunked): every program writes its units'
    # h_t to slot t mod 2 of HX and, after the group's barrier (SYNC, P > 1), reads the whole
    # h_t back in K chunks. Two slots suffice: a program overwrites slot t mod 2 at step t + 2
    # only after barrier t + 1, which every program reaches after its step-t + 1 reads.
    # Gate quantities are tuples (i, f, z, o) of [BU, BT] tiles.
    # VARLEN: column j is packed sequence j (B = N sequences, X/HOUT/... hold batch 1); it reads
    # and writes rows CU[j] + t while t < its length; after that its steps keep its state (its
    # final state) while the tile's longer sequences go on. All P programs of a group hold the
    # same columns, so they run the same number of steps and meet at every barrier.
    sdt = CT.dtype.element_ty
    hd, grp, ru, rb64, md, mask_b, mask, HD, col_s, col_q, col_x, lens, steps = _tile(
        B, T, NH, D, CU, BT, BU, VARLEN)
    col_h = rb64[None, :] * 2 * HD + hd * D        # HX [B, 2, H, D]
    u0 = ru[:, None]
    h = _ld_init(H0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)
    c = _ld_init(C0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)
    n = _ld_init(N0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)
    m = _ld_init(M0 + col_s + u0, mask, HAS_INIT, EVEN, sdt, BU, BT)
    if VARLEN:  # padding columns never step: n = 1 keeps their (discarded) h = c / n finite
        n = tl.where(mask, n, 1.0)

    bias = ()
    for k in tl.static_range(4):
        bias = bias + (_ld(BIAS + (k * NH + hd) * D + ru, md, EVEN_D).to(sdt)[:, None],)
    rs = ()
    if R_RESIDENT:
        if STACK:
            for kc in tl.static_range(NKC):  # (not c: the cell state's name here)
                rs = rs + (_load_r_stacked(R, RLO, hd, NH, D, BU, kc * KC + tl.arange(0, KC), EVEN_D, MM),)
        else:
            rs = _load_r_chunks(R, RLO, hd, NH, D, ru, KC, NKC, EVEN_D, True, MM)
    if SCRATCH:
        _st(HX + col_h + 1 * HD + u0, h, mask, EVEN)  # h_{-1} in slot (−1) mod 2
        _sync(CNT + grp, 1, P, SYNC)

    # The inputs of step t do not depend on the recurrence: load them one step ahead so their
    # latency hides behind the previous step's matmul (the last prefetch re-reads step T-1).
    x = _ld_gates(X + col_x, u0, HD, mask, EVEN)
    for t in range(steps):
        t64 = tl.cast(t, tl.int64)
        ux = (t64 * 4 * HD + ru)[:, None]
        live = _live(mask, lens, t, VARLEN)
        if PREFETCH:
            if VARLEN:
                un = ((t64 + 1) * 4 * HD + ru)[:, None]
            else:
                un = (tl.minimum(t64 + 1, T - 1) * 4 * HD + ru)[:, None]
            x_next = _ld_gates(X + col_x, un, HD, _live(mask, lens, t + 1, VARLEN), EVEN)
        else:
            x = _ld_gates(X + col_x, ux, HD, live, EVEN)

        g = ()
        for k in tl.static_range(4):
            g = g + (x[k].to(sdt) + bias[k],)
        g = _matvec(g, h, HX, col_h, (t + 1) % 2, mask_b, rs, R, RLO, hd, NH, D, HD, ru, KC, NKC,
                    EVEN_HK, EVEN_D, MM, R_RESIDENT, SCRATCH, SYNC, STACK, BU, BT)

        g_i, g_f, g_z, g_o = g
        if EXP_FORGET:
            log_f = g_f
        else:
            log_f = _log_sigmoid(g_f)
        if VARLEN:
            # A finished sequence's step is made the identity on (c, n, m): log f = 0 and
            # ĩ = -inf give m_t = m_{t-1}, f' = 1, i' = 0 exactly (selects against constants
            # hold no registers); h is kept by a select.
            log_f = tl.where(live, log_f, 0.0)
            g_i = tl.where(live, g_i, float("-inf"))
        a = log_f + m
        m = tl.maximum(a, g_i)
        i_p = tl.exp(g_i - m)
        f_p = tl.exp(a - m)
        c = f_p * c + i_p * _tanh(g_z)
        n = f_p * n + i_p
        if VARLEN:
            h = tl.where(live, _sigmoid(g_o) * c / n, h)
        else:
            h = _sigmoid(g_o) * c / n

        if SCRATCH:  # the exchanged h first: the barrier's release waits for every store before it
            _st(HX + col_h + (t % 2) * HD + u0, h, mask, EVEN)
        uq = (t64 * HD + ru)[:, None]
        _st(HOUT + col_q + uq, h.to(HOUT.dtype.element_ty), live, EVEN)
        if SAVE:
            _st_gates(G + col_x, ux, HD, g, live, EVEN)
            _st(CS + col_q + uq, c, live, EVEN)
            _st(NS + col_q + uq, n, live, EVEN)
            _st(MS + col_q + uq, m, live, EVEN)
            if SAVE_H:
                _st(HS + col_q + uq, h, live, EVEN)
        if SCRATCH:
            _sync(CNT + grp, t + 2, P, SYNC)  # h_t visible to the group before step t+1
        if PREFETCH:
            x = x_next

    _st(HT + col_s + u0, h, mask, EVEN)
    _st(CT + col_s + u0, c, mask, EVEN)
    _st(NT + col_s + u0, n, mask, EVEN)
    _st(MT + col_s + u0, m, mask, EVEN)


def forward(x, r_hi, r_lo, mm: int, b, init, exp_forget: bool, save: bool,
            config: SLSTMKernelConfig, sms=None, cu_seqlens=None):
    """Launch the forward. x [B,T,4,H,D] contiguous; r_hi, r_lo, mm from `common.prepare_r`;
    init (h, c, n, m) [B,H,D] contiguous in the state dtype, or None (zeros); sms: the device's
    SM count (a split head needs it); cu_seqlens: None or int32/int64 [N+1] (values checked by
    the caller) packing N sequences into x's one batch row (B = 1), init then [N,H,D].

    Returns h [B,T,H,D] in x's dtype, the final (h, c, n, m) [B,H,D] ([N,H,D] packed) in the
    state dtype, and when `save` (hs, g [B,T,4,H,D], cs, ns, ms [B,T,H,D]) in the state dtype
    (hs is h itself when x already has the state dtype), else None.
    """
    batch, steps, _, heads, dim = x.shape
    sdt = r_hi.dtype if mm == 0 else torch.float32
    dev = x.device
    h_out = torch.empty(batch, steps, heads, dim, dtype=x.dtype, device=dev)
    varlen = cu_seqlens is not None
    rows = cu_seqlens.shape[0] - 1 if varlen else batch  # packed: the kernel's batch is the sequences
    final = [torch.empty(rows, heads, dim, dtype=sdt, device=dev) for _ in range(4)]
    save_h = save and x.dtype != sdt
    if save:
        g = torch.empty(batch, steps, 4, heads, dim, dtype=sdt, device=dev)
        cs, ns, ms = (torch.empty(batch, steps, heads, dim, dtype=sdt, device=dev) for _ in range(3))
        hs = torch.empty_like(cs) if save_h else h_out
    else:
        g = cs = ns = ms = hs = h_out  # never touched (SAVE=False)
    bias = b.to(sdt).contiguous()
    h0, c0, n0, m0 = init if init is not None else (final[0],) * 4
    lc = launch(config, dim)
    bt = config.block_b
    grid = grid_of(rows, heads, bt, lc, sms)
    hx = torch.empty(rows, 2, heads, dim, dtype=sdt, device=dev) if lc.scratch else final[0]
    cnt = torch.zeros(grid[1] * heads, dtype=torch.int32, device=dev)
    _slstm_fwd_kernel[grid](
        x, r_hi, r_lo, bias, h0, c0, n0, m0,
        h_out, hs, g, cs, ns, ms, *final, hx, cnt, cu_seqlens if varlen else cnt,
        rows, steps, heads, dim, lc.p,
        BT=bt, BU=lc.bu, KC=lc.kc, NKC=lc.nkc, **flags(rows, dim, bt, lc, varlen),
        EXP_FORGET=exp_forget, HAS_INIT=init is not None, SAVE=save, SAVE_H=save_h, MM=mm,
        R_RESIDENT=config.r_resident, PREFETCH=config.prefetch, SCRATCH=lc.scratch,
        SYNC=lc.p > 1, VARLEN=varlen, STACK=config.stack_gates, num_warps=config.num_warps, num_stages=1,
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
