"""One sLSTM step (generation) on the Triton forward kernel, as a torch.library custom op.

    xlstm_kit::slstm_step(x_gates [B,4,H,D], r, b, h?, c?, n?, m?, forget_gate, config)
        -> (h [B,H,D] in x_gates' dtype, (h, c, n, m) each [B,H,D] in the state dtype)

The step is the forward kernel with T = 1 and keeps nothing for a backward, so decoding stores
no per-step tensors. Its gradient (rarely needed: training runs whole sequences) recomputes the
step with the saved tensors through `xlstm_kit::slstm_recurrent_fwd` and then runs the
sequence backward; the recomputation is the same kernel, so the gradients are those of
`slstm_recurrent_triton` on a length-1 sequence. `step_reference` is `naive.slstm_step_naive`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..._checks import backward_autocast_off, compute_dtype
from ..naive import State, slstm_step_naive
from . import forward as _forward_phase
from .common import prepare_r
from .config import SLSTMKernelConfig, resolve
from .op import _contiguous_state, recurrent_grads

Tensor = torch.Tensor

step_reference = slstm_step_naive  # what the step computes, as a PyTorch cell (tests)


def supports(op: str, **_) -> str | None:
    """backend.choose_backend's question: the step kernel takes every call the op validates."""
    return None


@torch.library.custom_op("xlstm_kit::slstm_step", mutates_args=())
def slstm_step_op(x_gates: Tensor, r: Tensor, b: Tensor, h: Optional[Tensor],
                  c: Optional[Tensor], n: Optional[Tensor], m: Optional[Tensor],
                  forget_gate: str, config: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    sdt = compute_dtype(x_gates, r, b)
    r_hi, r_lo, mm = prepare_r(r, sdt)
    cfg = resolve(config, x_gates.shape[-1], mm)
    init = _contiguous_state((h, c, n, m), sdt)
    h_out, final, _ = _forward_phase.forward(x_gates.unsqueeze(1).contiguous(), r_hi, r_lo, mm,
                                             b, init, forget_gate == "exp", False, cfg)
    batch, _, heads, dim = h_out.shape
    return (h_out.view(batch, heads, dim), *final)


@slstm_step_op.register_fake
def _(x_gates, r, b, h, c, n, m, forget_gate, config):
    batch, _, heads, dim = x_gates.shape
    sdt = compute_dtype(x_gates, r, b)
    return (x_gates.new_empty(batch, heads, dim),
            *(x_gates.new_empty(batch, heads, dim, dtype=sdt) for _ in range(4)))


def _setup_context(ctx, inputs, output):
    x_gates, r, b, h, c, n, m, forget_gate, config = inputs
    ctx.save_for_backward(x_gates, r, b, h, c, n, m)
    ctx.forget_gate, ctx.clip, ctx.config = forget_gate, None, config
    ctx.dtypes = (x_gates.dtype, r.dtype, b.dtype)
    ctx.set_materialize_grads(False)


@backward_autocast_off
def _backward(ctx, dh, dh_T, dc_T, dn_T, dm_T):
    x_gates, r, b, *init = ctx.saved_tensors
    with torch.no_grad():
        h, _, _, _, _, *saved = torch.ops.xlstm_kit.slstm_recurrent_fwd(
            x_gates.unsqueeze(1), r, b, *init, ctx.forget_gate, None, ctx.config, True)
    grads = recurrent_grads(ctx, r, h, saved, init, None if dh is None else dh.unsqueeze(1),
                            (dh_T, dc_T, dn_T, dm_T))
    if grads[0] is not None:
        grads[0] = grads[0].squeeze(1)
    return (*grads, None, None)


slstm_step_op.register_autograd(_backward, setup_context=_setup_context)


def slstm_step_triton(x_gates: Tensor, r: Tensor, b: Tensor, state: Optional[State] = None, *,
                      forget_gate: str = "sigmoid", config: Optional[SLSTMKernelConfig] = None
                      ) -> Tuple[Tensor, State]:
    """One sLSTM step: x_gates [B, 4, H, D] -> (h [B, H, D], (h, c, n, m) each [B, H, D]).
    `config` is an `SLSTMKernelConfig` or None (the default for the head size)."""
    h_prev, c, n, m = state if state is not None else (None,) * 4
    h, *new = torch.ops.xlstm_kit.slstm_step(x_gates, r, b, h_prev, c, n, m, forget_gate,
                                             "" if config is None else config.key())
    return h, tuple(new)
