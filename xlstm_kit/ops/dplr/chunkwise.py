"""DPLR chunkwise in PyTorch: the chunkwise WY algorithm (docs/design.md, "DPLR and KDA"; the WY
form of DeltaNet's chunkwise algorithm, Yang et al. 2024, arXiv 2406.06484) with its hand-written
backward, as one ``torch.autograd.Function``.

Notation. The sequence is cut into chunks of L steps; ``Cm`` is the chunk's matrix U of
docs/design.md. Inside a chunk, with the state stored transposed (h = Sᵀ ∈ R^{K×V}) and G the
inclusive cumulative sum of gk over the chunk (log Γ):

    pair matrices   A_xy[r, i] = Σ_k x_r[k] y_i[k] exp(G_r[k] − G_i[k])   for i ≤ r (i < r for x=b)
                    i.e. A_qk = Q←K→ᵀ⊙M, A_qa = Q←A→ᵀ⊙M, A_bk = B←K→ᵀ⊙M₋₁, A_ba = B←A→ᵀ⊙M₋₁
    WY              F = I + A_ba,  E = F⁻¹,  W = E B←,  Cm = −E (A_bk V)
    state passing   V2 = Cm − W h,  h' = Diag(γ_L) h + (K→Diag γ_L)ᵀ V + (A→Diag γ_L)ᵀ V2
    output          O = Q← h + A_qk V + A_qa V2

E is never formed: F is unit lower triangular, so W and Cm come from one forward substitution
(a triangular solve, LAPACK trsm) and the backward's Eᵀ(·) products from one back substitution.

Numerics. The plain Q← = Q⊙Γ, K→ = K⊘Γ factorisation overflows: with gk = −5 per step and
L = 64, 1/Γ reaches e^320. Every quantity above, however, only needs decays exp(G_r − G_i) with
i ≤ r (≤ 1), exp(G_r) (≤ 1) or exp(G_L − G_i) (≤ 1). So the pair matrices are built from
sub-chunks of S ≤ SUB_CHUNK (8) steps: a block of rows R strictly below a block of columns J uses the last
step of J as the reference point, (X_R ⊙ e^{G_R − ref}) (Y_J ⊙ e^{ref − G_J})ᵀ, both factors ≤ 1,
one matmul; a diagonal block uses the exact pairwise decays e^{G_r − G_i} ([S, S, K] per block,
masked before the exp so the upper triangle is e^{−inf} = 0). No factor ever exceeds 1, for any
gk ≤ 0 and any chunk size; the cost over plain matmuls is the L·S·K pairwise tensor.

Precision. G = cumsum(gk) is taken in float64 and only differences (G_r − G_i, G_L − G_r, all
small and accurate) are cast to the compute dtype before the exp: in float32 a chunk's G reaches
−320 at gk = −5, and differences of such numbers would cost 2e-5 relative on every decay.

Backward (with δB = δB← ⊙ Γ and δW = −δC h_{[t−1]}ᵀ, h_{[t−1]} the state *entering* the
chunk). Everything chunk-local is recomputed
from the saved inputs; only the states between chunks are carried sequentially. The gate gradient
is the identity δlogΓ = q⊙δq + b⊙δb − k⊙δk − a⊙δa + diag(h'ᵀδh') (last row), reverse-cumsummed,
regrouped so that no O(1) terms cancel (see the comment in `backward`): under strong decay the
true δgk is O(γ) and the plain identity would leave float32 noise of O(1e-7) in it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as nnf
from torch.autograd.function import once_differentiable

from .._checks import backward_autocast_off

from .naive import check_chunk, check_dplr_inputs, check_scale, compute_dtype

# Largest sub-chunk of the pair matrices. The diagonal blocks cost ~S·L·K elementwise work per
# chunk (exact pairwise decays), the off-diagonal blocks ~L²·K/S (rescaling before each matmul):
# S = 8 balances the two at L = 64 and measured fastest on CPU (S = 16 was 2.5× slower). Tests
# lower it to reach the off-diagonal path at tiny sizes.
SUB_CHUNK = 8


def _sub_chunk_size(L: int) -> int:
    """Largest divisor of L that is ≤ SUB_CHUNK, so sub-chunks tile the chunk exactly."""
    for s in range(min(SUB_CHUNK, L), 0, -1):
        if L % s == 0:
            return s
    return 1


class _PairDecay:
    """Decays exp(G_r − G_i), i ≤ r, of one chunk, split into sub-chunks of S steps.

    G: [..., L, K] cumulative log gates (float64). The pair products have a left operand X [..., L, m, K]
    (rows r: q and b) and a right operand Y [..., L, n, K] (columns i: k and a).
    """

    def __init__(self, G: torch.Tensor, s: int, dtype: torch.dtype):
        # G is float64 (see _intra_chunk); differences are taken there and only the small, accurate
        # differences are cast to the compute dtype before the exp.
        L = G.shape[-2]
        self.L, self.s, self.nb = L, s, L // s
        Gs = G.unflatten(-2, (self.nb, s))                       # [..., nb, S, K]
        diff = Gs.unsqueeze(-2) - Gs.unsqueeze(-3)               # [..., nb, S(r), S(i), K]
        keep = torch.ones(s, s, dtype=torch.bool, device=G.device).tril().unsqueeze(-1)
        # masked before the exp: above the diagonal G_r − G_i > 0 could overflow
        self.diag = diff.to(dtype).masked_fill(~keep, float("-inf")).exp()
        self.lo, self.hi = [], []
        for j in range(self.nb - 1):
            e = (j + 1) * s
            ref = G[..., e - 1 : e, :]                                       # last step of column block j
            self.lo.append((ref - G[..., e - s : e, :]).to(dtype).exp())     # [..., S, K]      ≤ 1
            self.hi.append((G[..., e:, :] - ref).to(dtype).exp())            # [..., L − e, K]  ≤ 1

    def _diag_blocks(self, A: torch.Tensor) -> torch.Tensor:
        """Writable view of the diagonal S×S blocks of A [..., L, m, L, n]: [..., S, m, S, n, nb]."""
        *batch, L, m, _, n = A.shape
        A6 = A.view(*batch, self.nb, self.s, m, self.nb, self.s, n)
        return torch.diagonal(A6, dim1=-6, dim2=-3)

    def _decayed_right(self, Y: torch.Tensor) -> torch.Tensor:
        """D[r,i] ⊙ Y_i for the diagonal blocks, [..., nb, S(r), S(i), n, K]; kept for the same Y
        because gram and left (backward) both need it."""
        if getattr(self, "_dy_of", None) is not Y:
            self._dy = self.diag.unsqueeze(-2) * Y.unflatten(-3, (self.nb, self.s)).unsqueeze(-4)
            self._dy_of = Y
        return self._dy

    def gram(self, X: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        """A[..., r, m, i, n] = Σ_k X[r,m,k] Y[i,n,k] e^{G_r[k] − G_i[k]} for i ≤ r, else 0."""
        *batch, L, m, K = X.shape
        n = Y.shape[-2]
        s, nb = self.s, self.nb
        A = X.new_zeros(*batch, L, m, L, n)
        Xs = X.unflatten(-3, (nb, s))                                  # [..., nb, S, m, K]
        DY = self._decayed_right(Y)                                    # [..., nb, S(r), S(i), n, K]
        blk = Xs @ DY.flatten(-3, -2).mT                               # [..., nb, S(r), m, S(i)·n]
        self._diag_blocks(A).copy_(blk.unflatten(-1, (s, n)).movedim(-5, -1))
        for j in range(nb - 1):
            e = (j + 1) * s
            Yl = Y[..., e - s : e, :, :] * self.lo[j].unsqueeze(-2)   # [..., S, n, K]
            Xh = X[..., e:, :, :] * self.hi[j].unsqueeze(-2)          # [..., L−e, m, K]
            blk = Xh.flatten(-3, -2) @ Yl.flatten(-3, -2).mT          # [..., (L−e)·m, S·n]
            A[..., e:, :, e - s : e, :] = blk.unflatten(-1, (s, n)).unflatten(-3, (L - e, m))
        return A

    def left(self, dA: torch.Tensor, Y: torch.Tensor) -> torch.Tensor:
        """δX[..., r, m, k] = Σ_{i,n} dA[r,m,i,n] Y[i,n,k] e^{G_r[k] − G_i[k]}   (dA lower triangular)."""
        *batch, L, m, _, n = dA.shape
        s, nb = self.s, self.nb
        dblk = self._diag_blocks(dA).movedim(-1, -5)                  # [..., nb, S(r), m, S(i), n]
        DY = self._decayed_right(Y)                                    # [..., nb, S(r), S(i), n, K]
        dX = (dblk.flatten(-2, -1) @ DY.flatten(-3, -2)).flatten(-4, -3)      # [..., L, m, K]
        for j in range(nb - 1):
            e = (j + 1) * s
            Yl = Y[..., e - s : e, :, :] * self.lo[j].unsqueeze(-2)   # [..., S, n, K]
            g = dA[..., e:, :, e - s : e, :].reshape(*batch, (L - e) * m, s * n)
            dX[..., e:, :, :] += (g @ Yl.flatten(-3, -2)).unflatten(-2, (L - e, m)) * self.hi[j].unsqueeze(-2)
        return dX

    def right(self, dA: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        """δY[..., i, n, k] = Σ_{r,m} dA[r,m,i,n] X[r,m,k] e^{G_r[k] − G_i[k]}   (dA lower triangular)."""
        *batch, L, m, _, n = dA.shape
        s, nb = self.s, self.nb
        dblk = self._diag_blocks(dA).movedim(-1, -5)                  # [..., nb, S(r), m, S(i), n]
        # built directly in (i, r) order so the product needs no transposed copy
        DX = self.diag.transpose(-3, -2).unsqueeze(-2) * X.unflatten(-3, (nb, s)).unsqueeze(-4)
        DX = DX.flatten(-3, -2)                                        # [..., nb, S(i), S(r)·m, K]
        g = dblk.permute(*range(len(batch) + 1), -2, -1, -4, -3).flatten(-2, -1)  # [..., nb, S(i), n, S(r)·m]
        dY = (g @ DX).flatten(-4, -3)                                  # [..., L, n, K]
        for j in range(nb - 1):
            e = (j + 1) * s
            Xh = X[..., e:, :, :] * self.hi[j].unsqueeze(-2)          # [..., L−e, m, K]
            g = dA[..., e:, :, e - s : e, :].reshape(*batch, (L - e) * m, s * n)
            dY[..., e - s : e, :, :] += (g.mT @ Xh.flatten(-3, -2)).unflatten(-2, (s, n)) * self.lo[j].unsqueeze(-2)
        return dY


def finite_log_gamma(G: torch.Tensor) -> torch.Tensor:
    """G [..., L, K] (in-chunk cumulative log gates, non-increasing) with its NaN entries, the
    steps from a NaN log-decay on, replaced by the chunk's last finite value (0 if none).

    Every product over the steps of a chunk (the pair matrices, W = E B←, V2, A_qa V2) takes this
    G: a NaN there would reach the earlier rows through the products' zero entries (0·NaN = NaN),
    i.e. travel backwards in time. Its replacement is a valid G (as if those log-decays were 0),
    so every factor keeps its bound. The NaN itself still reaches every output from its step on
    through Q← = Q ⊙ e^G and the state through γ_L = e^{G_L}, which take the G with the NaN."""
    nan = G.isnan()
    last = torch.where(nan, 0.0, G).amin(-2, keepdim=True)
    return torch.where(nan, last, G)


def _masks(L: int, dtype, device):
    incl = torch.ones(L, L, dtype=dtype, device=device).tril()       # M
    return incl, incl.tril(-1)                                       # M, M₋₁


def _intra_chunk(q, k, v, a, b, gk, s):
    """Everything that does not depend on the carried state, for all chunks at once.

    q, k, a, b, gk: [B,H,N,L,K] (q already scaled); v: [B,H,N,L,V].
    """
    L, K = q.shape[-2:]
    cd = q.dtype
    # log Γ in float64 even for float32 inputs: G reaches −320 in a chunk of 64 steps at gk = −5,
    # and a float32 difference G_r − G_i of two such numbers would carry an absolute error ~2e-5,
    # i.e. a 2e-5 relative error on every decay (the recurrence itself is exact to ~1e-7 per step).
    G = gk.to(torch.float64).cumsum(-2)                # [B,H,N,L,K], inclusive
    Gs = finite_log_gamma(G)
    eG = G.exp().to(cd)                                # γ_r            ≤ 1
    eGs = Gs.exp().to(cd)
    dec = (G[..., -1:, :] - G).exp().to(cd)            # γ_L / γ_r      ≤ 1
    eGl = eG[..., -1, :]                               # γ_L            [B,H,N,K]
    pd = _PairDecay(Gs, s, cd)
    X = torch.stack((q, b), -2)                        # [B,H,N,L,2,K]  rows: q, b
    Y = torch.stack((k, a), -2)                        # [B,H,N,L,2,K]  columns: k, a
    A = pd.gram(X, Y)                                  # [B,H,N,L,2,L,2]
    _, strict = _masks(L, q.dtype, q.device)
    A_qk, A_qa = A[..., :, 0, :, 0], A[..., :, 0, :, 1]
    A_bk, A_ba = A[..., :, 1, :, 0] * strict, A[..., :, 1, :, 1] * strict
    F = A_ba + torch.eye(L, dtype=q.dtype, device=q.device)
    Bg = b * eGs                                                          # B←
    rhs = torch.cat((Bg, -(A_bk @ v)), -1)                                # [B,H,N,L,K+V]
    W, Cm = torch.linalg.solve_triangular(F, rhs, upper=False, unitriangular=True).split([K, v.shape[-1]], -1)
    return dict(eG=eG, eGs=eGs, dec=dec, eGl=eGl, pd=pd, X=X, Y=Y, A_qk=A_qk, A_qa=A_qa, A_bk=A_bk,
                F=F, W=W, Cm=Cm, Qg=q * eG, Kd=k * dec, Ad=a * dec)


def _state_pass(h0, c, v):
    """Carry the state across chunks. Returns (states entering each chunk [B,H,N,K,V],
    V2 [B,H,N,L,V], final state [B,H,K,V])."""
    KV = c["Kd"].mT @ v                                # (K→Diag γ_L)ᵀ V, independent of h
    W, Cm, Ad, eGl = c["W"], c["Cm"], c["Ad"], c["eGl"]
    hs, V2s = [], []
    h = h0
    for n in range(W.shape[2]):
        hs.append(h)
        V2 = Cm[:, :, n] - W[:, :, n] @ h
        V2s.append(V2)
        h = eGl[:, :, n].unsqueeze(-1) * h + KV[:, :, n] + Ad[:, :, n].mT @ V2
    return torch.stack(hs, 2), torch.stack(V2s, 2), h


class _DPLRChunkwise(torch.autograd.Function):
    """Inputs already chunked: q, k, a, b, gk [B,H,N,L,K] (q scaled), v [B,H,N,L,V],
    h0 [B,H,K,V] or None; all in one compute dtype. Returns (o [B,H,N,L,V], h_T [B,H,K,V])."""

    @staticmethod
    def forward(ctx, q, k, v, a, b, gk, h0, s):
        B, H, N, L, K = q.shape
        h0_ = q.new_zeros(B, H, K, v.shape[-1]) if h0 is None else h0
        c = _intra_chunk(q, k, v, a, b, gk, s)
        hs, V2, hT = _state_pass(h0_, c, v)
        o = c["Qg"] @ hs + c["A_qk"] @ v + c["A_qa"] @ V2
        ctx.save_for_backward(q, k, v, a, b, gk, h0)
        ctx.s = s
        ctx.set_materialize_grads(False)
        return o, hT

    @staticmethod
    @backward_autocast_off
    @once_differentiable
    def backward(ctx, do, dhT):
        q, k, v, a, b, gk, h0 = ctx.saved_tensors
        B, H, N, L, K = q.shape
        Vd = v.shape[-1]
        h0_ = q.new_zeros(B, H, K, Vd) if h0 is None else h0
        c = _intra_chunk(q, k, v, a, b, gk, ctx.s)
        hs, V2, hT = _state_pass(h0_, c, v)
        if do is None:
            do = torch.zeros_like(v)
        dh = torch.zeros_like(hT) if dhT is None else dhT
        W, Cm, Ad, eGl = c["W"], c["Cm"], c["Ad"], c["eGl"]
        incl, strict = _masks(L, q.dtype, q.device)

        # Sequential part: δh flows backwards through the chunks. Per chunk:
        #   δV2 = δC = A→Diag(γ_L) δh' + (Q←A→ᵀ⊙M)ᵀ δO
        #   δh  = Diag(γ_L) δh' + Q←ᵀ δO − Wᵀ δV2          (V2 = C − W h)
        P = c["A_qa"].mT @ do                           # [B,H,N,L,V]
        QdO = c["Qg"].mT @ do                           # [B,H,N,K,V]
        dH, dV2 = [None] * N, [None] * N                # δ of the state leaving each chunk, δV2
        for n in range(N - 1, -1, -1):
            dH[n] = dh
            dV2[n] = Ad[:, :, n] @ dh + P[:, :, n]
            dh = eGl[:, :, n].unsqueeze(-1) * dh + QdO[:, :, n] - W[:, :, n].mT @ dV2[n]
        dh0 = dh
        dH, dV2 = torch.stack(dH, 2), torch.stack(dV2, 2)

        # Parallel part, all chunks at once.
        dv = c["Kd"] @ dH + c["A_qk"].mT @ do           # δV1
        dKd = v @ dH.mT                                 # δ(K→Diag γ_L)
        dAd = V2 @ dH.mT                                # δ(A→Diag γ_L)
        dQg = do @ hs.mT                                # δQ← from the inter-chunk term
        dW = -dV2 @ hs.mT                               # δW = −δC h_{[t−1]}ᵀ (state entering)
        # Eᵀ δW and Eᵀ δC by back substitution on Fᵀ (unit upper triangular)
        GW, GC = torch.linalg.solve_triangular(
            c["F"].mT, torch.cat((dW, dV2), -1), upper=True, unitriangular=True
        ).split([K, Vd], -1)
        dBg = GW                                        # δB← from W = E B←
        dA_bk = -(GC @ v.mT) * strict                   # C = −E (A_bk V)
        dv = dv - c["A_bk"].mT @ GC
        dA_ba = -(GW @ W.mT + GC @ Cm.mT) * strict      # δF = −Eᵀ δE Eᵀ, masked to M₋₁
        # The diagonal (i = r) of A_qk and A_qa carries no decay: its terms go straight into δq, δk,
        # δa and are kept out of the gate gradient, where they would only cancel (see below).
        dA_qk = (do @ v.mT) * incl
        dA_qa = (do @ V2.mT) * incl
        dqk_d = torch.diagonal(dA_qk, dim1=-2, dim2=-1).unsqueeze(-1)    # [B,H,N,L,1]
        dqa_d = torch.diagonal(dA_qa, dim1=-2, dim2=-1).unsqueeze(-1)
        dA = torch.stack((torch.stack((dA_qk * strict, dA_qa * strict), -1),
                          torch.stack((dA_bk, dA_ba), -1)), -3)          # [B,H,N,L,2,L,2]
        dX = c["pd"].left(dA, c["Y"])                   # δ(q, b) through the pair matrices, i < r
        dY = c["pd"].right(dA, c["X"])                  # δ(k, a) through the pair matrices, i < r

        eG, eGs, dec = c["eG"], c["eGs"], c["dec"]
        dq = dQg * eG + dX[..., 0, :] + dqk_d * k + dqa_d * a
        db = dBg * eGs + dX[..., 1, :]                  # δB = δB← ⊙ Γ (+ pair terms)
        dk = dKd * dec + dY[..., 0, :] + dqk_d * q
        da = dAd * dec + dY[..., 1, :] + dqa_d * q

        # Gate gradient. The identity δlogΓ = q⊙δq + b⊙δb − k⊙δk − a⊙δa (+ diag(h'ᵀδh') on the
        # last row), followed by a reverse cumulative sum, is exact but cancels O(1) terms down to
        # the O(γ) true value under strong decay. The same sum grouped by which gk_j each factor
        # contains loses nothing:
        #   q_r e^{G_r}, b_r e^{G_r}      contain gk_j for j ≤ r      → reverse cumulative sum
        #   k_r e^{G_L−G_r}, a_r e^{…}     contain gk_j for j > r      → exclusive cumulative sum
        #   Diag(γ_L) h                   contains every gk_j          → added to all rows
        #   pair i < r, e^{G_r−G_i}       contains gk_j for i < j ≤ r  → +at r, −at i, reverse sum
        up = q * dX[..., 0, :] + b * dX[..., 1, :] - k * dY[..., 0, :] - a * dY[..., 1, :]
        up = up + c["Qg"] * dQg + (b * eGs) * dBg
        down = c["Kd"] * dKd + c["Ad"] * dAd
        down = nnf.pad(down[..., :-1, :], (0, 0, 1, 0))                 # shift: rows r < j only
        dgk = up.flip(-2).cumsum(-2).flip(-2) + down.cumsum(-2)
        dgk = dgk + (eGl * (hs * dH).sum(-1)).unsqueeze(-2)
        return dq, dk, dv, da, db, dgk, (dh0 if h0 is not None else None), None


def _to_chunks(x: torch.Tensor, dtype, N: int, L: int) -> torch.Tensor:
    """[B,T,H,D] → [B,H,N,L,D], zero-padded at the end of time."""
    B, T, H, D = x.shape
    x = x.to(dtype).transpose(1, 2)                     # [B,H,T,D]
    if N * L != T:
        x = nnf.pad(x, (0, 0, 0, N * L - T))
    return x.reshape(B, H, N, L, D)


def dplr_chunkwise(q, k, v, a, b, gk, *, scale=None, initial_state=None, output_final_state=False,
                   chunk_size=64):
    """DPLR (gated generalized delta rule), chunkwise WY algorithm with a hand-written backward.

    S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ, α_t = exp(gk_t), o_t = S_t (scale·q_t).
    The gate-free form S_t = S_{t-1}(Diag(α_t) − d_t a_tᵀ) + v_t k_tᵀ is b_t = d_t / α_t.

    Args:
        q, k, a, b, gk: [B, T, H, K]; gk is the log decay (≤ 0, any magnitude; the public op
            clamps it there); a NaN at step t reaches the outputs from t on only.
        v: [B, T, H, V].
        scale: query scale, default 1/√K.
        initial_state: [B, H, K, V] (= Sᵀ, the transposed state of docs/design.md) or None for zeros.
        output_final_state: return the final state.
        chunk_size: steps per chunk (any T; the last chunk is padded with identity steps).
    Returns:
        (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 (float64 for float64
        inputs) or None).
    """
    B, T, H, K, V = check_dplr_inputs(q, k, v, a, b, gk, initial_state)
    check_chunk(chunk_size)
    scale = check_scale(scale, K)
    cd = compute_dtype(q, k, v, a, b, gk, initial_state)
    L = min(chunk_size, T)
    N = math.ceil(T / L)
    # padded steps have q = k = v = a = b = 0 and gk = 0: the identity transition, no output used
    qc, kc, vc, ac, bc, gc = (_to_chunks(x, cd, N, L) for x in (q.to(cd) * scale, k, v, a, b, gk))
    h0 = None if initial_state is None else initial_state.to(cd)
    o, hT = _DPLRChunkwise.apply(qc, kc, vc, ac, bc, gc, h0, _sub_chunk_size(L))
    o = o.reshape(B, H, N * L, V)[:, :, :T].transpose(1, 2).to(q.dtype)
    return o, (hT if output_final_state else None)
