"""Chunkwise-parallel mLSTM in PyTorch with a hand-written backward.

The sequence is cut into NC chunks of L steps (the last one padded with steps that leave the
state untouched: log f = 0, ĩ = −∞, q = k = v = 0). Every tensor is laid out chunk-major,
[NC, N = B·H, L, dim], so each chunk's slice is contiguous and every per-chunk product is one
batched matmul over all chunks at once; only the state recurrence between chunks is a loop.

Per chunk with entering state (C_c, n_c, m_c) and in-chunk cumulative log forget b_r:
    u_s    = ĩ_s − b_s                       (log weight of step s, up to the factor e^{b_r})
    mrow_r = max(m_c, max_{s≤r} u_s)          so m_r = b_r + mrow_r is the recurrent m_t exactly
    D'_rs  = exp(u_s − mrow_r) (s ≤ r),  β_r = exp(m_c − mrow_r),  floor_r = exp(−m_r)
    h_r    = (Σ_s D'_rs S_rs v_s + β_r C_cᵀq̂_r) / (max(|Σ_s D'_rs S_rs + β_r n_cᵀq̂_r|, floor_r) + eps)
and the chunk's end state, with mx_c = max(m_c, max_s u_s):
    m_{c+1} = g_c + mx_c,  C_{c+1} = exp(m_c − mx_c) C_c + Σ_s exp(u_s − mx_c) k_s v_sᵀ   (g_c = b_L).
Every weight's exponent is ≤ 0, so large gate pre-activations cannot overflow; only
exp(−m_t) grows, and it stays finite for ĩ ≥ −88 in float32 (beyond that h → 0, its limit).

Two intra-chunk paths compute the same thing. Factored (the usual one): D'_rs = w_s e_r with
w_s = exp(u_s − mx_c) ≤ 1 and e_r = exp(mx_c − mrow_r) ≥ 1, and β_r = α_c e_r with
α_c = exp(m_c − mx_c); so q̃ = q ⊙ e/√K and k̃ = k ⊙ w are formed inside the layout copies,
P = tril(q̃ k̃ᵀ), and row r reads q̃_rᵀ(α_c C_c): no L×L exponentials and nothing L×L to store
but P. It needs e_r far from overflow (`_can_factor`); chunks where ĩ − Σlog f rises steeply
(forget gates closing hard) take the exact path, which builds D' itself.

Backward. The chunk states are recomputed from the saved initial state (one batched matmul
and the same short loop), not stored. Gradients are taken with every stabilizer held fixed (the "main
path"); in unstabilized form the inputs enter only as q̂_t e^{B_t}, k_s e^{ĩ_s − B_s} (B the
global cumulative log forget) and the final state e^{B_T}(…), so the gate gradients need no
T×T or L×L reductions:
    δĩ_s = k_s·δk_s,   δB_t = q̂_t·δq̂_t − k_t·δk_t (+ <δC_T, C_T> + <δn_T, n_T> at t = T),
    δlog f_k = Σ_{t≥k} δB_t,   δm_0 = <δC_0, C_0> + <δn_0, n_0>.
Then the stabilizers' own influence is added: h_t depends on m_t through eps only
(∂h_t/∂m_t = −eps h_t/den_t) and the final state through C_T = e^{−m_T} C*_T; each δm is routed
to the term that realises the max (an ĩ_s, or the carried m_c, which passes it back a chunk).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._checks import backward_autocast_off


def _to_chunks(x: torch.Tensor, NC: int, L: int, dtype: torch.dtype, fill: float = 0.0,
               scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, H, *] → [NC, B·H, L, *] contiguous in `dtype`; steps past T hold `fill`.

    `scale` (a number, or per row [NC, B·H, L]) multiplies inside the same pass.
    """
    B, T, H = x.shape[:3]
    rest = tuple(x.shape[3:])
    out = torch.empty((NC, B, H, L) + rest, dtype=dtype, device=x.device)
    perm = (1, 0, 3, 2) + tuple(range(4, 4 + len(rest)))   # [B, n, L, H, *] ↔ [n, B, H, L, *]
    if isinstance(scale, torch.Tensor):
        scale = scale.view(NC, B, H, L, *([1] * len(rest)))
    nf, r = T // L, T % L  # not divmod: Dynamo cannot take a symbolic (dynamic) T there

    def put(dst, src, sc):
        src = src.permute(perm)
        # Inductor's functionalization mishandles out= into a strided view: plain ops there.
        if sc is not None and x.dtype == dtype and not torch.compiler.is_compiling():
            torch.mul(src, sc, out=dst)
        else:
            dst.copy_(src)
            if sc is not None:
                dst.mul_(sc)

    def part(sc, sl):
        return sc[sl] if isinstance(sc, torch.Tensor) else sc

    if nf:
        put(out[:nf], x[:, : nf * L].reshape((B, nf, L, H) + rest), part(scale, (slice(0, nf),)))
    if r:
        sl = (slice(nf, None), slice(None), slice(None), slice(0, r))
        put(out[nf:, :, :, :r], x[:, nf * L:].reshape((B, 1, r, H) + rest), part(scale, sl))
        out[nf:, :, :, r:].fill_(fill)
    return out.view((NC, B * H, L) + rest)


