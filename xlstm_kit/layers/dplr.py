"""DPLR sequence-mixing layer and residual block, KDA-style (Kimi Delta Attention).

The KDA special case of the DPLR recurrence (a = k, b = β k, v ← β v):

    S_t = S_{t-1} Diag(α_t)(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ,   α_t = exp(g_t),   o_t = S_t q_t / √D

x -> q, k, v projections -> one causal depthwise conv + SiLU over (q, k, v) -> q, k L2-normalised
per head -> KDA memory (β, g from x) -> head-wise norm -> * sigmoid(output gate of x)
-> output projection. The block adds LayerNorm in front and the residual around it, like the
mLSTM block; there is no feed-forward inside.

Why KDA rather than the general (RWKV-7-style) DPLR: with a = k and b = β k the transition
I − β k kᵀ of a unit-norm k has eigenvalues 1 and 1 − β ∈ (0, 1), so the state cannot grow for any
input; a general a, b pair needs extra constraints to be stable.

Decay: g = −G_MAX · sigmoid(z) with z a linear map of x and G_MAX = 5, so every channel's log decay
lies in [−5, 0] per step (the range the DPLR kernels are built to handle without overflowing their
1/Γ factors) and stays smooth in z; the bias spreads the initial decays over time scales of about
2 to 1000 steps per head.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from xlstm_kit.ops.dplr import dplr_step, kda_chunkwise

from .common import PreNormResidual, CausalConv1d, MultiHeadNorm, small_init_, state_dtype, wang_init_
from ..errors import XLSTMKitError

G_MAX = 5.0  # largest per-step |log decay|


class DPLRState(NamedTuple):
    """Recurrent state of one DPLR layer; its size does not depend on the sequence length."""

    conv: torch.Tensor  # [B, K-1, 3 inner]  last (q, k, v) inputs of the causal convolution
    S: torch.Tensor  # [B, H, D, D]          memory (the ops' [B, H, K, V] layout)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / max(‖x‖, eps) over the last dim, in x's dtype: F.normalize under CUDA autocast returns
    float32 for bf16 x (its norm is an autocast-to-float32 op); the norm itself is taken in
    float32 (float64 for float64 x)."""
    nrm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=state_dtype(x.dtype))
    return x / nrm.clamp_min(eps).to(x.dtype)


