"""The sLSTM sequence op on the Triton kernels, as torch.library custom ops.

    xlstm_kit::slstm_recurrent_fwd(x_gates, r, b, h0?, c0?, n0?, m0?, forget_gate,
                                   recurrent_grad_clip?, config, save, cu_seqlens?)
        -> (h [B,T,H,D], h_T, c_T, n_T, m_T [B,H,D], hs, g, cs, ns, ms)
    xlstm_kit::slstm_recurrent_bwd(r, g, cs, ns, ms, c0?, n0?, m0?, dh?, dh_T?, dc_T?, dn_T?,
                                   dm_T?, forget_gate, recurrent_grad_clip?, config, cu_seqlens?)
        -> (δg̃ [B,T,4,H,D], δh_0, δc_0, δn_0, δm_0 [B,H,D])

With cu_seqlens [N+1] (B = 1, N packed sequences) every state and state gradient is [N,H,D]
(one row per sequence) and the kernels run the sequences side by side as a batch of N.

The forward returns the tensors its backward needs (hs, g, cs, ns, ms: `forward.forward`'s
saved tensors; empty when `save` is False, hs also empty when h itself serves); the autograd
formula registered here calls the backward op and forms δR and δb with torch. `config` is an
`SLSTMKernelConfig.key()` string, "" for the default of the head size, weight dtype, batch,
head count and the GPU's SM count.
Custom ops keep `torch.compile` from tracing into Triton launches (no graph breaks).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from ..._checks import backward_autocast_off, compute_dtype
from ..naive import State
from ....errors import XLSTMKitError
from . import backward as _backward_phase
from . import forward as _forward_phase
from .common import prepare_r
from .config import SLSTMKernelConfig, resolve

Tensor = torch.Tensor


def supports(op: str, **_) -> str | None:
    """backend.choose_backend's question: the sLSTM kernels take every call the op validates."""
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(t: Tensor):
    """The SM count of t's GPU (a split head's grid must fit in it), None off CUDA."""
    return _sm_count(t.device) if t.device.type == "cuda" else None


def _rows(x: Tensor, cu_seqlens: Optional[Tensor]) -> int:
    """The kernels' batch: x's, or the number of packed sequences."""
    return x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _cu(cu_seqlens: Optional[Tensor]) -> Optional[Tensor]:
    return None if cu_seqlens is None else cu_seqlens.contiguous()


def _contiguous_state(states, sdt):
    if states[-1] is None:
        return None
    return tuple(None if s is None else s.to(sdt).contiguous() for s in states)


@torch.library.custom_op("xlstm_kit::slstm_recurrent_fwd", mutates_args=())
def slstm_recurrent_fwd(x_gates: Tensor, r: Tensor, b: Tensor, h0: Optional[Tensor],
                        c0: Optional[Tensor], n0: Optional[Tensor], m0: Optional[Tensor],
                        forget_gate: str, recurrent_grad_clip: Optional[float], config: str,
                        save: bool, cu_seqlens: Optional[Tensor] = None
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                   Tensor, Tensor, Tensor, Tensor, Tensor]:
    sdt = compute_dtype(x_gates, r, b)
    r_hi, r_lo, mm = prepare_r(r, sdt)
    _, _, _, heads, dim = x_gates.shape
    sms = sm_count(x_gates)
    cfg = resolve(config, dim, mm, _rows(x_gates, cu_seqlens), heads, sms)
    init = _contiguous_state((h0, c0, n0, m0), sdt)
    h, final, saved = _forward_phase.forward(x_gates.contiguous(), r_hi, r_lo, mm, b, init,
                                             forget_gate == "exp", save, cfg, sms, _cu(cu_seqlens))
    # Outputs may not alias each other: absent ones are distinct empty tensors.
    if saved is None:
        saved = [h.new_empty(0, dtype=sdt) for _ in range(5)]
    elif saved[0] is h:
        saved = (h.new_empty(0, dtype=sdt), *saved[1:])
    return (h, *final, *saved)


