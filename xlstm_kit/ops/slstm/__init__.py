"""sLSTM ops: validated public entry points and the one place that picks the backend.

    slstm_recurrent(x_gates [B,T,4,H,D], r [4,H,D,D], b [4,H,D], *, initial_state, ...)
        -> (h [B,T,H,D], (h, c, n, m) each [B,H,D] or None)
    slstm_step(x_gates [B,4,H,D], r, b, state) -> (h [B,H,D], (h, c, n, m))

Gate order is (i, f, z, o) everywhere; r holds one D x D block per gate and head (the
block-diagonal recurrent matrix), applied as h_{t-1} @ r[g, h]. The maths is docs/design.md, "sLSTM"
(xLSTM paper, arXiv 2405.04517, eqs. 8–17).
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

from .._checks import autocast_off, check_cu_seqlens, check_head_dim, check_same_device, check_tensor, check_varlen_state, run_varlen
from ..backend import choose_backend, on_device
from .naive import State, slstm_recurrent_naive, slstm_step_naive
from .recurrent import slstm_recurrent_torch
from ...errors import XLSTMKitError

__all__ = ["slstm_recurrent", "slstm_step", "slstm_recurrent_naive", "slstm_step_naive"]

FORGET_GATES = ("sigmoid", "exp")
STATE_NAMES = ("h", "c", "n", "m")


def _check_common(x_gates, r, b, state, state_name: str, forget_gate) -> None:
    if forget_gate not in FORGET_GATES:
        raise XLSTMKitError(f"forget_gate must be 'sigmoid' or 'exp', got {forget_gate!r}")
    batch, heads, dim = x_gates.shape[0], x_gates.shape[-2], x_gates.shape[-1]
    check_head_dim("the head dimension D of x_gates", dim)
    check_tensor("r", r, (4, heads, dim, dim), "4,H,D,D")
    check_tensor("b", b, (4, heads, dim), "4,H,D")
    tensors = {"x_gates": x_gates, "r": r, "b": b}
    if state is not None:
        if not isinstance(state, (tuple, list)) or len(state) != 4:
            raise XLSTMKitError(f"{state_name} must be a tuple (h, c, n, m) of four [B,H,D] tensors, "
                             f"expected each of shape [{batch}, {heads}, {dim}]")
        for name, s in zip(STATE_NAMES, state):
            check_tensor(f"{state_name}.{name}", s, (batch, heads, dim), "B,H,D")
            tensors[f"{state_name}.{name}"] = s
    check_same_device(**tensors)


@autocast_off
def slstm_recurrent(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor, *,
                    initial_state: Optional[State] = None, output_final_state: bool = False,
                    forget_gate: str = "sigmoid", recurrent_grad_clip: Optional[float] = None,
                    backend: Optional[str] = None, cu_seqlens: Optional[torch.Tensor] = None,
                    config=None) -> Tuple[torch.Tensor, Optional[State]]:
    """sLSTM over a sequence (stabilized exponential gating, per-head memory mixing).

    Args:
        x_gates: [B, T, 4, H, D] input parts of the gate pre-activations, gates (i, f, z, o).
        r: [4, H, D, D] recurrent weights; gate g of head h adds h_{t-1}[h] @ r[g, h].
        b: [4, H, D] gate biases.
        initial_state: (h, c, n, m), each [B, H, D]; None means zeros.
        output_final_state: also return the final (h, c, n, m).
        forget_gate: "sigmoid" (log f = logsigmoid(f̃)) or "exp" (log f = f̃).
        recurrent_grad_clip: None (exact gradient) or a positive float c: the gradient reaching
            h_{t-1} through r (δh^R, paper eq. 49) is clamped to [−c, c] in the backward pass
            (the paper uses 10). The forward is unchanged.
        backend: None (fastest available), "torch" or "triton".
        cu_seqlens: None, or int32/int64 [N+1] (0 = cu[0] < ... < cu[N] = T) with B = 1: N
            sequences packed along T, each from its own row of initial_state (each [N, H, D];
            None: zeros), returning its own final state (N rows); nothing crosses a boundary.
        config: the Triton kernels' `SLSTMKernelConfig` (None: the default for the head size);
            unused on the PyTorch path.

    Returns:
        h [B, T, H, D] in x_gates' dtype; the final state (each [B, H, D], float32, or float64
        for float64 inputs) or None.
    """
    check_tensor("x_gates", x_gates, (None, None, 4, None, None), "B,T,4,H,D")
    if x_gates.shape[1] == 0:
        raise XLSTMKitError("x_gates [B,T,4,H,D] must have at least one time step (T >= 1)")
    bounds = None
    if cu_seqlens is not None:
        bounds = check_cu_seqlens(cu_seqlens, x_gates.shape[0], x_gates.shape[1], x_gates.device)
        if initial_state is not None:
            check_varlen_state(initial_state, len(bounds) - 1)
    _check_common(x_gates if bounds is None else x_gates.expand(len(bounds) - 1, *x_gates.shape[1:]),
                  r, b, initial_state, "initial_state", forget_gate)
    if recurrent_grad_clip is not None and (
            isinstance(recurrent_grad_clip, bool) or not isinstance(recurrent_grad_clip, numbers.Real)
            or not recurrent_grad_clip > 0):
        raise XLSTMKitError(f"recurrent_grad_clip must be None or a positive number, got {recurrent_grad_clip!r}")
    chosen = choose_backend("slstm_recurrent", backend, x_gates.device,
                            inputs=(x_gates, r, b, *(initial_state or ())))
    if chosen == "torch":
        if bounds is not None:  # the reference: one call per sequence
            return run_varlen(lambda xg, **kw: slstm_recurrent_torch(
                xg, r, b, forget_gate=forget_gate, recurrent_grad_clip=recurrent_grad_clip, **kw),
                (x_gates,), bounds, initial_state, output_final_state)
        return slstm_recurrent_torch(x_gates, r, b, initial_state=initial_state,
                                     output_final_state=output_final_state, forget_gate=forget_gate,
                                     recurrent_grad_clip=recurrent_grad_clip)
    from .triton.op import slstm_recurrent_triton

    with on_device(x_gates):
        # Packed: the kernels run the sequences side by side as a batch (no loop over them).
        return slstm_recurrent_triton(x_gates, r, b, initial_state=initial_state,
                                      output_final_state=output_final_state, forget_gate=forget_gate,
                                      recurrent_grad_clip=recurrent_grad_clip, config=config,
                                      cu_seqlens=cu_seqlens)


@autocast_off
def slstm_step(x_gates: torch.Tensor, r: torch.Tensor, b: torch.Tensor,
               state: Optional[State] = None, *, forget_gate: str = "sigmoid", config=None
               ) -> Tuple[torch.Tensor, State]:
    """One sLSTM step (generation): x_gates [B, 4, H, D], r [4, H, D, D], b [4, H, D],
    state (h, c, n, m) each [B, H, D] or None (zeros) -> (h [B, H, D], new state).
    config: the Triton kernel's `SLSTMKernelConfig` (None: the default); unused on the PyTorch path."""
    check_tensor("x_gates", x_gates, (None, 4, None, None), "B,4,H,D")
    _check_common(x_gates, r, b, state, "state", forget_gate)
    if choose_backend("slstm_step", None, x_gates.device) == "triton":
        from .triton.step import slstm_step_triton

        with on_device(x_gates):
            return slstm_step_triton(x_gates, r, b, state, forget_gate=forget_gate, config=config)
    return slstm_step_naive(x_gates, r, b, state, forget_gate=forget_gate)
