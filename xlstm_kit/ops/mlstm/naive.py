"""The mLSTM as the paper writes it: one step at a time (eqs. 19–27, stabilized as eq. 15).

This is the reference every other backend is tested against; autograd differentiates it,
including the stabilizer m (it matters through eps and through the returned state).
Inputs arrive already validated and in the compute dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def mlstm_step_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    C: torch.Tensor,
    n: torch.Tensor,
    m: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """q, k [B,H,K]; v [B,H,V]; i, f [B,H]; C [B,H,K,V], n [B,H,K], m [B,H] → h [B,H,V], (C, n, m)."""
    log_f = F.logsigmoid(f)
    m_new = torch.maximum(log_f + m, i)                      # stabilizer state
    i_act = torch.exp(i - m_new)                             # i'_t
    f_act = torch.exp(log_f + m - m_new)                     # f'_t
    C = f_act[..., None, None] * C + i_act[..., None, None] * (k[..., :, None] * v[..., None, :])
    n = f_act[..., None] * n + i_act[..., None] * k
    q_hat = q * q.shape[-1] ** -0.5
    num = torch.einsum("bhk,bhkv->bhv", q_hat, C)
    den = torch.maximum((n * q_hat).sum(-1).abs(), torch.exp(-m_new)) + eps
    return num / den[..., None], (C, n, m_new)


def mlstm_recurrent_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    eps: float,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H] → h [B,T,H,V], final (C, n, m); state None = zeros."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if state is None:
        C = q.new_zeros(B, H, K, V)
        n = q.new_zeros(B, H, K)
        m = q.new_zeros(B, H)
    else:
        C, n, m = state
    hs = []
    for t in range(T):
        h, (C, n, m) = mlstm_step_naive(q[:, t], k[:, t], v[:, t], i[:, t], f[:, t], C, n, m, eps)
        hs.append(h)
    return torch.stack(hs, dim=1), (C, n, m)
