"""Parallel (quadratic) mLSTM: forward of the xLSTM paper's (arXiv 2405.04517) appendix eqs. 71–86,
hand-written backward of its eqs. 87–105.

Two additions to the paper's text, both needed to compute exactly what the recurrent reference
computes (docs/design.md, "mLSTM" and "Stabilisation"):

* The zero initial state has stabilizer m_0 = 0, so row t of the stabilizer also sees the
  column "log F_{t,0} + m_0" = Σ_{k≤t} log f_k (a state with no content). It only moves m, and
  m only matters through eps, but without it the op would differ from the recurrent one by
  up to eps relative wherever every ĩ_s is below Σ log f.
* n = max(|b|, exp(-m)) + eps. With eps the output depends on m: ∂h_t/∂m_t = -eps h_t / n_t,
  i.e. δm_t = eps δn_t, routed to the entry of D̃ that realises the row maximum. The paper's
  "gradients for m cancel" holds for eps = 0 only.

Also note eq. 90: the paper's sign(n) must read sign(b) (n > 0 always).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import backward_autocast_off


def _gate_matrix(ig: torch.Tensor, fg: torch.Tensor):
    """ig, fg [B,H,T] → log-forget cumsum [B,H,T], D̃ [B,H,T,T] (−inf above the diagonal), m [B,H,T],
    and whether the zero-state column realises the row max [B,H,T]."""
    T = ig.shape[-1]
    cum_logf = F.logsigmoid(fg).cumsum(-1)                                # log F_{t,0}
    d_tilde = cum_logf[..., :, None] - cum_logf[..., None, :] + ig[..., None, :]   # eq. 74
    causal = torch.ones(T, T, dtype=torch.bool, device=ig.device).tril()
    d_tilde = d_tilde.masked_fill(~causal, float("-inf"))
    row_max = d_tilde.amax(-1)
    m = torch.maximum(row_max, cum_logf)                                  # eq. 80 + zero-state column
    return cum_logf, d_tilde, m, cum_logf >= row_max


class _MLSTMParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, i, f, eps):
        # [B,T,H,*] → [B,H,T,*]: one head's sequence is one matrix for the T×T products.
        Q, Kt, V = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        ig, fg = i.transpose(1, 2), f.transpose(1, 2)
        scale = Q.shape[-1] ** -0.5
        _, d_tilde, m, _ = _gate_matrix(ig, fg)
        d_prime = torch.exp(d_tilde - m[..., None])                       # eq. 81
        s = (Q @ Kt.transpose(-1, -2)) * scale                            # QKᵀ/√d
        c_tilde = s * d_prime                                             # eq. 82
        b = c_tilde.sum(-1)                                               # eq. 83
        n = torch.maximum(b.abs(), torch.exp(-m)) + eps                   # eq. 84 (+ eps)
        h = (c_tilde / n[..., None]) @ V                                  # eqs. 85–86
        ctx.save_for_backward(Q, Kt, V, ig, fg, b, n)
        ctx.eps = eps
        return h.transpose(1, 2)

    @staticmethod
    @backward_autocast_off
    def backward(ctx, dh):
        Q, Kt, V, ig, fg, b, n = ctx.saved_tensors
        eps = ctx.eps
        scale = Q.shape[-1] ** -0.5
        dH = dh.transpose(1, 2)
        cum_logf, d_tilde, m, zero_col = _gate_matrix(ig, fg)
        d_prime = torch.exp(d_tilde - m[..., None])
        s = (Q @ Kt.transpose(-1, -2)) * scale
        c_mat = s * d_prime / n[..., None]                                # C of eq. 85

        dC = dH @ V.transpose(-1, -2)                                     # eq. 87
        # eq. 89, written as −((C̃'/n) ⊙ δC)1 / n so that n² never underflows
        dn = -(c_mat * dC).sum(-1) / n
        db = torch.sign(b) * dn * (b.abs() > torch.exp(-m))               # eq. 90 (sign of b)
        dCt = dC / n[..., None] + db[..., None]                           # eqs. 91–93
        dDt_pre = d_prime * dCt                                           # D' ⊙ δC̃' (eqs. 98–99)
        dD_tilde = s * dDt_pre                                            # eqs. 94–95

        # Stabilizer path (see module docstring): δm_t = eps δn_t to the arg-max of row t.
        dm = eps * dn
        arg = d_tilde.argmax(-1, keepdim=True)
        dD_tilde = dD_tilde.scatter_add(-1, arg, torch.where(zero_col, 0.0, dm)[..., None])
        d_cum_zero = torch.where(zero_col, dm, 0.0)

        dQ = (dDt_pre @ Kt) * scale                                       # eq. 98
        dK = (dDt_pre.transpose(-1, -2) @ Q) * scale                      # eq. 99
        dV = c_mat.transpose(-1, -2) @ dH                                 # eq. 100

        # eqs. 96–97: δF̄ = δI = δD̃. eq. 102, δf̄_k = Σ_{j<k} Σ_{i≥k} δF̄_ij, equals the reverse
        # cumulative sum of (row sums − column sums) since F̄_ij = B_i − B_j with B = cumsum(log f);
        # the zero-state column (j = 0 < k for every k) adds to the row sums only.
        row = dD_tilde.sum(-1) + d_cum_zero
        col = dD_tilde.sum(-2)
        d_logf = (row - col).flip(-1).cumsum(-1).flip(-1)                 # eq. 102
        df = torch.sigmoid(-fg) * d_logf                                  # eqs. 103–104
        di = col                                                          # eq. 105
        return (dQ.transpose(1, 2), dK.transpose(1, 2), dV.transpose(1, 2),
                di.transpose(1, 2), df.transpose(1, 2), None)


def mlstm_parallel_torch(q, k, v, i, f, eps: float) -> torch.Tensor:
    """q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H] (compute dtype) → h [B,T,H,V]."""
    return _MLSTMParallel.apply(q, k, v, i, f, eps)