class DPLRLayer(nn.Module):
    """KDA-style DPLR layer (without its LayerNorm and residual).

    forward(x [B, T, d_model], state=None, return_state=False) -> y [B, T, d_model]
        (or (y, new_state) with return_state=True); step(x [B, d_model], state) -> (y, new_state).
    `n_heads` heads of head_dim = d_model / n_heads (key and value width alike).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        conv_kernel_size: int = 4,
        n_blocks: int = 1,
        bias: bool = False,
        dropout: float = 0.0,
        chunk_size: int = 64,
        backend: str | None = None,
    ):
        super().__init__()
        if d_model % n_heads:
            raise XLSTMKitError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.n_blocks, self.chunk_size, self.backend = n_blocks, chunk_size, backend
        inner = d_model
        self.qkv_proj = nn.Linear(d_model, 3 * inner, bias=bias)
        self.conv = CausalConv1d(3 * inner, conv_kernel_size)
        self.beta_proj = nn.Linear(d_model, n_heads)
        self.decay_proj = nn.Linear(d_model, inner)
        self.gate_proj = nn.Linear(d_model, inner)
        self.out_norm = MultiHeadNorm(n_heads, self.head_dim)
        self.out_proj = nn.Linear(inner, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d = self.d_model
        for lin in (self.qkv_proj, self.beta_proj, self.decay_proj, self.gate_proj):
            small_init_(lin.weight, d)
        wang_init_(self.out_proj.weight, d, self.n_blocks)
        for lin in (self.qkv_proj, self.out_proj, self.beta_proj, self.gate_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)  # β = 1/2, output gate half open
        # |g| log-spaced over [1e-3, 0.5] across each head's channels: time scales ~2..1000 steps
        with torch.no_grad():
            mag = torch.logspace(math.log10(1e-3), math.log10(0.5), self.head_dim, dtype=torch.float64)
            z = torch.logit(mag / G_MAX).repeat(self.n_heads)
            self.decay_proj.bias.copy_(z.to(self.decay_proj.bias.dtype))
        self.conv.reset_parameters()
        self.out_norm.reset_parameters()

    def init_state(self, batch: int, device=None, dtype=None) -> DPLRState:
        """Zero state for `batch` sequences (float32, or float64 for a float64 layer)."""
        device = self.qkv_proj.weight.device if device is None else device
        dtype = state_dtype(self.qkv_proj.weight.dtype) if dtype is None else dtype
        H, D = self.n_heads, self.head_dim
        return DPLRState(self.conv.init_state(batch, device, dtype),
                         torch.zeros(batch, H, D, D, device=device, dtype=dtype))

    def _mix_inputs(self, x: torch.Tensor, qkv: torch.Tensor):
        """x [..., d_model], conv output qkv [..., 3 inner] -> q, k, v [..., H, D], β [..., H], g [..., H, D],
        all in the dtype of the activations qkv (v a view of them, no copy).

        One dtype for all five is the kernels' fast path: with bf16 activations and float32 gates
        the Triton op keeps the gate gradient's products at float32 accuracy (slower; ops/dplr/
        triton/config.py), and a float32 q would make the output and its products float32."""
        lead, H, D = x.shape[:-1], self.n_heads, self.head_dim
        q, k, v = F.silu(qkv).view(*lead, 3, H, D).unbind(-3)
        q, k = _l2norm(q), _l2norm(k)
        beta = torch.sigmoid(self.beta_proj(x)).to(v.dtype)
        g = (-G_MAX * torch.sigmoid(self.decay_proj(x))).view(*lead, H, D).to(v.dtype)
        return q, k, v, beta, g

    def _out(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = self.out_norm(h).flatten(-2)
        return self.dropout(self.out_proj(h * torch.sigmoid(self.gate_proj(x))))

    def forward(self, x: torch.Tensor, state: DPLRState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        """`cu_seqlens` [N+1]: documents packed in x [1, T, d], each from the zero state (state
        None); the returned state has N rows."""
        qkv, conv_state = self.conv(self.qkv_proj(x), None if state is None else state.conv, cu_seqlens)
        q, k, v, beta, g = self._mix_inputs(x, qkv)
        h, S = kda_chunkwise(q, k, v, g, beta, initial_state=None if state is None else state.S,
                             output_final_state=return_state, chunk_size=self.chunk_size,
                             backend=self.backend, cu_seqlens=cu_seqlens)  # h [B, T, H, D]
        y = self._out(x, h)
        return (y, DPLRState(conv_state, S)) if return_state else y

    def step(self, x: torch.Tensor, state: DPLRState, inplace: bool = False):
        """One token: x [B, d_model] -> (y [B, d_model], new_state). inplace (the caller gives the
        old state up) is accepted for a common block interface; S is written anew."""
        qkv, conv_state = self.conv.step(self.qkv_proj(x), state.conv)
        q, k, v, beta, g = self._mix_inputs(x, qkv)
        # the KDA substitution, formed in compute precision as kda_chunkwise does
        cd = state_dtype(x.dtype)
        kc, beta = k.to(cd), beta.to(cd).unsqueeze(-1)
        h, S = dplr_step(q, kc, v.to(cd) * beta, kc, kc * beta, g, state.S)  # h [B, H, D]
        return self._out(x, h.to(x.dtype)), DPLRState(conv_state, S)


class DPLRBlock(PreNormResidual):
    """Residual DPLR block: x + DPLRLayer(LayerNorm(x)). Same interface as DPLRLayer."""

    supports_cu_seqlens = True
    cu_seqlens_needs_zero_state = True  # the convolution's per-document state is not read in

    def __init__(self, d_model: int, n_heads: int, **layer_kwargs):
        super().__init__(d_model, DPLRLayer(d_model, n_heads, **layer_kwargs))
