"""sLSTM time loop with a hand-written backward pass (xLSTM paper, arXiv 2405.04517, appendix
eqs. 41–51).

The forward runs the stabilized recurrence of docs/design.md ("sLSTM", "Stabilisation") step by
step and keeps, per step, the
gate pre-activations and the states (h, c, n, m). The backward is one reverse-time loop.

Why the backward is not eqs. 41–51 verbatim: the paper writes the un-stabilized cell. With the
stabilizer m_t we differentiate the stabilized graph exactly, so that the result equals autograd
of `naive.slstm_recurrent_naive` (including gradients into a final state (c, n, m)). The paper's
quantities map as follows (0-based step t, state index t = before the step, t+1 = after):

    δh_t   = δh_t^ext + clip(δh_t^R)                                        (41)
    δc_t, δn_t carried backward through f'                                   (42), (43)
    δf̃_t  from f'_t c_{t-1} δc_t + f'_t n_{t-1} δn_t                         (44)
    δĩ_t   from i'_t z_t δc_t + i'_t δn_t                                    (45)
    δz̃_t  = i'_t φ'(z̃_t) δc_t,  δõ_t = σ'(õ_t) c_t / n_t δh_t               (46), (47)
    δh_{t-1}^R = Σ_g δg̃_t R_gᵀ,  δR_g = Σ_t h_{t-1}ᵀ δg̃_t                    (49), (50)
    δx_gates = δg̃ (eq. 48 is the caller's input projection), δb = Σ_t δg̃_t

Numerics: with the exp forget gate, n_t can be as small as e^-100 (t=1, ĩ=−50, f̃=50), so δc = o/n
overflows float32. We therefore carry the adjoints scaled by n_t, Ĉ_t = n_t δc_t and N̂_t = n_t δn_t.
They obey the same recursion with the bounded factor ρ_t = f'_t n_{t-1}/n_t ∈ [0, 1] and
κ_t = i'_t / n_t ∈ [0, 1] in place of f'_t and i'_t:

    Ĉ_{t-1} = ρ_t Ĉ_t + o_{t-1} δh_{t-1},     N̂_{t-1} = ρ_t N̂_t − o_{t-1} h̃_{t-1} δh_{t-1}

where h̃ = c / n. The stabilizer's own adjoint (δm through m_t = max(log f_t + m_{t-1}, ĩ_t)) is
kept: it is zero in exact arithmetic when no gradient enters the final (c, n, m), because h is
invariant to m, but not otherwise.

Layout inside: time-major and head-major, [T, H, B, 4D] for gates (gate g at columns g*D:(g+1)*D)
and [T+1, H, B, D] for states, so that a step is one batched matmul over heads,
[H, B, D] @ [H, D, 4D].
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._checks import backward_autocast_off, compute_dtype
from .naive import State


def _to_internal_r(r: torch.Tensor) -> torch.Tensor:
    # r [4, H, D, D] -> [H, D, 4D]; column g*D + e holds r[g, h, :, e]
    g, heads, dim, _ = r.shape
    return r.permute(1, 2, 0, 3).reshape(heads, dim, g * dim)


def _state_in(s: torch.Tensor, dtype) -> torch.Tensor:
    # [B, H, D] -> [H, B, D]
    return s.to(dtype).transpose(0, 1)


def _state_out(s: torch.Tensor) -> torch.Tensor:
    # [H, B, D] -> [B, H, D]; always a fresh tensor, never a view of the saved buffers
    return s.transpose(0, 1).clone(memory_format=torch.contiguous_format)


class SLSTMRecurrentFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_gates, r, b, h0, c0, n0, m0, forget_gate: str, clip: Optional[float]):
        batch, steps, _, heads, dim = x_gates.shape
        dtype = compute_dtype(x_gates, r, b, h0, c0, n0, m0)
        dev = x_gates.device
        # x_gates [B,T,4,H,D] + b [4,H,D] -> [T,H,B,4D]
        xb = (x_gates.to(dtype) + b.to(dtype)).permute(1, 3, 0, 2, 4).reshape(steps, heads, batch, 4 * dim)
        rr = _to_internal_r(r.to(dtype))
        pre_all = torch.empty(steps, heads, batch, 4 * dim, dtype=dtype, device=dev)
        hs = torch.empty(steps + 1, heads, batch, dim, dtype=dtype, device=dev)
        cs, ns, ms = torch.empty_like(hs), torch.empty_like(hs), torch.empty_like(hs)
        for buf, s in zip((hs, cs, ns, ms), (h0, c0, n0, m0)):
            if s is None:
                buf[0].zero_()
            else:
                buf[0].copy_(_state_in(s, dtype))
        h, c, n, m = hs[0], cs[0], ns[0], ms[0]
        for t in range(steps):
            pre = torch.baddbmm(xb[t], h, rr, out=pre_all[t])
            i_pre, f_pre, z_pre, o_pre = pre.split(dim, dim=-1)
            log_f = F.logsigmoid(f_pre) if forget_gate == "sigmoid" else f_pre
            a = log_f + m  # log f_t + m_{t-1}
            m = torch.maximum(a, i_pre, out=ms[t + 1])
            i_gate = torch.exp(i_pre - m)
            f_gate = torch.exp(a - m)
            c = torch.add(f_gate * c, i_gate * torch.tanh(z_pre), out=cs[t + 1])
            n = torch.add(f_gate * n, i_gate, out=ns[t + 1])
            h = torch.mul(torch.sigmoid(o_pre), c / n, out=hs[t + 1])

        ctx.save_for_backward(pre_all, hs, cs, ns, ms, rr)
        ctx.forget_gate = forget_gate
        ctx.clip = clip
        ctx.dims = (batch, steps, heads, dim)
        ctx.dtypes = (x_gates.dtype, r.dtype, b.dtype) + tuple(
            None if s is None else s.dtype for s in (h0, c0, n0, m0))
        ctx.set_materialize_grads(False)
        h_out = hs[1:].permute(2, 0, 1, 3).to(x_gates.dtype, memory_format=torch.contiguous_format,
                                                copy=True)  # [B,T,H,D]
        return (h_out, _state_out(hs[steps]), _state_out(cs[steps]), _state_out(ns[steps]),
                _state_out(ms[steps]))

    @staticmethod
    @backward_autocast_off
    @once_differentiable  # the backward is not itself differentiable: fail loudly on double grad
    def backward(ctx, dh_out, dh_T, dc_T, dn_T, dm_T):
        pre_all, hs, cs, ns, ms, rr = ctx.saved_tensors
        batch, steps, heads, dim = ctx.dims
        dtype = hs.dtype
        clip = ctx.clip

        # Per-step coefficients, vectorised over time before the sequential loop. [T,H,B,D] each.
        i_pre, f_pre, z_pre, o_pre = pre_all.split(dim, dim=-1)
        if ctx.forget_gate == "sigmoid":
            log_f = F.logsigmoid(f_pre)
            dlogf_df = torch.sigmoid(-f_pre)  # d logsigmoid(x)/dx = σ(−x)
        else:
            log_f = f_pre
            dlogf_df = None
        a = log_f + ms[:-1]
        m_new = ms[1:]
        f_gate = torch.exp(a - m_new)
        i_gate = torch.exp(i_pre - m_new)
        n_new = ns[1:]
        rho = f_gate * ns[:-1] / n_new       # f'_t n_{t-1} / n_t ∈ [0, 1]
        kappa = i_gate / n_new               # i'_t / n_t ∈ [0, 1]
        phi = f_gate * cs[:-1] / n_new       # f'_t c_{t-1} / n_t (= ρ_t h̃_{t-1}, finite when n_{t-1}=0)
        h_tilde = cs[1:] / n_new             # c_t / n_t = φ_t + κ_t z_t
        z = torch.tanh(z_pre)
        o = torch.sigmoid(o_pre)
        o_h = o * h_tilde
        do_coef = o_h * (1 - o)              # ∂h/∂õ
        dz_coef = kappa * (1 - z * z)        # Ĉ -> δz̃
        # (Ĉ, N̂) are carried stacked, [2,H,B,D], so the recursion is two ops per step:
        # (Ĉ, N̂)_t = ρ_{t+1} (Ĉ, N̂)_{t+1} + (o_t, −o_t h̃_t) δh_t, with ρ_{T+1} := 1.
        cn_coef = torch.stack((o, -o_h), dim=1)                       # [T,2,H,B,D]
        rho_next = torch.cat((rho[1:], torch.ones_like(rho[:1])))     # [T,H,B,D]
        # torch.maximum splits the gradient evenly on ties; do the same to match autograd.
        w_a = (a > i_pre).to(dtype) + 0.5 * (a == i_pre).to(dtype)
        # δc_0 = f'_1 δc_1 = (f'_1 / n_1) Ĉ_1; no division by n_0, which is 0 by default.
        f_over_n = f_gate[0] / n_new[0]
        # Free what the loop does not read: the coefficients above are ~10 x [T,H,B,D].
        del log_f, a, f_gate, i_gate, kappa, z, o, o_h

        # External gradient of h per step, [T,H,B,D]; the final state's h is the last output.
        # A fresh buffer: the incoming gradient tensors must not be modified in place.
        if dh_out is not None:
            dh_ext = torch.empty(steps, heads, batch, dim, dtype=dtype, device=hs.device)
            dh_ext.copy_(dh_out.permute(1, 2, 0, 3))
        else:
            dh_ext = torch.zeros(steps, heads, batch, dim, dtype=dtype, device=hs.device)
        if dh_T is not None:
            dh_ext[-1] += _state_in(dh_T, dtype)

        cn_hat = torch.zeros(2, heads, batch, dim, dtype=dtype, device=hs.device)
        if dc_T is not None:
            cn_hat[0] = _state_in(dc_T, dtype) * ns[-1]  # n_T δc_T
        if dn_T is not None:
            cn_hat[1] = _state_in(dn_T, dtype) * ns[-1]  # n_T δn_T
        dm = (_state_in(dm_T, dtype) if dm_T is not None
              else torch.zeros(heads, batch, dim, dtype=dtype, device=hs.device))
        dh_rec = torch.zeros(heads, batch, dim, dtype=dtype, device=hs.device)
        rr_t = rr.transpose(1, 2)  # [H, 4D, D]
        dpre_all = torch.empty_like(pre_all)

        # copy_ into the per-gate views rather than out=: torch.compile refuses out= on a
        # non-contiguous view (a graph break around the whole backward)
        for t in range(steps - 1, -1, -1):
            dh = dh_ext[t] + (dh_rec.clamp(-clip, clip) if clip is not None else dh_rec)  # (41)
            cn_hat = torch.addcmul(cn_hat * rho_next[t], cn_coef[t], dh)              # (42), (43)
            c_hat, n_hat = cn_hat[0], cn_hat[1]
            di, df, dz, do = dpre_all[t].split(dim, dim=-1)
            do.copy_(dh * do_coef[t])                                # (47)
            dz.copy_(c_hat * dz_coef[t])                             # (46)
            p = torch.addcmul(c_hat * phi[t], n_hat, rho[t])         # f' δf'  (44)
            # i' δi' (45) is u − p, where u = Ĉ h̃ + N̂ since ρ + κ = 1 and φ + κ z = h̃.
            u = torch.addcmul(n_hat, c_hat, h_tilde[t])
            # Adjoint of m_t: its own (from m_{t+1}) minus what f' and i' take, routed by the max.
            da = torch.addcmul(p, dm - u, w_a[t])                    # δ(log f_t + m_{t-1})
            di.copy_(dm - da)                                        # δĩ = (u − p) + (δm − u)(1 − w_a)
            if dlogf_df is not None:
                df.copy_(da * dlogf_df[t])
            else:
                df.copy_(da)
            dm = da                                                  # δm_{t-1}
            dh_rec = torch.bmm(dpre_all[t], rr_t)                    # (49): [H,B,4D] @ [H,4D,D]
        c_hat, n_hat = cn_hat[0], cn_hat[1]

        (x_dt, r_dt, b_dt, h0_dt, c0_dt, n0_dt, m0_dt) = ctx.dtypes
        grads = [None] * 9
        if ctx.needs_input_grad[0]:
            # [T,H,B,4D] -> [B,T,4,H,D]
            grads[0] = dpre_all.view(steps, heads, batch, 4, dim).permute(2, 0, 3, 1, 4).to(x_dt)
        if ctx.needs_input_grad[1]:
            # (50): Σ_t h_{t-1}ᵀ δg̃_t per head -> [H, D, 4D] -> [4, H, D, D]
            d_rr = torch.einsum("thbd,thbe->hde", hs[:-1], dpre_all)
            grads[1] = d_rr.view(heads, dim, 4, dim).permute(2, 0, 1, 3).to(r_dt)
        if ctx.needs_input_grad[2]:
            grads[2] = dpre_all.sum(dim=(0, 2)).view(heads, 4, dim).transpose(0, 1).to(b_dt)
        if ctx.needs_input_grad[3]:
            grads[3] = _state_out(dh_rec.clamp(-clip, clip) if clip is not None else dh_rec).to(h0_dt)
        if ctx.needs_input_grad[4]:
            grads[4] = _state_out(f_over_n * c_hat).to(c0_dt)
        if ctx.needs_input_grad[5]:
            grads[5] = _state_out(f_over_n * n_hat).to(n0_dt)
        if ctx.needs_input_grad[6]:
            grads[6] = _state_out(dm).to(m0_dt)
        return tuple(grads)


def slstm_recurrent_torch(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor, *,
                          initial_state: Optional[State] = None, output_final_state: bool = False,
                          forget_gate: str = "sigmoid", recurrent_grad_clip: Optional[float] = None
                          ) -> Tuple[torch.Tensor, Optional[State]]:
    """sLSTM over a sequence with the hand-written backward. Inputs are assumed validated.

    x_gates [B, T, 4, H, D], r [4, H, D, D], b [4, H, D], initial_state (h, c, n, m) each
    [B, H, D] or None (zeros). Returns h [B, T, H, D] in x_gates' dtype and, when
    output_final_state, the final (h, c, n, m) in the compute dtype.
    """
    h0, c0, n0, m0 = initial_state if initial_state is not None else (None,) * 4
    clip = None if recurrent_grad_clip is None else float(recurrent_grad_clip)
    h, h_T, c_T, n_T, m_T = SLSTMRecurrentFunction.apply(x_gates, r, b, h0, c0, n0, m0,
                                                         forget_gate, clip)
    return h, ((h_T, c_T, n_T, m_T) if output_final_state else None)
