"""Small building blocks shared by the mLSTM and sLSTM layers.

Layout everywhere: [B, T, C] for sequences, [B, C] for one step. Recurrent state that a piece
carries between calls (the causal convolution's last inputs) is kept in float32 (float64 for
float64 models), like every recurrent state in xlstm_kit.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import XLSTMKitError
from .fused import (activation_dtype, bmm_into, conv_silu, conv_state, conv_state_varlen, doc_positions,
                    gelu_mul_linear, head_norm, norm_up)
from .lora import lora_weight


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of recurrent states for a model whose parameters are in `dtype`."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def round_up(x: float, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= x (the official package's width rounding)."""
    return int(math.ceil(x / multiple) * multiple)


# ----------------------------------------------------------------------------- initialisation
def small_init_(weight: torch.Tensor, dim: int) -> torch.Tensor:
    """Normal(0, sqrt(2 / (5 dim))): "small init" of Nguyen & Salazar (2019), as in xLSTM."""
    return nn.init.normal_(weight, mean=0.0, std=math.sqrt(2.0 / (5.0 * dim)))


def wang_init_(weight: torch.Tensor, dim: int, n_blocks: int) -> torch.Tensor:
    """Normal(0, 2 / (n_blocks sqrt(dim))) for projections that write into the residual stream."""
    return nn.init.normal_(weight, mean=0.0, std=2.0 / n_blocks / math.sqrt(dim))