@slstm_recurrent_fwd.register_fake
def _(x_gates, r, b, h0, c0, n0, m0, forget_gate, recurrent_grad_clip, config, save,
      cu_seqlens=None):
    batch, steps, _, heads, dim = x_gates.shape
    sdt = compute_dtype(x_gates, r, b)
    h = x_gates.new_empty(batch, steps, heads, dim)
    final = [x_gates.new_empty(_rows(x_gates, cu_seqlens), heads, dim, dtype=sdt) for _ in range(4)]
    if not save:
        return (h, *final, *(x_gates.new_empty(0, dtype=sdt) for _ in range(5)))
    hs = x_gates.new_empty(batch, steps, heads, dim, dtype=sdt) if x_gates.dtype != sdt \
        else x_gates.new_empty(0, dtype=sdt)
    g = x_gates.new_empty(batch, steps, 4, heads, dim, dtype=sdt)
    cs, ns, ms = (x_gates.new_empty(batch, steps, heads, dim, dtype=sdt) for _ in range(3))
    return (h, *final, hs, g, cs, ns, ms)


@torch.library.custom_op("xlstm_kit::slstm_recurrent_bwd", mutates_args=())
def slstm_recurrent_bwd(r: Tensor, g: Tensor, cs: Tensor, ns: Tensor, ms: Tensor,
                        c0: Optional[Tensor], n0: Optional[Tensor], m0: Optional[Tensor],
                        dh: Optional[Tensor], dh_T: Optional[Tensor], dc_T: Optional[Tensor],
                        dn_T: Optional[Tensor], dm_T: Optional[Tensor], forget_gate: str,
                        recurrent_grad_clip: Optional[float], config: str,
                        cu_seqlens: Optional[Tensor] = None
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    sdt = g.dtype
    r_hi, r_lo, mm = prepare_r(r, sdt)
    _, _, _, heads, dim = g.shape
    sms = sm_count(g)
    cfg = resolve(config, dim, mm, _rows(g, cu_seqlens), heads, sms)
    init = _contiguous_state((None, c0, n0, m0), sdt)  # the kernel reads (c, n, m) only
    d_final = (dh_T, dc_T, dn_T, dm_T)
    if all(d is None for d in d_final):
        d_final = None
    dg, d_init = _backward_phase.backward(r_hi, r_lo, mm, (None, g, cs, ns, ms), init, dh,
                                          d_final, forget_gate == "exp", recurrent_grad_clip, cfg,
                                          sms, _cu(cu_seqlens))
    return (dg, *d_init)


@slstm_recurrent_bwd.register_fake
def _(r, g, cs, ns, ms, c0, n0, m0, dh, dh_T, dc_T, dn_T, dm_T, forget_gate,
      recurrent_grad_clip, config, cu_seqlens=None):
    _, _, _, heads, dim = g.shape
    return (torch.empty_like(g), *(g.new_empty(_rows(g, cu_seqlens), heads, dim) for _ in range(4)))


def recurrent_grads(ctx, r, h, saved, init, dh, d_final, cu_seqlens=None):
    """The gradients of (x_gates, r, b, h0, c0, n0, m0) from the backward op; entries whose
    input needs no gradient (ctx.needs_input_grad) are None. `saved` = (hs, g, cs, ns, ms) with
    hs empty when h (already in the state dtype) is the saved h; cu_seqlens as in the ops."""
    hs, g, cs, ns, ms = saved
    h0, c0, n0, m0 = init
    dg, *d_init = torch.ops.xlstm_kit.slstm_recurrent_bwd(
        r, g, cs, ns, ms, c0, n0, m0, dh, *d_final, ctx.forget_gate, ctx.clip, ctx.config, cu_seqlens)
    need = ctx.needs_input_grad
    grads = [None] * 7
    if need[0]:
        grads[0] = dg.to(ctx.dtypes[0])
    if need[1]:
        hs = (h if hs.numel() == 0 else hs).to(dg.dtype)
        # (50) δR_g = Σ_{b,t} h_{t-1}ᵀ δg̃_t per head; h_{-1} is the initial h.
        d_r = torch.einsum("bthi,btghj->ghij", hs[:, :-1], dg[:, 1:])
        if cu_seqlens is None:
            first = dg[:, 0]
        else:
            # Packed: the sum above paired each sequence's first step with the previous
            # sequence's last h; take those terms out (the first steps' h_{-1} is h0 or 0).
            starts = cu_seqlens[:-1].long()
            first = dg[0, starts]
            d_r = d_r - torch.einsum("nhi,nghj->ghij", hs[0, starts[1:] - 1], first[1:])
        if h0 is not None:
            d_r = d_r + torch.einsum("bhi,bghj->ghij", h0.to(dg.dtype), first)
        grads[1] = d_r.to(ctx.dtypes[1])
    if need[2]:
        grads[2] = dg.sum(dim=(0, 1)).to(ctx.dtypes[2])
    for k, s in enumerate(init):
        if need[3 + k]:
            grads[3 + k] = d_init[k].to(s.dtype)
    return grads


def _setup_context(ctx, inputs, output):
    x_gates, r, b, h0, c0, n0, m0, forget_gate, clip, config, save, cu_seqlens = inputs
    if not save:
        raise RuntimeError("slstm_recurrent_fwd was called with save=False but a gradient is "
                           "needed; call it through slstm_recurrent_triton")
    ctx.save_for_backward(r, output[0], *output[5:], h0, c0, n0, m0, cu_seqlens)
    ctx.forget_gate, ctx.clip, ctx.config = forget_gate, clip, config
    ctx.dtypes = (x_gates.dtype, r.dtype, b.dtype)
    # Gradients of unused outputs stay None: no zero [B,T,H,D] tensors are made for them.
    ctx.set_materialize_grads(False)


@backward_autocast_off
def _backward(ctx, dh, dh_T, dc_T, dn_T, dm_T, *_saved_grads):
    r, h, hs, g, cs, ns, ms, h0, c0, n0, m0, cu_seqlens = ctx.saved_tensors
    grads = recurrent_grads(ctx, r, h, (hs, g, cs, ns, ms), (h0, c0, n0, m0), dh,
                            (dh_T, dc_T, dn_T, dm_T), cu_seqlens)
    return (*grads, None, None, None, None, None)


slstm_recurrent_fwd.register_autograd(_backward, setup_context=_setup_context)


def slstm_recurrent_triton(x_gates: Tensor, r: Tensor, b: Tensor, *,
                           initial_state: Optional[State] = None, output_final_state: bool = False,
                           forget_gate: str = "sigmoid", recurrent_grad_clip: Optional[float] = None,
                           config: Optional[SLSTMKernelConfig] = None,
                           cu_seqlens: Optional[Tensor] = None) -> Tuple[Tensor, Optional[State]]:
    """sLSTM over a sequence with the fused Triton kernels (inputs validated by
    `xlstm_kit.ops.slstm`).

    x_gates [B, T, 4, H, D] (gates i, f, z, o), r [4, H, D, D], b [4, H, D], initial_state
    (h, c, n, m) each [B, H, D] or None (zeros). Returns h [B, T, H, D] in x_gates' dtype and,
    when output_final_state, the final (h, c, n, m), each [B, H, D] in float32 (float64 for
    float64 inputs). `config` overrides the launch choices (None: `config.default_config`).

    cu_seqlens: None or int32/int64 [N+1] on x_gates' device, 0 = cu[0] < ... < cu[N] = T
    (the values are the caller's to check: reading them here would synchronise with the host),
    with B = 1: N packed sequences, each from its own row of initial_state (each [N, H, D])
    to its own final state (N rows), nothing crossing a boundary. The kernels take sequence n
    as batch entry n (a step-sequential recurrence: never one long sequence of T steps), so a
    packed call costs about as many steps as its longest sequence.
    """
    h0, c0, n0, m0 = initial_state if initial_state is not None else (None,) * 4
    if cu_seqlens is not None:
        _check_packed(x_gates, cu_seqlens, h0)
    clip = None if recurrent_grad_clip is None else float(recurrent_grad_clip)
    tensors = (x_gates, r, b, h0, c0, n0, m0)
    # Inference keeps nothing for a backward.
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    h, h_T, c_T, n_T, m_T, *_ = torch.ops.xlstm_kit.slstm_recurrent_fwd(
        *tensors, forget_gate, clip, "" if config is None else config.key(), save, cu_seqlens)
    return h, ((h_T, c_T, n_T, m_T) if output_final_state else None)


def _check_packed(x_gates: Tensor, cu_seqlens: Tensor, h0: Optional[Tensor]) -> None:
    """Shape, dtype and device checks of packed inputs (the values need the host: the caller's)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise XLSTMKitError(f"cu_seqlens must be an int32 or int64 tensor of shape [N+1] with N >= 1, "
                            f"got {getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                            f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if x_gates.shape[0] != 1:
        raise XLSTMKitError(f"packed sequences (cu_seqlens) take batch 1, got batch {x_gates.shape[0]}")
    if cu_seqlens.device != x_gates.device:
        raise XLSTMKitError(f"cu_seqlens is on {cu_seqlens.device}, x_gates on {x_gates.device}")
    if h0 is not None and h0.shape[0] != cu_seqlens.shape[0] - 1:
        raise XLSTMKitError(f"initial_state has {h0.shape[0]} rows, cu_seqlens {cu_seqlens.shape[0] - 1} "
                            f"sequences")
