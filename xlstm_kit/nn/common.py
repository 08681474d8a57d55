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

    forward(x [..., H, D]) -> [..., H, D]: each head's D features are normalised on their own,
    then multiplied by `weight` [H * D].
    """

    def __init__(self, n_heads: int, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.n_heads, self.head_dim, self.eps = n_heads, head_dim, eps
        self.weight = nn.Parameter(torch.ones(n_heads * head_dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x, (self.head_dim,), eps=self.eps)
        return y * self.weight.view(self.n_heads, self.head_dim)


# ----------------------------------------------------------------------------- causal conv
class CausalConv1d(nn.Module):
    """Depthwise causal convolution over time with bias, carrying its last inputs as state.

    y[t, c] = bias[c] + sum_j weight[c, j] * x[t - (K-1) + j, c]   (K = kernel_size; x[<0] = state)

    forward(x [B, T, C], state [B, K-1, C] | None) -> (y [B, T, C], new_state [B, K-1, C])
    step(x [B, C], state [B, K-1, C]) -> (y [B, C], new_state)
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
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

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None):
        B, T, C = x.shape
        K = self.kernel_size
        if state is None:
            xp = F.pad(x, (0, 0, K - 1, 0))  # [B, T+K-1, C]
        else:
            xp = torch.cat([state.to(x.dtype), x], dim=1)
        # K shifted multiply-adds on the contiguous [B, T, C] layout: cheaper on CPU than
        # transposing to [B, C, T] for conv1d and back (and its slow depthwise backward).
        w = self.weight.to(x.dtype)
        y = torch.addcmul(self.bias.to(x.dtype), xp[:, 0:T], w[:, 0])
        for j in range(1, K):
            y = torch.addcmul(y, xp[:, j : j + T], w[:, j])
        return y, xp[:, T:].to(state_dtype(x.dtype))  # the last K-1 inputs

    def step(self, x: torch.Tensor, state: torch.Tensor):
        window = torch.cat([state.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
        y = self.bias.to(x.dtype) + (window * self.weight.to(x.dtype).t()).sum(dim=1)
        return y, window[:, 1:].to(state.dtype)


# ----------------------------------------------------------------------------- head-wise linear
class HeadwiseLinear(nn.Module):
    """Block-diagonal linear map: the C input features are split into H heads of C/H features
    and each head has its own (C/H x C/H) matrix.

    weight [H, out_per_head, in_per_head] (the official package's layout); forward(x [..., C]) -> [..., C].
    """

    def __init__(self, features: int, n_heads: int, bias: bool = False):
        super().__init__()
        if features % n_heads:
            raise ValueError(f"features={features} must be divisible by n_heads={n_heads}")
        self.features, self.n_heads = features, n_heads
        d = features // n_heads
        self.weight = nn.Parameter(torch.empty(n_heads, d, d))
        self.bias = nn.Parameter(torch.zeros(features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        small_init_(self.weight, self.weight.shape[-1])
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        d = self.features // self.n_heads
        xh = x.reshape(-1, self.n_heads, d)  # [N, H, d]
        if d <= 8:
            # Tiny blocks (the mLSTM's 4x4 q/k/v maps, hundreds of heads): a few broadcast
            # multiply-adds beat a batched matmul of 4x4 matrices by far on CPU.
            w = self.weight.transpose(1, 2)  # [H, d_in, d_out]
            y = xh[:, :, 0:1] * w[:, 0]
            for j in range(1, d):
                y = torch.addcmul(y, xh[:, :, j : j + 1], w[:, j])
        else:
            y = torch.einsum("nhi,hoi->nho", xh, self.weight)
        y = y.reshape(shape)
        return y if self.bias is None else y + self.bias


# ----------------------------------------------------------------------------- feed-forward
class GatedFeedForward(nn.Module):
    """Gated feed-forward: down(GELU(g) * u) with (g, u) = up(x) split in halves.

    forward(x [..., d_model]) -> [..., d_model]; hidden width `hidden`.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.up_proj(x).chunk(2, dim=-1)
        return self.dropout(self.down_proj(F.gelu(g) * u))
