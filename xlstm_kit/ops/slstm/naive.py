"""sLSTM reference: one step and a time loop in plain PyTorch, differentiated by autograd.

This is the slow reference every other sLSTM backend is tested against; it reads like the
paper's stabilized equations (xLSTM paper, arXiv 2405.04517, eqs. 8–17; docs/design.md,
"sLSTM"):

    g̃_t = x_gates[t, g] + h_{t-1} R_g + b_g          g in (i, f, z, o), R_g block-diagonal per head
    m_t  = max(log f_t + m_{t-1}, ĩ_t)                log f_t = logsigmoid(f̃_t) or f̃_t ("exp")
    i'_t = exp(ĩ_t − m_t),  f'_t = exp(log f_t + m_{t-1} − m_t)
    c_t  = f'_t c_{t-1} + i'_t tanh(z̃_t)
    n_t  = f'_t n_{t-1} + i'_t
    h_t  = σ(õ_t) ⊙ c_t / n_t

The default initial state is all zeros, m_0 = 0 included, so m_1 = max(log f_1, ĩ_1). (The
official xlstm cell instead sets m_1 = ĩ_1 when n_0 = 0; c, n and m then differ by a common
rescaling, while h = σ(õ) c/n — the only thing a layer sees — is identical.)

Shapes: x_gates [B, T, 4, H, D] (step: [B, 4, H, D]), r [4, H, D, D], b [4, H, D], every
state tensor (h, c, n, m) [B, H, D]. Arithmetic runs in float32 (float64 stays float64); the
returned h has the dtype of x_gates and the state is kept in the compute dtype.

Inputs are not validated here: the public wrappers in `xlstm_kit.ops.slstm` do that.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .._checks import compute_dtype

State = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]



def zero_state(batch: int, heads: int, dim: int, dtype: torch.dtype, device) -> State:
    """The default initial state (h, c, n, m), all zeros, each [B, H, D]."""
    return tuple(torch.zeros(batch, heads, dim, dtype=dtype, device=device) for _ in range(4))


def _cell(x_gates_t: torch.Tensor, r: torch.Tensor, b: torch.Tensor, state: State,
          forget_gate: str, h_rec: Optional[torch.Tensor] = None) -> State:
    """One stabilized sLSTM update in the compute dtype. x_gates_t [B, 4, H, D].

    `h_rec` is the copy of h_{t-1} that feeds the recurrent matmul (the loop passes a copy with
    a gradient hook on it to clip δh^R); it defaults to the state's h.
    """
    h, c, n, m = state
    if h_rec is None:
        h_rec = h
    # g̃ = x + h_{t-1} R_g + b, per head: [B,H,D] x [4,H,D,D] -> [B,4,H,D]
    pre = x_gates_t + torch.einsum("bhd,ghde->bghe", h_rec, r) + b
    i_pre, f_pre, z_pre, o_pre = pre.unbind(dim=1)
    log_f = F.logsigmoid(f_pre) if forget_gate == "sigmoid" else f_pre
    m_new = torch.maximum(log_f + m, i_pre)
    i_gate = torch.exp(i_pre - m_new)
    f_gate = torch.exp(log_f + m - m_new)
    c_new = f_gate * c + i_gate * torch.tanh(z_pre)
    n_new = f_gate * n + i_gate
    h_new = torch.sigmoid(o_pre) * c_new / n_new
    return h_new, c_new, n_new, m_new


def slstm_step_naive(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor,
                     state: Optional[State] = None, *, forget_gate: str = "sigmoid"
                     ) -> Tuple[torch.Tensor, State]:
    """One sLSTM step. x_gates [B, 4, H, D] -> (h [B, H, D], (h, c, n, m) each [B, H, D])."""
    batch, _, heads, dim = x_gates.shape
    dtype = compute_dtype(x_gates, r, b, *(state or ()))
    if state is None:
        state = zero_state(batch, heads, dim, dtype, x_gates.device)
    state = tuple(s.to(dtype) for s in state)
    new = _cell(x_gates.to(dtype), r.to(dtype), b.to(dtype), state, forget_gate)
    return new[0].to(x_gates.dtype), new


def slstm_recurrent_naive(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor, *,
                          initial_state: Optional[State] = None, output_final_state: bool = False,
                          forget_gate: str = "sigmoid",
                          recurrent_grad_clip: Optional[float] = None
                          ) -> Tuple[torch.Tensor, Optional[State]]:
    """Time loop over `_cell`. x_gates [B, T, 4, H, D] -> (h [B, T, H, D], final state or None).

    recurrent_grad_clip: clamp δh^R (the gradient reaching h_{t-1} through R, paper eq. 49) to
    ±clip before it joins the external gradient (eq. 41); implemented with a tensor hook, so the
    forward is unchanged. None leaves autograd's exact gradient.
    """
    batch, steps, _, heads, dim = x_gates.shape
    dtype = compute_dtype(x_gates, r, b, *(initial_state or ()))
    state = (zero_state(batch, heads, dim, dtype, x_gates.device) if initial_state is None
             else tuple(s.to(dtype) for s in initial_state))
    xg, r_c, b_c = x_gates.to(dtype), r.to(dtype), b.to(dtype)
    outs = []
    for t in range(steps):
        h_rec = None
        if recurrent_grad_clip is not None and state[0].requires_grad:
            # A separate node for the recurrent use of h_{t-1}: its gradient is exactly δh^R.
            h_rec = state[0].clone()
            clip = float(recurrent_grad_clip)
            h_rec.register_hook(lambda g, clip=clip: g.clamp(-clip, clip))
        state = _cell(xg[:, t], r_c, b_c, state, forget_gate, h_rec=h_rec)
        outs.append(state[0])
    h = torch.stack(outs, dim=1).to(x_gates.dtype)
    return h, (state if output_final_state else None)