def _from_chunks(xc: torch.Tensor, B: int, T: int, H: int, dtype: torch.dtype,
                 scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """[NC, B·H, L, *] → [B, T, H, *] in `dtype` (padding dropped), optionally times `scale`
    (a number, or per row [NC, B·H, L]) in the same pass."""
    NC, _, L = xc.shape[:3]
    rest = tuple(xc.shape[3:])
    x5 = xc.view((NC, B, H, L) + rest)
    if isinstance(scale, torch.Tensor):
        scale = scale.view(NC, B, H, L, *([1] * len(rest))).permute(1, 0, 3, 2, *range(4, 4 + len(rest)))
    perm = (1, 0, 3, 2) + tuple(range(4, 4 + len(rest)))
    out = torch.empty((B, T, H) + rest, dtype=dtype, device=xc.device)
    nf, r = T // L, T % L  # not divmod: Dynamo cannot take a symbolic (dynamic) T there

    def put(dst, src, sc):
        if sc is not None and dst.dtype == src.dtype and not torch.compiler.is_compiling():
            torch.mul(src, sc, out=dst)
        else:
            dst.copy_(src if sc is None else src * sc)

    def part(sc, sl):
        return sc[sl] if isinstance(sc, torch.Tensor) else sc

    if nf:
        put(out[:, : nf * L].view((B, nf, L, H) + rest), x5[:nf].permute(perm), part(scale, (slice(None), slice(0, nf))))
    if r:
        sl = (slice(None), slice(nf, None), slice(0, r))
        put(out[:, nf * L:].view((B, 1, r, H) + rest), x5[nf:, :, :, :r].permute(perm), part(scale, sl))
    return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[NC, N, a, b] → [NC·N, a, b] (a view) for the 3-d in-place matmuls."""
    return x.reshape((-1,) + x.shape[2:])


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_d a[..., d] b[..., d] as a batched matmul, so that a ⊙ b is never materialised."""
    return (a[..., None, :] @ b[..., :, None])[..., 0, 0]


def _exp_floor(dtype: torch.dtype) -> float:
    """Exponents below this are clamped before exp: such weights sit next to a weight of 1 in
    every sum they enter, and exp runs several times slower on arguments that underflow."""
    return -700.0 if dtype == torch.float64 else -80.0


def _can_factor(lift: torch.Tensor) -> bool:
    """Whether D'_rs = exp(u_s − mx_c) · exp(mx_c − mrow_r) may be computed as that product.

    The column factor is ≤ 1; the row factor exp(lift) must stay far from overflow, and then
    the clamped column factor errs by less than e^−20 relative (e^−100 in float64). Ordinary
    gates lift by a few units per chunk; only steep in-chunk rises of ĩ − Σlog f (e.g. strongly
    closing forget gates) fail this and take the exact path.
    """
    if torch.compiler.is_compiling() or (lift.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False  # the exact path is always valid; a data-dependent branch would break the graph
    limit = 600.0 if lift.dtype == torch.float64 else 60.0
    return bool(lift.max() <= limit)


def _gates(ic: torch.Tensor, fc: torch.Tensor, m0: torch.Tensor):
    """ic, fc [NC, N, L]; m0 [N] → b, u, running max of u [NC, N, L], m at chunk starts [NC+1, N], mx [NC, N]."""
    b = F.logsigmoid(fc).cumsum(-1)                       # in-chunk cumulative log forget
    u = ic - b
    cm = u.cummax(-1)[0]
    amax = cm[..., -1]
    g = b[..., -1]
    NC = ic.shape[0]
    m_states = ic.new_empty((NC + 1,) + m0.shape)
    m_states[0] = m0
    # The stabilizer recursion is sequential but scalar per (batch, head): NC tiny ops.
    for c in range(NC):
        torch.add(g[c], torch.maximum(m_states[c], amax[c]), out=m_states[c + 1])
    mx = torch.maximum(m_states[:-1], amax)
    return b, u, cm, m_states, mx


def _chunk_states(kw, vc, alpha, C0, n0, decayed: bool):
    """The states entering each chunk, S [NC, N, K, V] and s [NC, N, K], and the final C_T, n_T.

    kw = k ⊙ w [NC, N, L, K]; C_{c+1} = α_c C_c + kwᵀ v. With `decayed`, S_c = α_c C_c (what the
    rows of the factored path read), else S_c = C_c.
    """
    NC = kw.shape[0]
    dC = kw.transpose(-1, -2) @ vc                        # every chunk's own part in one matmul
    dn = kw.sum(-2)
    S = torch.empty_like(dC)
    s = torch.empty_like(dn)
    C, n = C0, n0
    for c in range(NC):
        a = alpha[c]
        if decayed:
            torch.mul(C, a[:, None, None], out=S[c])
            torch.mul(n, a[:, None], out=s[c])
            C, n = dC[c].add_(S[c]), dn[c].add_(s[c])
        else:
            S[c] = C
            s[c] = n
            C, n = dC[c].addcmul_(C, a[:, None, None]), dn[c].addcmul_(n, a[:, None])
    return S, s, C, n


def _decay_matrix(u, mrow):
    """D'_rs = exp(u_s − mrow_r) for s ≤ r, else 0: [NC, N, L, L] (exact path)."""
    d = (u[..., None, :] - mrow[..., :, None]).clamp_(_exp_floor(u.dtype), 0.0).exp_()
    return d.tril_()


def _gate_grads(di, dB, dden, dm_T, final_inner, dm0, m_states, cm, u, sig_negf, eps):
    """Finish δĩ, δf̃ and δm_0 from the main-path di = k·δk, dB = q·δq − k·δk (module docstring)
    by adding the stabilizers' own influence. All per-row tensors are [NC, N, L]."""
    NC, N, L = u.shape
    # δm_t = eps·δden_t for every row, plus the final state's m_T.
    own = eps * dden
    own[NC - 1, :, L - 1] += dm_T - final_inner          # total ∂/∂m_T
    dB[NC - 1, :, L - 1] += final_inner
    dB += own                                              # m_r = b_r + mrow_r
    carry = m_states[:-1, :, None] >= cm                   # row max realised by the carried m_c
    arg = u.cummax(-1)[1]
    total = own.clone()
    fwd = torch.zeros_like(dm0)
    for c in range(NC - 1, -1, -1):
        # m_c is the m of the last row of chunk c−1: its δm joins that row's.
        total[c, :, L - 1] += fwd
        fwd = (total[c] * carry[c]).sum(-1)
    dm0 = dm0 + fwd
    routed = torch.where(carry, 0.0, total)                # to ĩ_s − b_s at the arg-max s
    di.scatter_add_(-1, arg, routed)
    dB.scatter_add_(-1, arg, -routed)
    # δlog f_k = Σ_{t ≥ k} δB_t over the whole sequence; summed in float64 because the terms
    # can cancel.
    dB64 = dB.double()
    within = dB64.flip(-1).cumsum(-1).flip(-1)
    chunk_tot = within[..., 0]
    later = chunk_tot.flip(0).cumsum(0).flip(0) - chunk_tot
    df = (within + later[..., None]).to(u.dtype) * sig_negf
    return di, df, dm0


class _MLSTMChunkwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, i, f, C0, n0, m0, eps, chunk_size, cd):
        B, T, H, K = q.shape
        V = v.shape[-1]
        N = B * H
        L = min(chunk_size, T)
        NC = math.ceil(T / L)
        scale = K ** -0.5
        ic = _to_chunks(i, NC, L, cd, fill=float("-inf"))  # padding: no input ...
        fc = _to_chunks(f, NC, L, cd, fill=float("inf"))    # ... and no forgetting
        has_state = C0 is not None
        if has_state:
            C0, n0, m0 = C0.reshape(N, K, V), n0.reshape(N, K), m0.reshape(N)
        else:
            C0, n0, m0 = ic.new_zeros(N, K, V), ic.new_zeros(N, K), ic.new_zeros(N)

        b, u, cm, m_states, mx = _gates(ic, fc, m0)
        lo = _exp_floor(cd)
        m_prev = m_states[:-1, :, None]                   # [NC, N, 1]
        mrow = torch.maximum(m_prev, cm)                  # m_r − b_r
        floor = torch.exp(-(b + mrow))                    # exp(−m_r)
        alpha = torch.exp((m_states[:-1] - mx).clamp_min(lo))     # carried state's decay per chunk
        w = torch.exp((u - mx[..., None]).clamp_min(lo))          # step s's weight in the end state
        lift = mx[..., None] - mrow                       # ≥ 0
        factored = _can_factor(lift)
        vc = _to_chunks(v, NC, L, cd)
        if factored:
            # D'_rs = w_s e_r with e_r = exp(lift_r): fold e (and 1/√K) into q and w into k
            # inside the layout copies; then P = tril(q̃ k̃ᵀ) and row r reads q̃_rᵀ(α_c C_c).
            e = torch.exp(lift)
            qc = _to_chunks(q, NC, L, cd, scale=e * scale)     # q̃
            kc = _to_chunks(k, NC, L, cd, scale=w)             # k̃ = k ⊙ w
            S_st, s_st, C_T, n_T = _chunk_states(kc, vc, alpha, C0, n0, decayed=True)
            P = (qc @ kc.transpose(-1, -2)).tril_()
            qs = qc
            aux = e
        else:
            qc = _to_chunks(q, NC, L, cd, scale=scale)         # q̂
            kc = _to_chunks(k, NC, L, cd)
            S_st, s_st, C_T, n_T = _chunk_states(kc * w[..., None], vc, alpha, C0, n0, decayed=False)
            beta = torch.exp((m_prev - mrow).clamp_min(lo))    # carried state's weight in row r
            aux = _decay_matrix(u, mrow)
            P = qc @ kc.transpose(-1, -2)
            P.mul_(aux)                                        # P = (q̂kᵀ) ⊙ D'
            qs = qc * beta[..., None]
        num = qs @ S_st                                   # carried state, then the chunk itself
        _flat(num).baddbmm_(_flat(P), _flat(vc))
        z = P.sum(-1) + (qs @ s_st[..., None])[..., 0]
        den = torch.maximum(z.abs(), floor) + eps
        h = _from_chunks(num, B, T, H, cd, scale=den.reciprocal())   # written in place of a copy
        zsign = torch.sign(z) * (z.abs() > floor)         # ∂den/∂z (0 where the floor is active)

        C_T, n_T = C_T.clone(), n_T.clone()
        # P (and D' or e) are O(T·L) like the inputs and cost a matmul and several passes to
        # rebuild; the chunk states (O(T·K·V/L)) are rebuilt instead.
        ctx.save_for_backward(qc, kc, vc, u, cm, m_states, mrow, alpha, w, den, zsign, h,
                              torch.sigmoid(-fc), C0, n0, C_T, n_T, P, aux)
        ctx.meta = (B, T, H, K, V, eps, has_state, factored, q.dtype, k.dtype, v.dtype, i.dtype, f.dtype)
        return h, C_T.view(B, H, K, V), n_T.view(B, H, K), m_states[NC].reshape(B, H)

    @staticmethod
    @backward_autocast_off
    def backward(ctx, dh, dC_T, dn_T, dm_T):
        (qc, kc, vc, u, cm, m_states, mrow, alpha, w, den, zsign, h, sig_negf, C0, n0, C_T, n_T,
         P, aux) = ctx.saved_tensors
        B, T, H, K, V, eps, has_state, factored, q_dt, k_dt, v_dt, i_dt, f_dt = ctx.meta
        NC, N, L = u.shape
        cd = qc.dtype
        scale = K ** -0.5

        # δnum = δh/den, δden = −<δh, h>/den, δz = δden ∂den/∂z (h is the output, [B, T, H, V]).
        dnum = _to_chunks(dh, NC, L, cd, scale=den.reciprocal())
        dden = -_to_chunks(_rowdot(dh.to(cd), h), NC, L, cd) / den
        dz = dden * zsign

        # Intra-chunk part: δP = δnum vᵀ + δz 1ᵀ; through P = tril(q̃k̃ᵀ) or (q̂kᵀ) ⊙ D'.
        dS = dnum @ vc.transpose(-1, -2)
        dS.add_(dz[..., None])
        if factored:
            dS.tril_()
        else:
            dS.mul_(aux)
        dv = P.transpose(-1, -2) @ dnum
        dq = dS @ kc
        dk = dS.transpose(-1, -2) @ qc
        del dS

        # The chunk states, recomputed rather than kept from the forward pass.
        if factored:
            S_st, s_st, _, _ = _chunk_states(kc, vc, alpha, C0, n0, decayed=True)
            dr, dzr = dnum, dz[..., None]                 # rows read q̃ᵀ S_c
        else:
            kw = kc * w[..., None]
            S_st, s_st, _, _ = _chunk_states(kw, vc, alpha, C0, n0, decayed=False)
            beta = torch.exp((m_states[:-1, :, None] - mrow).clamp_min(_exp_floor(cd)))
            dr, dzr = dnum.mul_(beta[..., None]), (dz * beta)[..., None]   # rows read β q̂ᵀ C_c
        _flat(dq).baddbmm_(_flat(dr), _flat(S_st.transpose(-1, -2)))
        _flat(dq).baddbmm_(_flat(dzr), _flat(s_st[:, :, None, :]))
        dC_all = torch.empty((NC + 1,) + C0.shape, dtype=cd, device=u.device)
        torch.matmul(qc.transpose(-1, -2), dr, out=dC_all[:-1])
        dn_all = torch.cat([(qc.transpose(-1, -2) @ dzr)[..., 0], dn_T.reshape(1, N, K).to(cd)])

        # State gradients backwards through the chunks. Exact path: δC_c = α_c δC_{c+1} + (rows
        # of chunk c); factored path, where rows read α_c C_c: δC_c = α_c (δC_{c+1} + rows).
        dC_all[NC] = dC_T.reshape(N, K, V)
        for c in range(NC - 1, -1, -1):
            a = alpha[c]
            if factored:
                dC_all[c].add_(dC_all[c + 1]).mul_(a[:, None, None])
                dn_all[c].add_(dn_all[c + 1]).mul_(a[:, None])
            else:
                dC_all[c].addcmul_(dC_all[c + 1], a[:, None, None])
                dn_all[c].addcmul_(dn_all[c + 1], a[:, None])

        # Steps → chunk-end state: C_{c+1} ∋ w_s k_s v_sᵀ, n_{c+1} ∋ w_s k_s (k̃ = k ⊙ w when factored).
        G, gn = dC_all[1:], dn_all[1:]
        if factored:
            _flat(dk).baddbmm_(_flat(vc), _flat(G.transpose(-1, -2)))
            dk.add_(gn[:, :, None, :])
            _flat(dv).baddbmm_(_flat(kc), _flat(G))
        else:
            _flat(dk).baddbmm_(_flat(vc * w[..., None]), _flat(G.transpose(-1, -2)))
            _flat(dk).baddbmm_(_flat(w[..., None]), _flat(gn[:, :, None, :]))
            _flat(dv).baddbmm_(_flat(kw), _flat(G))

        # Gate gradients: k·δk and q·δq are scale-free, so the q̃, k̃ forms give them directly.
        di = _rowdot(kc, dk)
        dB = _rowdot(qc, dq) - di
        final_inner = (dC_all[NC] * C_T).sum((-1, -2)) + (dn_all[NC] * n_T).sum(-1)
        dm0 = (dC_all[0] * C0).sum((-1, -2)) + (dn_all[0] * n0).sum(-1)
        di, df, dm0 = _gate_grads(di, dB, dden, dm_T.reshape(N).to(cd), final_inner, dm0,
                                  m_states, cm, u, sig_negf, eps)

        q_scale = aux * scale if factored else scale      # δq = δq̃ e/√K or δq̂/√K
        grads = (
            _from_chunks(dq, B, T, H, q_dt, scale=q_scale),
            _from_chunks(dk, B, T, H, k_dt, scale=w if factored else None),
            _from_chunks(dv, B, T, H, v_dt),
            _from_chunks(di, B, T, H, i_dt),
            _from_chunks(df, B, T, H, f_dt),
        )
        if has_state:
            state_grads = (dC_all[0].view(B, H, K, V), dn_all[0].view(B, H, K), dm0.view(B, H))
        else:
            state_grads = (None, None, None)
        return grads + state_grads + (None, None, None)


def mlstm_chunkwise_torch(q, k, v, i, f, C0=None, n0=None, m0=None, *, eps: float = 1e-6,
                          chunk_size: int = 64, dtype: torch.dtype = torch.float32):
    """q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H]; optional C0 [B,H,K,V], n0 [B,H,K], m0 [B,H]
    (all three or none, already in `dtype`) → h [B,T,H,V] in `dtype`, C_T, n_T, m_T in `dtype`.

    Inputs may be in any float dtype: they are cast to `dtype` inside the chunk layout copy.
    """
    return _MLSTMChunkwise.apply(q, k, v, i, f, C0, n0, m0, eps, chunk_size, dtype)
