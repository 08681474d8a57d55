"""One mLSTM recurrent step in Triton (generation / decode).

    m' = max(log f + m, ĩ),  C' = e^{log f + m − m'} C + e^{ĩ − m'} k vᵀ,  n' likewise,
    h = C'ᵀq̂ / (max(|n'ᵀq̂|, e^{−m'}) + eps)

One launch per step; the state is read once and written once (the step is memory-bound:
4·K·V bytes each way per head), with the log-sigmoid and the stabilizer inside the kernel so
that batch-1 decoding pays a single launch. Registered as the custom ops xlstm_kit::mlstm_step
(a new C) and xlstm_kit::mlstm_step_ (C updated in place: each program reads its C tile before
it writes it, and no other program touches that tile); no autograd: steps that need a gradient
run on the PyTorch path.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


def supports(op: str, *, dtype: torch.dtype, requires_grad: bool = False, **_) -> str | None:
    """backend.choose_backend's question: does the step kernel take this call?"""
    if dtype == torch.float64:
        return "the Triton step kernel computes in float32; float64 runs on the PyTorch path"
    if requires_grad:
        return "the Triton step kernel has no backward; inputs that need a gradient run on the PyTorch path"
    return None


@triton.jit
def _step_kernel(
    q_ptr, k_ptr, v_ptr, i_ptr, f_ptr, c_ptr, n_ptr, m_ptr,
    h_ptr, co_ptr, no_ptr, mo_ptr,
    scale, eps,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_STATE: tl.constexpr,
    NP: tl.constexpr = 1, NPP: tl.constexpr = 1,
):
    """Program (b·h, V-tile): updates C[:, tile] in float32 and writes h[tile]; every program
    recomputes n' (K values, needed for the denominator); tile 0 stores n' and m'. NP > 1: i, f
    are [B·H, NP] partial sums of the gate pre-activations (the fused block step's, one per
    channel tile), added here (NPP: NP rounded up to a power of two)."""
    bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    bh64 = bh.to(tl.int64)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mv = offs_v < V
    if NP == 1:
        ig = tl.load(i_ptr + bh).to(tl.float32)
        fg = tl.load(f_ptr + bh).to(tl.float32)
    else:
        pp = tl.arange(0, NPP)
        ig = tl.sum(tl.load(i_ptr + bh * NP + pp, mask=pp < NP, other=0.0).to(tl.float32), axis=0)
        fg = tl.sum(tl.load(f_ptr + bh * NP + pp, mask=pp < NP, other=0.0).to(tl.float32), axis=0)
    log_f = tl.minimum(fg, 0.0) - tl.log(1.0 + tl.exp(-tl.abs(fg)))        # logsigmoid, no overflow
    if HAS_STATE:
        m = tl.load(m_ptr + bh).to(tl.float32)
    else:
        m = 0.0
    m_new = tl.maximum(log_f + m, ig)
    fa = tl.exp(log_f + m - m_new)
    ia = tl.exp(ig - m_new)
    vt = tl.load(v_ptr + bh64 * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    num = tl.zeros([BV], dtype=tl.float32)
    qn = tl.zeros([BK], dtype=tl.float32)
    first = pid_v == 0
    for kt in range((K + BK - 1) // BK):
        offs_k = kt * BK + tl.arange(0, BK)
        mk = offs_k < K
        qt = tl.load(q_ptr + bh64 * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        kk = tl.load(k_ptr + bh64 * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        kv_off = bh64 * K * V + offs_k[:, None] * V + offs_v[None, :]
        mkv = mk[:, None] & mv[None, :]
        if HAS_STATE:
            n = tl.load(n_ptr + bh64 * K + offs_k, mask=mk, other=0.0)
            C = tl.load(c_ptr + kv_off, mask=mkv, other=0.0)
            n = fa * n + ia * kk
            C = fa * C + ia * kk[:, None] * vt[None, :]
        else:
            n = ia * kk
            C = ia * kk[:, None] * vt[None, :]
        tl.store(no_ptr + bh64 * K + offs_k, n, mask=mk & first)
        tl.store(co_ptr + kv_off, C, mask=mkv)
        qn += qt * n
        num += tl.sum(qt[:, None] * C, axis=0)
    den = tl.maximum(tl.abs(tl.sum(qn, axis=0) * scale), tl.exp(-m_new)) + eps
    tl.store(h_ptr + bh64 * V + offs_v, (num * scale / den).to(h_ptr.dtype.element_ty), mask=mv)
    tl.store(mo_ptr + bh, m_new, mask=first)


def _launch(q, k, v, i, f, C, n, m, h, C_new, n_new, m_new, eps: float, block_v: int) -> None:
    B, H, K = q.shape
    V = v.shape[-1]
    has_state = C is not None
    if not has_state:
        C = n = m = m_new
    # V-tiles narrow enough for ~512 programs (a batch-1 step has only B·H heads: too few
    # loads in flight to stream the state), at least 16 wide (each program re-reads q, k, n)
    BV = block_v or min(64, triton.next_power_of_2(V), max(16, triton.next_power_of_2(V * B * H // 512)))
    BK = min(triton.next_power_of_2(K), max(16, 8192 // BV))
    NP = i.shape[-1] if i.dim() == 3 else 1
    _step_kernel[(B * H, triton.cdiv(V, BV))](
        q, k, v, i, f, C, n, m, h, C_new, n_new, m_new, K ** -0.5, eps,
        K=K, V=V, BK=BK, BV=BV, HAS_STATE=has_state, NP=NP, NPP=triton.next_power_of_2(NP), num_warps=4,
    )


def _step(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor,
    C: Optional[Tensor], n: Optional[Tensor], m: Optional[Tensor], eps: float, block_v: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k [B,H,K]; v [B,H,V]; i, f [B,H] contiguous; C, n, m float32 contiguous or all None;
    block_v the V-tile (0: by shape) → (h [B,H,V] in q's dtype, C', n', m' float32)."""
    h, C_new, n_new, m_new = _step_buffers(q, v)
    _launch(q, k, v, i, f, C, n, m, h, C_new, n_new, m_new, eps, block_v)
    return h, C_new, n_new, m_new


def _step_(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, C: Tensor, n: Tensor, m: Tensor,
           eps: float, block_v: int) -> tuple[Tensor, Tensor, Tensor]:
    """_step writing C' into C (float32 contiguous) → (h, n', m')."""
    h, n_new, m_new = _step_buffers(q, v, with_c=False)
    _launch(q, k, v, i, f, C, n, m, h, C, n_new, m_new, eps, block_v)
    return h, n_new, m_new


mlstm_step_op = torch.library.custom_op("xlstm_kit::mlstm_step", _step, mutates_args=())
mlstm_step_inplace_op = torch.library.custom_op("xlstm_kit::mlstm_step_", _step_, mutates_args=("C",))


@mlstm_step_op.register_fake
def _(q, k, v, i, f, C, n, m, eps, block_v):
    return _step_buffers(q, v)


@mlstm_step_inplace_op.register_fake
def _(q, k, v, i, f, C, n, m, eps, block_v):
    return _step_buffers(q, v, with_c=False)


def _step_buffers(q, v, with_c: bool = True):
    B, H, K = q.shape
    V = v.shape[-1]
    f32 = dict(device=q.device, dtype=torch.float32)
    h = torch.empty(B, H, V, device=q.device, dtype=q.dtype)
    rest = (torch.empty(B, H, K, **f32), torch.empty(B, H, **f32))
    return (h, torch.empty(B, H, K, V, **f32), *rest) if with_c else (h, *rest)


def mlstm_step_triton(q, k, v, i, f, state, *, eps: float = 1e-6, block_v: int | None = None,
                      inplace: bool = False):
    """One decode step. q, k [B,H,K]; v [B,H,V]; i, f [B,H]; state (C [B,H,K,V], n [B,H,K],
    m [B,H]) or None for zeros → (h [B,H,V] in q's dtype, new float32 state). Inputs are assumed
    validated by the caller (xlstm_kit.ops.mlstm; inplace: C float32 contiguous); the old state
    is left untouched unless `inplace`, which writes C' into the state's C and returns it."""
    inputs = (q.contiguous(), k.contiguous(), v.contiguous(), i.contiguous(), f.contiguous())
    compiling = torch.compiler.is_compiling()
    if inplace:
        C = state[0]
        # eagerly without the dispatcher (tens of µs per call, a batch-1 step's kernel takes ~11 µs)
        h, n, m = (mlstm_step_inplace_op if compiling else _step_)(
            *inputs, C, state[1].float().contiguous(), state[2].float().contiguous(), float(eps), block_v or 0)
        return h, (C, n, m)
    C, n, m = (None, None, None) if state is None else (s.float().contiguous() for s in state)
    h, C, n, m = (mlstm_step_op if compiling else _step)(*inputs, C, n, m, float(eps), block_v or 0)
    return h, (C, n, m)
