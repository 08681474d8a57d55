"""Chunkwise DPLR in Triton: the WY algorithm of the seed (section 二) and its hand-written
backward (section 三).

Same maths and notation as chunkwise.py (the tested PyTorch version): per chunk of L steps, with
G the inclusive cumulative sum of gk over the chunk (log Γ of the seed) and the state stored
transposed (h = Sᵀ ∈ R^{K×V}),

    pair matrices   A_xy[r, i] = Σ_k x_r[k] y_i[k] e^{G_r[k] − G_i[k]},  i ≤ r (i < r for x = b)
    WY              F = I + A_ba,  E = F⁻¹,  W = E B←,  Cm = −E (A_bk V)
    state passing   V2 = Cm − W h,  h' = Diag(γ_L) h + (K ⊙ e^{G_L−G})ᵀ V + (A ⊙ e^{G_L−G})ᵀ V2
    output          O = (Q ⊙ e^G) h + A_qk V + A_qa V2

Kernels (all accumulation, scratch and states in float32; kernel → launcher → autograd.Function):
  forward
    _fwd_pairs  parallel over (chunk, column sub-chunk, b·h): the four pair matrices, one [L, S]
                column block each, written to scratch [BH, N, L, L]
    _fwd_wy     parallel over (chunk, b·h): E on chip (diagonal blocks by row-wise forward
                substitution, then block forward substitution with products), W = E B←,
                Cm = −E (A_bk V), and the decayed operands Q ⊙ e^G, K ⊙ e^{G_L−G},
                A ⊙ e^{G_L−G}, e^{G_L} of the sequential kernels
    _fwd_state  sequential over chunks, parallel over (V-tile, b·h): V2, the output, the state
                (_fwd_state_kh / _bwd_state_kh: the same with the state in two K/2 halves)
  backward (seed §三, typos fixed as in chunkwise.py; the forward's scratch is kept, not recomputed)
    _bwd_state  reverse-sequential over chunks per (V-tile, b·h): δ of each chunk's end state, δV2
    _bwd_dv     parallel over (chunk, b·h): δv, GC = Eᵀ δC and the pair-matrix gradients
    _bwd_dk     parallel over (chunk, K-tile, b·h): δq, δk, δa, δb and the gate gradient
Memory: the forward keeps (4 L + 6 K + V) float32 values per token and head (A_qk, A_qa, A_bk, E;
W, Q⊙e^G, K⊙e^{G_L−G}, A⊙e^{G_L−G}, G in float64; V2) plus one K×V state per chunk: about
1.5 GB at B=8, T=2048, H=16, K=V=128.

Numerics (log-gates down to −5 per step). The seed's factorisation Q← = Q⊙Γ, K→ = K⊘Γ would
need 1/Γ up to e^{320} in a chunk of 64 steps at gk = −5. The pair matrices are therefore built
per column sub-chunk J of S = 16 steps with a reference point inside the chunk:
  rows below J:  (X ⊙ e^{G_r − G_end(J)}) (Y_J ⊙ e^{G_end(J) − G_J})ᵀ   — both factors ≤ 1, any gk;
  rows inside J:  (X ⊙ e^{G_r − G_mid(J)}) (Y_J ⊙ e^{G_mid(J) − G_J})ᵀ, G_mid(J) at step 8 of the
                 16 — each factor lies in [e^{−40}, e^{40}] at gk ≥ −5 (the float32 limits are
                 e^{±88}; even the low parts of the 3-pass TF32 split stay normal numbers), and
                 the product is e^{G_r − G_i} ≤ 1 for every pair used. The entries above the
                 diagonal of the block (up to e^{80}·|xy|) are replaced by 0 with `where` and
                 never reach a later sum. (Tested at −5; the factors stay finite to about −10.)
Precision modes. Products run as 3-pass TF32 (≈ float32) except, when every input is bfloat16,
those whose results reach only bf16 outputs: A_qk, the three output products of _fwd_state
(Q⊙e^G h, A_qk V, A_qa V2) and all of _bwd_dv and _bwd_dk (δv, δq, δk, δa, δb, δgk). These run
as single-pass TF32 (LOWP_DEFAULT / XLSTM_DPLR_LOWP = "tf32"). Whatever the final state or δh0
depends on (A_ba, A_bk, A_qa, E, W, Cm, the state kernels) stays 3-pass: the PyTorch op returns
the float32 state with ~5e-8 error, and the 2x rule leaves no room there. Operands rounded to
bf16 ("bf16") are not the default: with operand rounding as coarse as the outputs' own, the gate
gradient (a cumulative sum of differences) gets 3.5x the PyTorch op's error (measured with the
float16 analogue in the interpreter); TF32's operand rounding (2^-11) is 8x below bf16's.
All other decays (e^{G_r}, e^{G_L − G_r}, e^{G_L}) are ≤ 1. G is cumulated in float64 (the
wrapper's cumsum) and only differences are cast to float32 before the exp: a float32 G reaches
−320 at gk = −5 and differences of such numbers would cost 2e-5 relative on every decay.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as nnf
import triton
import triton.language as tl

from .kda import check_kda_inputs
from .naive import check_chunk, check_dplr_inputs, check_scale

SUB = 16  # column sub-chunk of the pair matrices (see the module docstring for why 16)

# Warps per kernel. Every kernel still spills registers at K = V = 128 (ptxas for sm_90a, table in
# benchmarks/NOTES-dplr.md): the 3-pass TF32 products keep hi/lo copies of [L, K] float32
# operands. num_stages = 1 everywhere: the default software pipelining double-buffers every
# [L, K] operand of the chunk loops in shared memory (378 KB for _fwd_state at K = V = 128, far
# over the 227 KB an H200 block may use); unpipelined, the largest kernel needs 196 KB at 256.
_NUM_WARPS = {"_fwd_wy": 8, "_bwd_dv": 8, "_bwd_dk": 8}   # _fwd_pairs: by L; state kernels: _config


def _launch(name: str) -> dict:
    return {"num_warps": _NUM_WARPS[name], "num_stages": 1}


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _mm(x, y, LO: tl.constexpr, PREC: tl.constexpr):
    """Product of float32 tiles for results that only reach 16-bit outputs (module docstring,
    "Precision modes"): LO = 0 at PREC, 1 single-pass TF32, 2 bfloat16 operands, 3 float16
    operands (tests under the interpreter, which has no bfloat16); float32 accumulation always."""
    if LO == 1:
        r = tl.dot(x, y, input_precision="tf32")
    elif LO == 2:
        r = tl.dot(x.to(tl.bfloat16), y.to(tl.bfloat16))
    elif LO == 3:
        r = tl.dot(x.to(tl.float16), y.to(tl.float16))
    else:
        r = tl.dot(x, y, input_precision=PREC)
    return r


@triton.jit
def _fwd_pairs(q, k, a, b, G, Aqk, Aqa, Abk, Aba, scale, Tp, NC,
               K: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, LO: tl.constexpr):
    """One [L, S] column block (sub-chunk j) of A_qk, A_qa, A_bk, A_ba of one chunk.
    q, k, a, b: [BH, Tp, K] (input dtype); G: [BH, Tp, K] float64; A*: [BH, NC, L, L] float32."""
    NB: tl.constexpr = L // S
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n = pid // NB
    j0 = (pid % NB) * S
    t0 = n * L
    rows = tl.arange(0, L)
    cols = tl.arange(0, S)
    below = rows >= j0 + S
    inblk = (rows >= j0) & (rows < j0 + S)
    acc_qk = tl.zeros([L, S], dtype=tl.float32)
    acc_qa = tl.zeros([L, S], dtype=tl.float32)
    acc_bk = tl.zeros([L, S], dtype=tl.float32)
    acc_ba = tl.zeros([L, S], dtype=tl.float32)
    base = bh * Tp * K
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        px = base + (t0 + rows)[:, None] * K + kk[None, :]            # [L, BK]
        py = base + (t0 + j0 + cols)[:, None] * K + kk[None, :]       # [S, BK]
        Gx = tl.load(G + px)
        Gy = tl.load(G + py)
        g_end = tl.load(G + base + (t0 + j0 + S - 1) * K + kk)        # [BK]
        g_mid = tl.load(G + base + (t0 + j0 + S // 2 - 1) * K + kk)     # [BK]
        fx_off = tl.exp(tl.where(below[:, None], Gx - g_end[None, :], float("-inf")).to(tl.float32))
        fx_in = tl.exp(tl.where(inblk[:, None], Gx - g_mid[None, :], float("-inf")).to(tl.float32))
        fy_off = tl.exp((g_end[None, :] - Gy).to(tl.float32))
        fy_in = tl.exp((g_mid[None, :] - Gy).to(tl.float32))
        xq = tl.load(q + px).to(tl.float32) * scale
        xb = tl.load(b + px).to(tl.float32)
        yk = tl.load(k + py).to(tl.float32)
        ya = tl.load(a + py).to(tl.float32)
        yk_off = tl.trans(yk * fy_off)
        yk_in = tl.trans(yk * fy_in)
        ya_off = tl.trans(ya * fy_off)
        ya_in = tl.trans(ya * fy_in)
        xq_off = xq * fx_off
        xq_in = xq * fx_in
        xb_off = xb * fx_off
        xb_in = xb * fx_in
        acc_qk += _mm(xq_off, yk_off, LO, PREC) + _mm(xq_in, yk_in, LO, PREC)
        acc_qa += tl.dot(xq_off, ya_off, input_precision=PREC) + tl.dot(xq_in, ya_in, input_precision=PREC)
        acc_bk += tl.dot(xb_off, yk_off, input_precision=PREC) + tl.dot(xb_in, yk_in, input_precision=PREC)
        acc_ba += tl.dot(xb_off, ya_off, input_precision=PREC) + tl.dot(xb_in, ya_in, input_precision=PREC)
    ci = j0 + cols
    incl = ci[None, :] <= rows[:, None]
    strict = ci[None, :] < rows[:, None]
    pa = ((bh * NC + n) * L + rows)[:, None] * L + ci[None, :]
    tl.store(Aqk + pa, tl.where(incl, acc_qk, 0.0))
    tl.store(Aqa + pa, tl.where(incl, acc_qa, 0.0))
    tl.store(Abk + pa, tl.where(strict, acc_bk, 0.0))
    tl.store(Aba + pa, tl.where(strict, acc_ba, 0.0))


@triton.jit
def _fwd_wy(q, k, a, b, v, G, Abk, Aba, E, W, Cm, Qg, Kd, Ad, eGl, scale, Tp, NC,
            K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, PREC: tl.constexpr):
    """E = (I + A_ba)⁻¹, W = E B←, Cm = −E (A_bk V) for one chunk, and the decayed operands of
    the sequential kernels (so those load no float64): Qg = scale·q ⊙ e^G, Kd = k ⊙ e^{G_L−G},
    Ad = a ⊙ e^{G_L−G} [BH, Tp, K], eGl = e^{G_L} [BH, NC, K].
    q, k, a, b: [BH, Tp, K]; v: [BH, Tp, V]; G float64; Abk, Aba, E: [BH, NC, L, L]; W: [BH, Tp, K];
    Cm: [BH, Tp, V] (float32)."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t0 = n * L
    rows = tl.arange(0, L)
    pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
    Nm = tl.load(Aba + pa)                                   # strictly lower part of F
    # E = F⁻¹ in two stages (F = I + N, N strictly lower):
    # 1. the S×S diagonal blocks, all at once, by forward substitution row by row for D = E_d − I:
    #    D_i = −N_i − Σ_{j<i} N_ij D_j. Step i treats row i of every block together: their
    #    nonzeros sit in disjoint column blocks, so one full-width sum serves all of them and the
    #    block mask puts each part back in its own row. Rows not yet formed are still 0 and
    #    N_ij = 0 for j ≥ i, so the sums are exact. S − 1 steps instead of L − 1.
    # 2. block forward substitution with matrix products: E_R = E_d,RR (e_R − Σ_{M<R} N_RM E_M).
    same = (rows[:, None] // S) == (rows[None, :] // S)
    Nd = tl.where(same, Nm, 0.0)
    D = tl.zeros([L, L], dtype=tl.float32)
    for i in range(1, S):
        sel = (rows[:, None] % S) == i
        r = -tl.sum(tl.where(sel, Nd, 0.0), axis=0)          # −N_i of every block   [L]
        r = r + tl.sum(r[:, None] * D, axis=0)                 # −N_i − Σ_j N_ij D_j
        D = tl.where(sel & same, r[None, :], D)
    Ed = D + tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    No = Nm - Nd                                              # strictly block-lower part
    Em = Ed
    for rb in range(1, L // S):
        X = tl.dot(tl.where((rows[:, None] // S) == rb, No, 0.0), Em, input_precision=PREC)
        Em = Em - tl.dot(Ed, X, input_precision=PREC)
    tl.store(E + pa, Em)
    base_k = bh * Tp * K
    g_ptr = G + base_k + (t0 + rows)[:, None] * K
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        pk = base_k + (t0 + rows)[:, None] * K + kk[None, :]
        Gc = tl.load(g_ptr + kk[None, :])
        g_last = tl.load(G + base_k + (t0 + L - 1) * K + kk)
        eG = tl.exp(Gc.to(tl.float32))
        dec = tl.exp((g_last[None, :] - Gc).to(tl.float32))
        Bg = tl.load(b + pk).to(tl.float32) * eG
        tl.store(W + pk, tl.dot(Em, Bg, input_precision=PREC))
        tl.store(Qg + pk, tl.load(q + pk).to(tl.float32) * (eG * scale))
        tl.store(Kd + pk, tl.load(k + pk).to(tl.float32) * dec)
        tl.store(Ad + pk, tl.load(a + pk).to(tl.float32) * dec)
        tl.store(eGl + (bh * NC + n) * K + kk, tl.exp(g_last.to(tl.float32)))
    Ab = tl.load(Abk + pa)
    base_v = bh * Tp * V
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        vt = tl.load(v + pv).to(tl.float32)
        P = tl.dot(Ab, vt, input_precision=PREC)
        tl.store(Cm + pv, -tl.dot(Em, P, input_precision=PREC))


@triton.jit
def _fwd_state(Qg, Kd, Ad, eGl, v, Aqk, Aqa, W, Cm, h0, Hs, V2, O, hT, Tp, NC,
               K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
               HAS_H0: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr):
    """Sequential over the chunks of one (b·h, V-tile): V2, O and the state h [K, BV].
    Hs: [BH, NC, K, V] states entering each chunk; V2, O: [BH, Tp, V]; h0, hT: [BH, K, V]."""
    vt_id = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, L)
    kr = tl.arange(0, K)
    vv = vt_id * BV + tl.arange(0, BV)
    ph = kr[:, None] * V + vv[None, :]                       # [K, BV] within one state
    if HAS_H0:
        h = tl.load(h0 + bh * K * V + ph).to(tl.float32)
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    base_k = bh * Tp * K
    base_v = bh * Tp * V
    for n in range(0, NC):
        t0 = n * L
        tl.store(Hs + (bh * NC + n) * K * V + ph, h)
        pk = base_k + (t0 + rows)[:, None] * K + kr[None, :]
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
        vt = tl.load(v + pv).to(tl.float32)
        v2 = tl.load(Cm + pv) - tl.dot(tl.load(W + pk), h, input_precision=PREC)
        tl.store(V2 + pv, v2)
        o = _mm(tl.load(Qg + pk), h, LO, PREC)
        o += _mm(tl.load(Aqk + pa), vt, LO, PREC)
        o += _mm(tl.load(Aqa + pa), v2, LO, PREC)
        tl.store(O + pv, o)
        h = tl.load(eGl + (bh * NC + n) * K + kr)[:, None] * h
        h += tl.dot(tl.trans(tl.load(Kd + pk)), vt, input_precision=PREC)
        h += tl.dot(tl.trans(tl.load(Ad + pk)), v2, input_precision=PREC)
    tl.store(hT + bh * K * V + ph, h)


@triton.jit
def _bwd_state(Qg, Ad, eGl, Aqa, W, dO, dhT, dH, dV2, dh0, Tp, NC,
               K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
               HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """Reverse-sequential over the chunks of one (b·h, V-tile), seed §三:
        δV2 = (A ⊙ e^{G_L−G}) δh' + A_qaᵀ δO,   δh = Diag(γ_L) δh' + Q←ᵀ δO − Wᵀ δV2.
    dH: [BH, NC, K, V] δ of the state leaving each chunk; dV2: [BH, Tp, V]; dhT, dh0: [BH, K, V]."""
    vt_id = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, L)
    kr = tl.arange(0, K)
    vv = vt_id * BV + tl.arange(0, BV)
    ph = kr[:, None] * V + vv[None, :]
    if HAS_DHT:
        dh = tl.load(dhT + bh * K * V + ph).to(tl.float32)
    else:
        dh = tl.zeros([K, BV], dtype=tl.float32)
    base_k = bh * Tp * K
    base_v = bh * Tp * V
    for i in range(0, NC):
        n = NC - 1 - i
        t0 = n * L
        tl.store(dH + (bh * NC + n) * K * V + ph, dh)
        pk = base_k + (t0 + rows)[:, None] * K + kr[None, :]
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
        do = tl.load(dO + pv).to(tl.float32)
        dv2 = tl.dot(tl.load(Ad + pk), dh, input_precision=PREC)
        dv2 += tl.dot(tl.trans(tl.load(Aqa + pa)), do, input_precision=PREC)
        tl.store(dV2 + pv, dv2)
        dh = tl.load(eGl + (bh * NC + n) * K + kr)[:, None] * dh
        dh += tl.dot(tl.trans(tl.load(Qg + pk)), do, input_precision=PREC)
        dh -= tl.dot(tl.trans(tl.load(W + pk)), dv2, input_precision=PREC)
    tl.store(dh0 + bh * K * V + ph, dh)


@triton.jit
def _fwd_state_kh(Qg, Kd, Ad, eGl, v, Aqk, Aqa, W, Cm, h0, Hs, V2, O, hT, Tp, NC,
                  K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
                  HAS_H0: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr):
    """_fwd_state with the state held as two [K/2, BV] halves (and every [L, K] operand loaded
    as two [L, K/2] halves): the same sums with half the live set per product, where the 3-pass
    TF32 split copies of the operands are what spills (ptxas, K = V = 128, L = 64, BV 32, 8 warps:
    1.3 KB/thread for _fwd_state, 0.7 KB here; benchmarks/NOTES-dplr.md)."""
    KH: tl.constexpr = K // 2
    vt_id = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, L)
    k1 = tl.arange(0, KH)
    k2 = KH + tl.arange(0, KH)
    vv = vt_id * BV + tl.arange(0, BV)
    ph1 = k1[:, None] * V + vv[None, :]
    ph2 = k2[:, None] * V + vv[None, :]
    if HAS_H0:
        h1 = tl.load(h0 + bh * K * V + ph1).to(tl.float32)
        h2 = tl.load(h0 + bh * K * V + ph2).to(tl.float32)
    else:
        h1 = tl.zeros([KH, BV], dtype=tl.float32)
        h2 = tl.zeros([KH, BV], dtype=tl.float32)
    base_k = bh * Tp * K
    base_v = bh * Tp * V
    for n in range(0, NC):
        t0 = n * L
        hs = Hs + (bh * NC + n) * K * V
        tl.store(hs + ph1, h1)
        tl.store(hs + ph2, h2)
        pk1 = base_k + (t0 + rows)[:, None] * K + k1[None, :]
        pk2 = base_k + (t0 + rows)[:, None] * K + k2[None, :]
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
        vt = tl.load(v + pv).to(tl.float32)
        v2 = tl.load(Cm + pv) - tl.dot(tl.load(W + pk1), h1, input_precision=PREC)
        v2 -= tl.dot(tl.load(W + pk2), h2, input_precision=PREC)
        tl.store(V2 + pv, v2)
        o = _mm(tl.load(Qg + pk1), h1, LO, PREC)
        o += _mm(tl.load(Qg + pk2), h2, LO, PREC)
        o += _mm(tl.load(Aqk + pa), vt, LO, PREC)
        o += _mm(tl.load(Aqa + pa), v2, LO, PREC)
        tl.store(O + pv, o)
        eg = eGl + (bh * NC + n) * K
        h1 = tl.load(eg + k1)[:, None] * h1
        h1 += tl.dot(tl.trans(tl.load(Kd + pk1)), vt, input_precision=PREC)
        h1 += tl.dot(tl.trans(tl.load(Ad + pk1)), v2, input_precision=PREC)
        h2 = tl.load(eg + k2)[:, None] * h2
        h2 += tl.dot(tl.trans(tl.load(Kd + pk2)), vt, input_precision=PREC)
        h2 += tl.dot(tl.trans(tl.load(Ad + pk2)), v2, input_precision=PREC)
    tl.store(hT + bh * K * V + ph1, h1)
    tl.store(hT + bh * K * V + ph2, h2)


@triton.jit
def _bwd_state_kh(Qg, Ad, eGl, Aqa, W, dO, dhT, dH, dV2, dh0, Tp, NC,
                  K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BV: tl.constexpr,
                  HAS_DHT: tl.constexpr, PREC: tl.constexpr):
    """_bwd_state with δh held as two [K/2, BV] halves (see _fwd_state_kh for why)."""
    KH: tl.constexpr = K // 2
    vt_id = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.arange(0, L)
    k1 = tl.arange(0, KH)
    k2 = KH + tl.arange(0, KH)
    vv = vt_id * BV + tl.arange(0, BV)
    ph1 = k1[:, None] * V + vv[None, :]
    ph2 = k2[:, None] * V + vv[None, :]
    if HAS_DHT:
        dh1 = tl.load(dhT + bh * K * V + ph1).to(tl.float32)
        dh2 = tl.load(dhT + bh * K * V + ph2).to(tl.float32)
    else:
        dh1 = tl.zeros([KH, BV], dtype=tl.float32)
        dh2 = tl.zeros([KH, BV], dtype=tl.float32)
    base_k = bh * Tp * K
    base_v = bh * Tp * V
    for i in range(0, NC):
        n = NC - 1 - i
        t0 = n * L
        dhs = dH + (bh * NC + n) * K * V
        tl.store(dhs + ph1, dh1)
        tl.store(dhs + ph2, dh2)
        pk1 = base_k + (t0 + rows)[:, None] * K + k1[None, :]
        pk2 = base_k + (t0 + rows)[:, None] * K + k2[None, :]
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
        do = tl.load(dO + pv).to(tl.float32)
        dv2 = tl.dot(tl.load(Ad + pk1), dh1, input_precision=PREC)
        dv2 += tl.dot(tl.load(Ad + pk2), dh2, input_precision=PREC)
        dv2 += tl.dot(tl.trans(tl.load(Aqa + pa)), do, input_precision=PREC)
        tl.store(dV2 + pv, dv2)
        eg = eGl + (bh * NC + n) * K
        dh1 = tl.load(eg + k1)[:, None] * dh1
        dh1 += tl.dot(tl.trans(tl.load(Qg + pk1)), do, input_precision=PREC)
        dh1 -= tl.dot(tl.trans(tl.load(W + pk1)), dv2, input_precision=PREC)
        dh2 = tl.load(eg + k2)[:, None] * dh2
        dh2 += tl.dot(tl.trans(tl.load(Qg + pk2)), do, input_precision=PREC)
        dh2 -= tl.dot(tl.trans(tl.load(W + pk2)), dv2, input_precision=PREC)
    tl.store(dh0 + bh * K * V + ph1, dh1)
    tl.store(dh0 + bh * K * V + ph2, dh2)


@triton.jit
def _bwd_dv(Kd, v, Aqk, Abk, E, V2, dO, dH, dV2, GCb, dAqk, dAqa, dAbk, dAba, dv, dqk_d, dqa_d,
            Tp, NC, K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr):
    """Backward, V side of one chunk: δv, GC = Eᵀ δC, and the gradients of the four pair matrices
    (strictly lower parts to dA* [BH, NC, L, L]; the diagonals of δA_qk, δA_qa to dqk_d, dqa_d
    [BH, Tp]). With δW = −δC hᵀ (h entering the chunk), Eᵀ δW = −GC hᵀ and W h = Cm − V2, so
    δF = −(Eᵀ δW Wᵀ + GC Cmᵀ) collapses to δA_ba = −GC V2ᵀ: no K-sized product is needed here."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    t0 = n * L
    rows = tl.arange(0, L)
    base_k = bh * Tp * K
    base_v = bh * Tp * V
    pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
    Aqk_ = tl.load(Aqk + pa)
    Abk_ = tl.load(Abk + pa)
    Em = tl.load(E + pa)
    dA_qk = tl.zeros([L, L], dtype=tl.float32)
    dA_qa = tl.zeros([L, L], dtype=tl.float32)
    dA_bk = tl.zeros([L, L], dtype=tl.float32)
    dA_ba = tl.zeros([L, L], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        do = tl.load(dO + pv).to(tl.float32)
        vt = tl.load(v + pv).to(tl.float32)
        v2 = tl.load(V2 + pv)
        GC = _mm(tl.trans(Em), tl.load(dV2 + pv), LO, PREC)   # Eᵀ δC
        tl.store(GCb + pv, GC)
        dvt = _mm(tl.trans(Aqk_), do, LO, PREC)
        dvt -= _mm(tl.trans(Abk_), GC, LO, PREC)
        for k0 in range(0, K, BK):                                # + (K ⊙ e^{G_L−G}) δh'
            kk = k0 + tl.arange(0, BK)
            pk = base_k + (t0 + rows)[:, None] * K + kk[None, :]
            dh = tl.load(dH + (bh * NC + n) * K * V + kk[:, None] * V + vv[None, :])
            dvt += _mm(tl.load(Kd + pk), dh, LO, PREC)
        tl.store(dv + pv, dvt)
        dA_qk += _mm(do, tl.trans(vt), LO, PREC)
        dA_qa += _mm(do, tl.trans(v2), LO, PREC)
        dA_bk -= _mm(GC, tl.trans(vt), LO, PREC)
        dA_ba -= _mm(GC, tl.trans(v2), LO, PREC)
    eye = rows[:, None] == rows[None, :]
    strict = rows[None, :] < rows[:, None]
    # the diagonal (i = r) of A_qk, A_qa has no decay: it goes straight into δq, δk, δa and stays
    # out of the gate gradient (where it would only cancel)
    tl.store(dqk_d + bh * Tp + t0 + rows, tl.sum(tl.where(eye, dA_qk, 0.0), axis=1))
    tl.store(dqa_d + bh * Tp + t0 + rows, tl.sum(tl.where(eye, dA_qa, 0.0), axis=1))
    tl.store(dAqk + pa, tl.where(strict, dA_qk, 0.0))
    tl.store(dAqa + pa, tl.where(strict, dA_qa, 0.0))
    tl.store(dAbk + pa, tl.where(strict, dA_bk, 0.0))
    tl.store(dAba + pa, tl.where(strict, dA_ba, 0.0))


@triton.jit
def _bwd_dk(q, k, v, a, b, G, V2, Hs, dO, dH, GCb, dAqk, dAqa, dAbk, dAba, dqk_d, dqa_d,
            dq, dk, da, db, dg, scale, Tp, NC,
            K: tl.constexpr, V: tl.constexpr, L: tl.constexpr, S: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, PREC: tl.constexpr, LO: tl.constexpr):
    """Backward, K side of one (chunk, K-tile): δq, δk, δa, δb and δgk for BK channels (every
    term is channel-wise in K once the pair-matrix gradients are known). Seed §三 with the
    notes' typos fixed; same formulas and gate-gradient grouping as chunkwise.py."""
    NB: tl.constexpr = L // S
    n = tl.program_id(0)
    kt = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    t0 = n * L
    rows = tl.arange(0, L)
    kr = kt * BK + tl.arange(0, BK)
    base_k = bh * Tp * K
    base_v = bh * Tp * V
    pk = base_k + (t0 + rows)[:, None] * K + kr[None, :]
    pa = ((bh * NC + n) * L + rows)[:, None] * L + rows[None, :]
    Gc = tl.load(G + pk)                                         # [L, BK] float64
    g_last = tl.load(G + base_k + (t0 + L - 1) * K + kr)
    eG = tl.exp(Gc.to(tl.float32))
    dec = tl.exp((g_last[None, :] - Gc).to(tl.float32))
    eGl = tl.exp(g_last.to(tl.float32))
    dKd = tl.zeros([L, BK], dtype=tl.float32)
    dAd = tl.zeros([L, BK], dtype=tl.float32)
    dQg = tl.zeros([L, BK], dtype=tl.float32)
    GW = tl.zeros([L, BK], dtype=tl.float32)                     # Eᵀ δW = −GC hᵀ = δB←
    hdh = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        vv = v0 + tl.arange(0, BV)
        pv = base_v + (t0 + rows)[:, None] * V + vv[None, :]
        ph = (bh * NC + n) * K * V + kr[:, None] * V + vv[None, :]
        hs = tl.load(Hs + ph)
        dh = tl.load(dH + ph)
        dKd += _mm(tl.load(v + pv).to(tl.float32), tl.trans(dh), LO, PREC)
        dAd += _mm(tl.load(V2 + pv), tl.trans(dh), LO, PREC)
        dQg += _mm(tl.load(dO + pv).to(tl.float32), tl.trans(hs), LO, PREC)
        GW -= _mm(tl.load(GCb + pv), tl.trans(hs), LO, PREC)
        hdh += tl.sum(hs * dh, axis=1)
    qs = tl.load(q + pk).to(tl.float32) * scale
    kx = tl.load(k + pk).to(tl.float32)
    ax = tl.load(a + pk).to(tl.float32)
    bx = tl.load(b + pk).to(tl.float32)
    dXq = tl.zeros([L, BK], dtype=tl.float32)
    dXb = tl.zeros([L, BK], dtype=tl.float32)
    dYk = tl.zeros([L, BK], dtype=tl.float32)
    dYa = tl.zeros([L, BK], dtype=tl.float32)
    cols = tl.arange(0, S)
    # Pair matrices, column sub-chunk by sub-chunk with the forward's reference points (module
    # docstring): rows below J use G_end(J), rows inside J use G_mid(J); δA is read one [L, S]
    # column block at a time and split by rows, which keeps the e^{80}-sized right factors away
    # from rows where they are not cancelled. δY of the rows of J is complete after block J; it
    # is placed into the [L, BK] accumulator by a product with the 0/1 matrix P[r, s] = (r = j0+s)
    # (registers cannot be sliced).
    for jb in range(0, NB):
        j0 = jb * S
        ci = j0 + cols
        py = base_k + (t0 + ci)[:, None] * K + kr[None, :]                    # [S, BK]
        pd = ((bh * NC + n) * L + rows)[:, None] * L + ci[None, :]            # [L, S]
        g_end = tl.load(G + base_k + (t0 + j0 + S - 1) * K + kr)
        g_mid = tl.load(G + base_k + (t0 + j0 + S // 2 - 1) * K + kr)
        below = rows >= j0 + S
        inblk = (rows >= j0) & (rows < j0 + S)
        fx_off = tl.exp(tl.where(below[:, None], Gc - g_end[None, :], float("-inf")).to(tl.float32))
        fx_in = tl.exp(tl.where(inblk[:, None], Gc - g_mid[None, :], float("-inf")).to(tl.float32))
        Gy = tl.load(G + py)
        fy_off = tl.exp((g_end[None, :] - Gy).to(tl.float32))                 # [S, BK] ≤ 1
        fy_in = tl.exp((g_mid[None, :] - Gy).to(tl.float32))                  # [S, BK] ≤ e^{40}
        yk = tl.load(k + py).to(tl.float32)
        ya = tl.load(a + py).to(tl.float32)
        xq_off = qs * fx_off
        xq_in = qs * fx_in
        xb_off = bx * fx_off
        xb_in = bx * fx_in
        place = tl.where(rows[:, None] == ci[None, :], 1.0, 0.0)               # [L, S]
        # x = q: δA_qk (y = k) and δA_qa (y = a)
        d = tl.load(dAqk + pd)
        d_off = tl.where(below[:, None], d, 0.0)
        d_in = tl.where(inblk[:, None], d, 0.0)
        dXq += (fx_off * _mm(d_off, yk * fy_off, LO, PREC)
                + fx_in * _mm(d_in, yk * fy_in, LO, PREC))
        ck = (fy_off * _mm(tl.trans(d_off), xq_off, LO, PREC)
              + fy_in * _mm(tl.trans(d_in), xq_in, LO, PREC))
        d = tl.load(dAqa + pd)
        d_off = tl.where(below[:, None], d, 0.0)
        d_in = tl.where(inblk[:, None], d, 0.0)
        dXq += (fx_off * _mm(d_off, ya * fy_off, LO, PREC)
                + fx_in * _mm(d_in, ya * fy_in, LO, PREC))
        ca = (fy_off * _mm(tl.trans(d_off), xq_off, LO, PREC)
              + fy_in * _mm(tl.trans(d_in), xq_in, LO, PREC))
        # x = b: δA_bk (y = k) and δA_ba (y = a)
        d = tl.load(dAbk + pd)
        d_off = tl.where(below[:, None], d, 0.0)
        d_in = tl.where(inblk[:, None], d, 0.0)
        dXb += (fx_off * _mm(d_off, yk * fy_off, LO, PREC)
                + fx_in * _mm(d_in, yk * fy_in, LO, PREC))
        ck += (fy_off * _mm(tl.trans(d_off), xb_off, LO, PREC)
               + fy_in * _mm(tl.trans(d_in), xb_in, LO, PREC))
        d = tl.load(dAba + pd)
        d_off = tl.where(below[:, None], d, 0.0)
        d_in = tl.where(inblk[:, None], d, 0.0)
        dXb += (fx_off * _mm(d_off, ya * fy_off, LO, PREC)
                + fx_in * _mm(d_in, ya * fy_in, LO, PREC))
        ca += (fy_off * _mm(tl.trans(d_off), xb_off, LO, PREC)
               + fy_in * _mm(tl.trans(d_in), xb_in, LO, PREC))
        dYk += _mm(place, ck, LO, PREC)
        dYa += _mm(place, ca, LO, PREC)
    dqk = tl.load(dqk_d + bh * Tp + t0 + rows)
    dqa = tl.load(dqa_d + bh * Tp + t0 + rows)
    tl.store(dq + pk, (dQg * eG + dXq + dqk[:, None] * kx + dqa[:, None] * ax) * scale)
    tl.store(db + pk, GW * eG + dXb)                              # δB = δB← ⊙ Γ (+ pair terms)
    tl.store(dk + pk, dKd * dec + dYk + dqk[:, None] * qs)
    tl.store(da + pk, dAd * dec + dYa + dqa[:, None] * qs)
    # Gate gradient, grouped by which gk_j each factor contains (chunkwise.py explains why):
    # e^{G_r} factors → reverse cumsum; e^{G_L − G_r} → exclusive forward cumsum; pairs e^{G_r − G_i}
    # → +at r, −at i, reverse cumsum; Diag(γ_L) h → every row.
    up = qs * dXq + bx * dXb - kx * dYk - ax * dYa + (qs * eG) * dQg + (bx * eG) * GW
    down = kx * dec * dKd + ax * dec * dAd
    dgk = tl.cumsum(up, axis=0, reverse=True) + (tl.cumsum(down, axis=0) - down)
    dgk += (eGl * hdh)[None, :]
    tl.store(dg + pk, dgk)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


# Products whose results reach only bfloat16 outputs (o and every input gradient, when all inputs
# are bfloat16) may run at lower precision; the state path never does (module docstring,
# "Precision modes"). Two environment variables override the defaults per call, so one benchmark
# run can time the variants against each other:
#   XLSTM_DPLR_LOWP   "off", "tf32", "bf16" ("fp16": interpreter tests only)
#   XLSTM_DPLR_STATE  "<plain|kh>,<BV>,<warps>": the two sequential state kernels — whole-K state
#                     tile or two K/2 halves, V-tile, warps.
LOWP_DEFAULT = "tf32"
# by chunk size: at L = 32 the whole-K kernels on 16-column V-tiles have no spills (ptxas); at
# L = 64, 16-column tiles on 4 warps timed 4 % faster than 32 on 8 in two H200 calls (14.61 /
# 14.66 vs 15.25 / 15.24 ms fwd+bwd at (8, 2048, 16, 128, 128), same checks passed)
STATE_DEFAULT = {64: "plain,16,4", 32: "plain,16,4", 16: "plain,16,4"}
_LO_MODES = {"off": 0, "tf32": 1, "bf16": 2, "fp16": 3}


def _config(lowp_ok: bool, K: int, V: int, L: int) -> tuple:
    """(PREC of the state path, LO mode of the bf16-output products, (state kernels' kind, BV,
    warps))."""
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    # float32 operands at ~float32 accuracy (3-pass TF32); the interpreter only knows "ieee"
    prec = "ieee" if interp else "tf32x3"
    mode = os.environ.get("XLSTM_DPLR_LOWP", LOWP_DEFAULT) if lowp_ok else "off"
    if mode not in _LO_MODES:
        raise ValueError(f"XLSTM_DPLR_LOWP must be one of {sorted(_LO_MODES)}, got {mode!r}")
    lo = _LO_MODES[mode]
    if interp and lo == 1:
        lo = 0
    spec = os.environ.get("XLSTM_DPLR_STATE", STATE_DEFAULT[L])
    try:
        kind, bv, warps = spec.split(",")
        bv, warps = int(bv), int(warps)
        if kind not in ("plain", "kh") or bv < 16 or bv & (bv - 1) or warps not in (4, 8):
            raise ValueError
    except ValueError:
        raise ValueError("XLSTM_DPLR_STATE must be '<plain|kh>,<BV: power of two >= 16>,<4|8>', "
                         f"got {spec!r}") from None
    # larger V-tiles at K = 256 would not fit the shared memory of one block (NOTES-dplr.md)
    bv = min(bv, V, 32 if K > 128 else 64)
    if K < 32:
        kind = "plain"    # K/2 halves below 16 are too narrow for a tensor-core product
    return prec, lo, (kind, bv, warps)


def _fwd(qc, kc, vc, ac, bc, G, h0, scale, L, cfg, o_dtype):
    """qc, kc, ac, bc: [BH, Tp, K]; vc: [BH, Tp, V]; G: [BH, Tp, K] float64; h0: [BH, K, V] or None;
    cfg from _config. Returns dict of O [BH, Tp, V] (o_dtype), hT [BH, K, V] and what the backward
    needs."""
    BH, Tp, K = qc.shape
    V = vc.shape[-1]
    NC = Tp // L
    dev = qc.device
    f32 = torch.float32
    prec, lo, (kind, BVs, wst) = cfg
    Aqk, Aqa, Abk, Aba, E = (torch.empty(BH, NC, L, L, device=dev, dtype=f32) for _ in range(5))
    W, Qg, Kd, Ad = (torch.empty(BH, Tp, K, device=dev, dtype=f32) for _ in range(4))
    eGl = torch.empty(BH, NC, K, device=dev, dtype=f32)
    Cm, V2 = (torch.empty(BH, Tp, V, device=dev, dtype=f32) for _ in range(2))
    O = torch.empty(BH, Tp, V, device=dev, dtype=o_dtype)
    Hs = torch.empty(BH, NC, K, V, device=dev, dtype=f32)
    hT = torch.empty(BH, K, V, device=dev, dtype=f32)
    _fwd_pairs[(NC * (L // SUB), BH)](qc, kc, ac, bc, G, Aqk, Aqa, Abk, Aba, scale, Tp, NC,
                                      K=K, L=L, S=SUB, BK=min(K, 32), PREC=prec, LO=lo,
                                      num_warps=8 if L <= 32 else 4, num_stages=1)
    _fwd_wy[(NC, BH)](qc, kc, ac, bc, vc, G, Abk, Aba, E, W, Cm, Qg, Kd, Ad, eGl, scale, Tp, NC,
                      K=K, V=V, L=L, S=SUB, BK=min(K, 32), BV=min(V, 32), PREC=prec,
                      **_launch("_fwd_wy"))
    fwd_state = _fwd_state_kh if kind == "kh" else _fwd_state
    fwd_state[(V // BVs, BH)](Qg, Kd, Ad, eGl, vc, Aqk, Aqa, W, Cm,
                              h0 if h0 is not None else hT, Hs, V2, O, hT, Tp, NC,
                              K=K, V=V, L=L, BV=BVs, HAS_H0=h0 is not None, PREC=prec, LO=lo,
                              num_warps=wst, num_stages=1)
    return dict(O=O, hT=hT, Aqk=Aqk, Aqa=Aqa, Abk=Abk, E=E, W=W, V2=V2, Hs=Hs, Qg=Qg, Kd=Kd, Ad=Ad, eGl=eGl)


def _bwd(qc, kc, vc, ac, bc, G, r, dO, dhT, scale, L, cfg, g_dtypes):
    """Backward launcher: dO [BH, Tp, V] (any float dtype), dhT [BH, K, V] or None; r from _fwd;
    g_dtypes: dtypes of dq, dk, dv, da, db, dgk. Returns those (chunk layout) and dh0 [BH, K, V]
    float32."""
    BH, Tp, K = qc.shape
    V = vc.shape[-1]
    NC = Tp // L
    dev = qc.device
    f32 = torch.float32
    prec, lo, (kind, BVs, wst) = cfg
    dH = torch.empty(BH, NC, K, V, device=dev, dtype=f32)
    dV2 = torch.empty(BH, Tp, V, device=dev, dtype=f32)
    dh0 = torch.empty(BH, K, V, device=dev, dtype=f32)
    bwd_state = _bwd_state_kh if kind == "kh" else _bwd_state
    bwd_state[(V // BVs, BH)](r["Qg"], r["Ad"], r["eGl"], r["Aqa"], r["W"], dO,
                              dhT if dhT is not None else dh0, dH, dV2, dh0, Tp, NC, K=K, V=V, L=L,
                              BV=BVs, HAS_DHT=dhT is not None, PREC=prec, num_warps=wst,
                              num_stages=1)
    GC = torch.empty(BH, Tp, V, device=dev, dtype=f32)
    dA = [torch.empty(BH, NC, L, L, device=dev, dtype=f32) for _ in range(4)]
    dqk_d, dqa_d = (torch.empty(BH, Tp, device=dev, dtype=f32) for _ in range(2))
    dt_q, dt_k, dt_v, dt_a, dt_b, dt_g = g_dtypes
    dv = torch.empty(BH, Tp, V, device=dev, dtype=dt_v)
    BK, BV = min(K, 64), min(V, 32)
    _bwd_dv[(NC, BH)](r["Kd"], vc, r["Aqk"], r["Abk"], r["E"], r["V2"], dO, dH, dV2, GC, *dA, dv,
                      dqk_d, dqa_d, Tp, NC, K=K, V=V, L=L, BK=BK, BV=BV, PREC=prec, LO=lo,
                      **_launch("_bwd_dv"))
    dq, dk, da, db, dg = (torch.empty(BH, Tp, K, device=dev, dtype=dt)
                          for dt in (dt_q, dt_k, dt_a, dt_b, dt_g))
    BK = min(K, 64 if L <= 32 else 32)   # ptxas at L = 32: BK 64 spills 124 B/thread, BK 32 2.2 KB
    _bwd_dk[(NC, K // BK, BH)](qc, kc, vc, ac, bc, G, r["V2"], r["Hs"], dO, dH, GC, *dA, dqk_d, dqa_d,
                               dq, dk, da, db, dg, scale, Tp, NC, K=K, V=V, L=L, S=SUB, BK=BK,
                               BV=BV, PREC=prec, LO=lo, **_launch("_bwd_dk"))
    return dq, dk, dv, da, db, dg, dh0


def _chunk_layout(x: torch.Tensor, Tp: int) -> torch.Tensor:
    """[B, T, H, D] → contiguous [B·H, Tp, D], zero-padded at the end of time."""
    B, T, H, D = x.shape
    x = x.transpose(1, 2)
    if Tp != T:
        x = nnf.pad(x, (0, 0, 0, Tp - T))
    return x.reshape(B * H, Tp, D).contiguous()


def _seq_layout(x: torch.Tensor, B: int, H: int, T: int, dtype) -> torch.Tensor:
    """[B·H, Tp, D] → [B, T, H, D] in `dtype` (inverse of _chunk_layout)."""
    _, Tp, D = x.shape
    return x.view(B, H, Tp, D)[:, :, :T].transpose(1, 2).to(dtype)


def _log_gamma(gk: torch.Tensor, Tp: int, L: int) -> torch.Tensor:
    """In-chunk inclusive cumsum of gk in float64: [B, T, H, K] → [B·H, Tp, K]; padded steps have
    gk = 0 (identity transitions)."""
    g = _chunk_layout(gk, Tp)          # moved in gk's own dtype, widened only by the cumsum
    BH, _, K = g.shape
    return g.view(BH, Tp // L, L, K).cumsum(2, dtype=torch.float64).view(BH, Tp, K)


def supports(op: str, *, K: int, V: int, chunk_size: int, dtype: torch.dtype, **_) -> str | None:
    """backend.choose_backend's question: K, V powers of two in [16, 256], chunk_size 16/32/64,
    not float64."""
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"the Triton DPLR kernels need {name} a power of two in [16, 256], got {d}"
    if chunk_size not in (16, 32, 64):
        return f"the Triton DPLR kernels need chunk_size in (16, 32, 64), got {chunk_size}"
    if dtype == torch.float64:
        return "the Triton DPLR kernels compute in float32; use backend='torch' for float64"
    return None


def _check_triton_shapes(K: int, V: int, chunk_size: int) -> int:
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(f"the Triton DPLR kernels need {name} a power of two in [16, 256], got {d}")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"the Triton DPLR kernels need chunk_size in (16, 32, 64), got {chunk_size}")
    return chunk_size


# ----------------------------------------------------------------------------------------------
# autograd
# ----------------------------------------------------------------------------------------------


class _DPLRTriton(torch.autograd.Function):
    """q, k, v, a, b, gk: [B, T, H, ·] (any float dtype); h0: [B, H, K, V] or None.
    Returns (o [B, T, H, V] in q's dtype, h_T [B, H, K, V] float32)."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, gk, h0, scale, L, lowp_ok):
        B, T, H, K = q.shape
        V = v.shape[-1]
        Tp = math.ceil(T / L) * L
        cfg = _config(lowp_ok, K, V, L)
        qc, kc, vc, ac, bc = (_chunk_layout(x, Tp) for x in (q, k, v, a, b))
        G = _log_gamma(gk, Tp, L)
        h0c = None if h0 is None else h0.to(torch.float32).reshape(B * H, K, V).contiguous()
        r = _fwd(qc, kc, vc, ac, bc, G, h0c, scale, L, cfg, q.dtype)
        o = _seq_layout(r.pop("O"), B, H, T, q.dtype)
        hT = r.pop("hT").view(B, H, K, V)
        # scratch kept for the backward (pair matrices, E, W, Cm, V2, chunk states): the backward
        # re-runs none of the forward kernels
        ctx.save_for_backward(qc, kc, vc, ac, bc, G, *(r[n] for n in _SAVED))
        ctx.meta = (B, T, H, scale, L, [x.dtype for x in (q, k, v, a, b, gk)],
                    None if h0 is None else h0.dtype, cfg)
        ctx.set_materialize_grads(False)
        return o, hT

    @staticmethod
    def backward(ctx, do, dhT):
        qc, kc, vc, ac, bc, G, *saved = ctx.saved_tensors
        B, T, H, scale, L, dts, h0_dtype, cfg = ctx.meta
        r = dict(zip(_SAVED, saved))
        Tp = qc.shape[1]
        K, V = qc.shape[-1], vc.shape[-1]
        dOc = (torch.zeros(B * H, Tp, V, device=qc.device, dtype=torch.float32) if do is None
               else _chunk_layout(do, Tp))       # the kernels widen it on load
        dhTc = None if dhT is None else dhT.to(torch.float32).reshape(B * H, K, V).contiguous()
        dq, dk, dv, da, db, dg, dh0 = _bwd(qc, kc, vc, ac, bc, G, r, dOc, dhTc, scale, L, cfg, dts)
        grads = [_seq_layout(g, B, H, T, dt) for g, dt in zip((dq, dk, dv, da, db, dg), dts)]
        dh0 = None if h0_dtype is None else dh0.view(B, H, K, V).to(h0_dtype)
        return (*grads, dh0, None, None, None)


_SAVED = ("Aqk", "Aqa", "Abk", "E", "W", "V2", "Hs", "Qg", "Kd", "Ad", "eGl")


def dplr_chunkwise_triton(q, k, v, a, b, gk, *, scale=None, initial_state=None,
                          output_final_state=False, chunk_size=64, _lowp_ok=None):
    """DPLR chunkwise with the Triton kernels above (forward and hand-written backward).

    S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ, α_t = exp(gk_t), o_t = S_t (scale·q_t).

    Args:
        q, k, a, b, gk: [B, T, H, K]; gk ≤ 0, safe down to −5 per step (module docstring).
        v: [B, T, H, V]. K, V powers of two in [16, 256]; any T.
        scale: query scale, default 1/√K.
        initial_state: [B, H, K, V] (= Sᵀ of the seed) or None for zeros.
        chunk_size: 16, 32 or 64.
        _lowp_ok: internal (KDA, tests): whether o and the gradients end in bfloat16, which
            allows the low-precision products; default: all of q, k, v, a, b, gk are bfloat16.
    Returns:
        (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    B, T, H, K, V = check_dplr_inputs(q, k, v, a, b, gk, initial_state)
    check_chunk(chunk_size)
    L = _check_triton_shapes(K, V, chunk_size)
    scale = float(check_scale(scale, K))
    for name, x in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("gk", gk)):
        if x.dtype == torch.float64:
            # the kernels compute in float32: a float64 caller wants float64 accuracy
            raise ValueError(f"{name} is float64: the Triton DPLR kernels compute in float32; "
                             "use backend='torch' for float64")
    o, hT = _DPLRTriton.apply(q, k, v, a, b, gk, initial_state, scale, L,
                              _lowp_ok if _lowp_ok is not None else _all_bf16(q, k, v, a, b, gk))
    return o, (hT if output_final_state else None)


def _all_bf16(*xs) -> bool:
    # bf16 only: its own rounding (2^-8) dwarfs the single-pass TF32 operand rounding (2^-11);
    # float16 outputs are as fine as TF32 operands, so the 2x rule would not hold (module docstring)
    return all(x.dtype == torch.bfloat16 for x in xs)


def kda_chunkwise_triton(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         chunk_size=64):
    """KDA through the DPLR kernels: a = k, b = β k, v ← β v (seed "与KDA的关系"); gradients reach
    k, v, g and β through autograd of the substitution.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    check_kda_inputs(q, k, v, g, beta)
    # products formed in float32 so 16-bit inputs are rounded only once (as kda.py)
    kf, beta_ = k.float(), beta.float().unsqueeze(-1)
    o, hT = dplr_chunkwise_triton(q, kf, v.float() * beta_, kf, kf * beta_, g, scale=scale,
                                  initial_state=initial_state, output_final_state=output_final_state,
                                  chunk_size=chunk_size, _lowp_ok=_all_bf16(q, k, v, g, beta))
    return o, hT

