"""One DPLR recurrent step in Triton (generation / decode), forward only.

    h' = (I − a bᵀ) Diag(α) h + k vᵀ,   α = e^{gk},   o = h'ᵀ (scale · q)      (h = Sᵀ, [K, V])

The step is memory-bound (the state is read once and written once, 4·K·V bytes each way per
head): one launch, one program per (b·h, V-tile), every reduction over K inside the program.
Registered as the custom op `xlstm_kit::dplr_step` (no autograd: `xlstm_kit.ops.dplr_step` uses
it only when no input needs a gradient).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..naive import check_dplr_step_inputs, check_scale


@triton.jit
def _step_kernel(q, k, v, a, b, gk, h_in, h_out, o, scale,
                 K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr):
    """q, k, a, b, gk: [BH, K]; v: [BH, V]; h_in, h_out: [BH, K, V] float32; o: [BH, V] (any
    float dtype; the float32 result is rounded once on store)."""
    # offsets written out rather than through common._offs: with the helper ptxas (sm_90a,
    # K = V = 128, BV 32) allocates 154 registers instead of 89, with 23 % more instructions
    bh = tl.program_id(0).to(tl.int64)
    vv = tl.program_id(1) * BV + tl.arange(0, BV)
    kr = tl.arange(0, K)
    ph = bh * K * V + kr[:, None] * V + vv[None, :]
    g = tl.load(gk + bh * K + kr).to(tl.float32)
    # gk > 0 counts as 0, as on every path (ops.dplr.log_decay); `where`, not tl.minimum,
    # so that a NaN stays NaN
    alpha = tl.exp(tl.where(g > 0.0, 0.0, g))
    if HAS_STATE:
        h = tl.load(h_in + ph) * alpha[:, None]                  # Diag(α) h
    else:
        h = tl.zeros([K, BV], dtype=tl.float32)
    bt = tl.load(b + bh * K + kr).to(tl.float32)
    at = tl.load(a + bh * K + kr).to(tl.float32)
    kt = tl.load(k + bh * K + kr).to(tl.float32)
    vt = tl.load(v + bh * V + vv).to(tl.float32)
    u = tl.sum(bt[:, None] * h, axis=0)                          # bᵀ Diag(α) h   [BV]
    h = h - at[:, None] * u[None, :] + kt[:, None] * vt[None, :]
    tl.store(h_out + ph, h)
    qt = tl.load(q + bh * K + kr).to(tl.float32) * scale
    tl.store(o + bh * V + vv, tl.sum(qt[:, None] * h, axis=0))


def supports(op: str, *, K: int, V: int, dtype: torch.dtype, requires_grad: bool = False, **_) -> str | None:
    """backend.choose_backend's question: K, V powers of two in [16, 256], not float64, no gradient."""
    if not all(16 <= d <= 256 and d & (d - 1) == 0 for d in (K, V)):
        return f"the Triton DPLR step kernel needs K and V powers of two in [16, 256], got {K}, {V}"
    if dtype == torch.float64:
        return "the Triton DPLR step kernel computes in float32; float64 runs on the PyTorch path"
    if requires_grad:
        return "the Triton DPLR step kernel has no backward; inputs that need a gradient run on the PyTorch path"
    return None


def _step(q, k, v, a, b, gk, state, scale: float, launch: bool = True):
    B, H, K = q.shape
    V = v.shape[-1]
    # Host-side work is the cost at decode sizes (the state is 1 MiB per batch row at H = 16,
    # K = V = 128; the kernel moves it in a few µs): no copies when the inputs are already
    # contiguous, the output written in q's dtype by the kernel, one launch.
    xs = [x if x.is_contiguous() else x.contiguous() for x in (q, k, v, a, b, gk)]
    h_out = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    if state is None:
        h_in = h_out
    elif state.dtype == torch.float32 and state.is_contiguous():
        h_in = state
    else:
        h_in = state.to(torch.float32).contiguous()
    o = torch.empty(B, H, V, device=q.device, dtype=q.dtype)
    if launch:
        # enough programs to keep many loads in flight when B·H is small
        BV = min(V, 16 if B * H * V < 8192 else 32)
        _step_kernel[(B * H, V // BV)](*xs, h_in, h_out, o, scale, K=K, V=V, BV=BV,
                                        HAS_STATE=state is not None, num_warps=4)
    return o, h_out


# Defined with torch.library.Library rather than torch.library.custom_op: the step is host-bound
# at decode sizes, and custom_op's Python layers cost ~20 µs per call against ~5 µs for a plain
# definition with one CompositeExplicitAutograd kernel (CPU, no launch; same fake support). No
# autograd kernel: the public op takes this path only when no input needs a gradient.
_LIB = torch.library.Library("xlstm_kit", "FRAGMENT")
_LIB.define("dplr_step(Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, Tensor gk, Tensor? state, "
            "float scale) -> (Tensor o, Tensor state_out)")
_LIB.impl("dplr_step", _step, "CompositeExplicitAutograd")


@torch.library.register_fake("xlstm_kit::dplr_step", lib=_LIB)
def _step_fake(q, k, v, a, b, gk, state, scale):
    return _step(q, k, v, a, b, gk, state, scale, launch=False)


_step_op = torch.ops.xlstm_kit.dplr_step.default


def dplr_step_triton(q, k, v, a, b, gk, state, *, scale=None):
    """One DPLR step with the Triton kernel (no autograd).

    q, k, a, b, gk: [B, H, K]; v: [B, H, V]; state: [B, H, K, V] (= Sᵀ) or None for zeros.
    Returns (o [B, H, V] in q's dtype, state [B, H, K, V] float32).
    """
    B, H, K, V = check_dplr_step_inputs(q, k, v, a, b, gk, state)
    reason = supports("dplr_step", K=K, V=V, dtype=q.dtype)
    if reason:
        raise ValueError(reason)
    return _step_op(q, k, v, a, b, gk, state, float(check_scale(scale, K)))
