"""The sLSTM layer's fused gate maps, with a hand-written backward (see fused.py for why).

- `slstm_gates(x, state, conv_w, conv_b, gate_w)`: the head-wise gate maps of SiLU(conv(x)) (i, f)
  and x (z, o), saves x (and the conv state); the backward recomputes the convolution.
"""
from __future__ import annotations

import torch

from .fused import _conv_bwd, _conv_fwd, bmm_into, conv_inputs


def _gate_maps(x, xc, wg, dt):
    """g[:, gate, h] = src[:, h] @ W[gate, h]ᵀ, src = xc for the i and f gates and x for z and o:
    one batched matmul per gate over the heads, written straight into the [N, 4, H, D] layout."""
    N, H, D = x.shape
    g = torch.empty(N, 4, H, D, device=x.device, dtype=dt)
    for gate, src in enumerate((xc, xc, x, x)):
        bmm_into(src.transpose(0, 1), wg[gate].transpose(1, 2), g[:, gate].transpose(0, 1))
    return g


class _SLSTMGatesFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, state, conv_w, conv_b, gate_w, kernels, pos):
        N = x.shape[0] * x.shape[1]
        _, H, D, _ = gate_w.shape
        xc = _conv_fwd(kernels, x, state, conv_w, conv_b, True, pos)
        wg = gate_w.to(x.dtype)
        ctx.save_for_backward(x, state, conv_w, conv_b, wg, pos)
        ctx.kernels, ctx.gate_dtype = kernels, gate_w.dtype
        return _gate_maps(x.reshape(N, H, D), xc.view(N, H, D), wg, x.dtype)

    @staticmethod
    def backward(ctx, dg):
        x, state, conv_w, conv_b, wg, pos = ctx.saved_tensors
        B, T, C = x.shape
        N = B * T
        _, H, D, _ = wg.shape
        xc = _conv_fwd(ctx.kernels, x, state, conv_w, conv_b, True, pos).view(N, H, D)
        xs = x.reshape(N, H, D)
        dg = dg.reshape(N, 4, H, D).to(x.dtype)
        dgt = [dg[:, gate].transpose(0, 1) for gate in range(4)]  # [H, N, D]
        dw = torch.stack([torch.bmm(dgt[gate].transpose(1, 2), src.transpose(0, 1))
                          for gate, src in enumerate((xc, xc, xs, xs))])  # [4, H, D_out, D_in]
        dxc = torch.baddbmm(torch.bmm(dgt[0], wg[0]), dgt[1], wg[1])  # [H, N, D]
        dx_direct = torch.baddbmm(torch.bmm(dgt[2], wg[2]), dgt[3], wg[3])
        dx, dstate, dcw, dcb = _conv_bwd(ctx.kernels, dxc.transpose(0, 1).reshape(B, T, C), x, state,
                                         conv_w, conv_b, True, pos)
        dx = dx + dx_direct.transpose(0, 1).reshape(B, T, C)
        return dx, dstate, dcw, dcb, dw.to(ctx.gate_dtype), None, None


def slstm_gates(x: torch.Tensor, state: torch.Tensor | None, conv_w: torch.Tensor, conv_b: torch.Tensor,
                gate_w: torch.Tensor, backend: str | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Gate pre-activations [B, T, 4, H, D] in x's dtype (without bias and recurrence) of the
    sLSTM layer: the i and f gates map SiLU(causal conv of x) head-wise, z and o map x, by
    gate_w [4, H, D_out, D_in]; x [B, T, H*D], conv state [B, K-1, H*D] | None, conv_w [H*D, K],
    conv_b [H*D]. Saves x and the state; the backward recomputes the convolution (Triton kernels
as in `conv_silu`, and so is `pos`)."""
    x, state, conv_w, conv_b, kernels, pos = conv_inputs(x, state, conv_w, conv_b, backend, pos)
    B, T, _ = x.shape
    _, H, D, _ = gate_w.shape
    return _SLSTMGatesFn.apply(x, state, conv_w, conv_b, gate_w, kernels, pos).view(B, T, 4, H, D)