# ----------------------------------------------------------------------------- normalisation
class MultiHeadNorm(nn.Module):
    """Head-wise LayerNorm (a GroupNorm with one group per head) with a per-channel scale.

    forward(x [..., H, D]) -> [..., H, D] in x's dtype: each head's D features are normalised on
    their own (float32 statistics), then multiplied by `weight` [H * D].
    """

    def __init__(self, n_heads: int, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.n_heads, self.head_dim, self.eps = n_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(n_heads * head_dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return head_norm(x, self.weight, self.eps)


# ----------------------------------------------------------------------------- causal conv
class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time with bias, carrying its last inputs as state.

    y[t, c] = bias[c] + sum_j weight[c, j] * x[t - (K-1) + j, c]   (K = kernel_size; x[<0] = state)

    forward(x [B, T, C], state [B, K-1, C] | None, cu_seqlens=None) -> (y [B, T, C], new_state [B, K-1, C])
        (cu_seqlens [N+1]: documents packed in x [1, T, C] from zeros; new_state [N, K-1, C])
    step(x [B, C], state [B, K-1, C]) -> (y [B, C], new_state)
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        if kernel_size < 1:
            raise XLSTMKitError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # PyTorch's default Conv1d init (fan_in = kernel_size for a depthwise conv), as the
        # official package leaves it.
        bound = 1.0 / math.sqrt(self.kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def init_state(self, batch: int, device=None, dtype=None) -> torch.Tensor:
        device = self.weight.device if device is None else device
        dtype = state_dtype(self.weight.dtype) if dtype is None else dtype
        return torch.zeros(batch, self.kernel_size - 1, self.channels, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None):
        if cu_seqlens is None:
            y = conv_silu(x, state, self.weight, self.bias, act=False)
            return y, conv_state(x, state, self.kernel_size).to(state_dtype(x.dtype))
        y = conv_silu(x, state, self.weight, self.bias, act=False, pos=doc_positions(cu_seqlens, x.shape[1]))
        return y, conv_state_varlen(x, cu_seqlens, self.kernel_size).to(state_dtype(x.dtype))

    def step(self, x: torch.Tensor, state: torch.Tensor):
        window = torch.cat([state.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
        y = self.bias.to(x.dtype) + (window * self.weight.to(x.dtype).t()).sum(dim=1)
        return y, window[:, 1:].to(state.dtype).contiguous()  # the strides of forward's state


# ----------------------------------------------------------------------------- head-wise linear
def _pack_factor(n_heads: int, head_dim: int, target: int = 16) -> int:
    """How many heads to pack into one dense diagonal block: the largest divisor G of n_heads
    with G * head_dim <= target (at least 1)."""
    best = 1
    for g in range(1, min(n_heads, target // max(head_dim, 1)) + 1):  # g * head_dim <= target bounds g
        if n_heads % g == 0 and g * head_dim <= target:
            best = g
    return best


def _packed_blocks(w: torch.Tensor, g: int) -> torch.Tensor:
    """[H, d, d] head blocks -> [H/g, g*d, g*d] dense blocks holding g heads on their diagonal."""
    H, d, _ = w.shape
    eye = torch.eye(g, dtype=w.dtype, device=w.device)
    blocks = w.view(H // g, g, 1, d, d) * eye.view(1, g, g, 1, 1)  # [n, a, b, o, i], zero unless a == b
    return blocks.permute(0, 1, 3, 2, 4).reshape(H // g, g * d, g * d)


def _packed_bmm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """y[:, block p] = x[:, block p] @ blocks[p]ᵀ for x [N, C] and blocks [P, c, c] (C = P c).

    The strided views let BLAS read and write the [N, C] layout directly: no transposed copies.
    """
    N, C = x.shape
    P, c, _ = blocks.shape
    y = torch.empty_like(x)
    bmm_into(x.view(N, P, c).transpose(0, 1), blocks.transpose(1, 2), y.view(N, P, c).transpose(0, 1))
    return y


class _HeadwiseLinearFn(torch.autograd.Function):
    """Block-diagonal linear map with a hand-written backward.

    Why: autograd of einsum over hundreds of 4x4 heads moves the data many times; packing g
    heads into one (g d)-wide dense block turns forward, input gradient and weight gradient into
    one batched matmul each, at a few times the (tiny) FLOP count of the exact product.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, g: int) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.g = g
        return _packed_bmm(x, _packed_blocks(w, g))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        g = ctx.g
        H, d, _ = w.shape
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _packed_bmm(dy, _packed_blocks(w, g).transpose(1, 2))
        if ctx.needs_input_grad[1]:
            dw = headwise_weight_grad(dy, x, H, g)
        return dx, dw, None


def headwise_weight_grad(dy: torch.Tensor, x: torch.Tensor, H: int, g: int) -> torch.Tensor:
    """Gradient [H, d, d] of the head blocks of y = blockdiag(w) x for dy, x [N, C] contiguous,
    packing g heads per batched matmul (see _HeadwiseLinearFn)."""
    N, C = x.shape
    d = C // H
    P, c = H // g, g * d
    full = torch.bmm(dy.view(N, P, c).permute(1, 2, 0), x.view(N, P, c).transpose(0, 1))  # [P, c, c]
    # keep the diagonal d x d blocks: [P, a, o, b, i] at a == b -> [P, o, i, a] -> [H, o, i]
    return full.view(P, g, d, g, d).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(H, d, d)


class HeadwiseLinear(nn.Module):
    """Block-diagonal linear map: the C input features are split into H heads of C/H features
    and each head has its own (C/H x C/H) matrix.

    weight [H, out_per_head, in_per_head] (the official package's layout); forward(x [..., C]) -> [..., C].
    """

    def __init__(self, features: int, n_heads: int, bias: bool = False):
        super().__init__()
        if features % n_heads:
            raise XLSTMKitError(f"features={features} must be divisible by n_heads={n_heads}")
        self.features, self.n_heads = features, n_heads
        d = features // n_heads
        self.pack = _pack_factor(n_heads, d)
        self.weight = nn.Parameter(torch.empty(n_heads, d, d))
        self.bias = nn.Parameter(torch.zeros(features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        small_init_(self.weight, self.weight.shape[-1])
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def fold_into(self, w: torch.Tensor) -> torch.Tensor:
        """w [R, C] -> w @ blockdiag(weight) [R, C]: a linear map applied after this one, folded
        onto this one's input (its bias is not included)."""
        R = w.shape[0]
        d = self.features // self.n_heads
        folded = torch.einsum("rho,hoi->rhi", w.reshape(R, self.n_heads, d), self.weight.to(w.dtype))
        return folded.reshape(R, self.features)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """forward for one token x [B, C]: products and a sum over each head's inputs, which
        torch.compile fuses with their neighbours (a batched matmul of 4 x 4 blocks would be a
        launch of its own)."""
        B = x.shape[0]
        y = (x.view(B, self.n_heads, 1, -1) * self.weight.to(x.dtype)).sum(-1).view(B, self.features)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = _HeadwiseLinearFn.apply(x.reshape(-1, self.features).contiguous(), self.weight.to(x.dtype), self.pack)
        y = y.view(shape)
        return y if self.bias is None else y + self.bias


# ----------------------------------------------------------------------------- feed-forward
class GatedFeedForward(nn.Module):
    """Gated feed-forward: down(GELU(g) * u) with (g, u) = up(x) split in halves.

    forward(x [..., d_model]) -> [..., d_model]; hidden width `hidden`. Saves only x (or its
    bf16 copy) and the up-projection's output.
    """

    def __init__(self, d_model: int, hidden: int, *, n_blocks: int, bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.d_model, self.hidden, self.n_blocks = d_model, hidden, n_blocks
        self.up_proj = nn.Linear(d_model, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        small_init_(self.up_proj.weight, self.d_model)
        wang_init_(self.down_proj.weight, self.d_model, self.n_blocks)
        for lin in (self.up_proj, self.down_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor, *, norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """`norm`: a bias-free LayerNorm that x passes through first, fused with the up-projection
        (its normalised output is recomputed in the backward instead of kept)."""
        if norm is None:
            xa = x.to(activation_dtype(x))
            w_g, w_u = lora_weight(self.up_proj).chunk(2, dim=0)
            b_g, b_u = (None, None) if self.up_proj.bias is None else self.up_proj.bias.chunk(2)
            g, u = F.linear(xa, w_g, b_g), F.linear(xa, w_u, b_u)
        else:
            g, u = norm_up(x, norm.weight, norm.eps, lora_weight(self.up_proj), self.up_proj.bias)
        y = gelu_mul_linear(g, u, lora_weight(self.down_proj), self.down_proj.bias)
        return self.dropout(y) if self.dropout.p > 0 else y


class PreNormResidual(nn.Module):
    """x + layer(LayerNorm(x)), passing the layer's state through; the shared frame of the
    mLSTM and DPLR blocks. `layer` has forward(x, state, return_state), step and init_state."""

    def __init__(self, d_model: int, layer: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
        self.layer = layer

    def reset_parameters(self) -> None:
        self.norm.reset_parameters()
        self.layer.reset_parameters()

    def init_state(self, batch: int, device=None, dtype=None):
        return self.layer.init_state(batch, device, dtype)

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        # one cast to the activation dtype: under autocast the layer norm runs in float32, and
        # each matmul reading the float32 output would save its own bf16 copy
        return self.norm(x).to(activation_dtype(x))

    def forward(self, x: torch.Tensor, state=None, return_state: bool = False, cu_seqlens=None):
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if not return_state:
            return x + self.layer(self._normed(x), state, **kw)
        y, state = self.layer(self._normed(x), state, return_state=True, **kw)
        return x + y, state

    def step(self, x: torch.Tensor, state, inplace: bool = False):
        y, state = self.layer.step(self.norm(x), state, inplace=inplace)
        return x + y, state
