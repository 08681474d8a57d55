"""sLSTM layer and residual block (post up-projection; paper section 2.4, figure 10 left).

x -> causal conv1d + SiLU feeding the input and forget gates (z and o see x directly; with
conv_kernel_size=0 there is no convolution and all four gates see x, the paper's formal-language
configuration) ->
head-wise block-diagonal gate projections -> sLSTM with head-wise recurrent weights ->
head-wise norm. The block: x + sLSTMLayer(LayerNorm(x)), then x + GatedFFN(LayerNorm(x)).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from xlstm_kit.ops.backend import BackendUnavailableError, choose_backend
from xlstm_kit.ops.slstm import slstm_recurrent, slstm_step

from .common import CausalConv1d, GatedFeedForward, MultiHeadNorm, small_init_, state_dtype
from .fused import activation_dtype, conv_state, conv_state_varlen, doc_positions, head_norm
from .fused_slstm import slstm_gates
from .padding import conv_state_at, gates_off_past
from .lora import lora_weight
from ..errors import XLSTMKitError


class SLSTMState(NamedTuple):
    """Recurrent state of one sLSTM layer; its size does not depend on the sequence length."""

    conv: torch.Tensor  # [B, K-1, d_model]  last inputs of the causal convolution ([B, 0, d_model] without one)
    h: torch.Tensor  # [B, H, D]  hidden state (fed back through the recurrent weights)
    c: torch.Tensor  # [B, H, D]  cell state
    n: torch.Tensor  # [B, H, D]  normaliser
    m: torch.Tensor  # [B, H, D]  stabiliser


def powerlaw_forget_bias(head_dim: int, block_index: int, n_blocks: int) -> torch.Tensor:
    """Forget-gate bias of the official "powerlaw_blockdependent" init, [head_dim].

    Per head the biases run from 5 down to -7 along a power curve whose exponent grows with the
    depth of the block (0.3 in the first block, 1.6 in the last), so deeper sLSTM blocks start
    with more long-memory units.
    """
    depth = block_index / (n_blocks - 1) if n_blocks > 1 else 0.0
    # linspace(0, 1, D) == arange(D) / (D - 1), and stays finite for D = 1
    return 5.0 - 12.0 * torch.linspace(0.0, 1.0, head_dim) ** (0.3 + 1.3 * depth)


RECURRENT_INITS = ("zeros", "standard")
"""Recurrent-weight inits of the official sLSTM cell: zeros, or uniform(+-1/sqrt(d_model))."""
BIAS_INITS = ("powerlaw_blockdependent", "small_init", "zeros", "standard")
"""Gate-bias inits of the official sLSTM cell: the forget bias by powerlaw_forget_bias or
linspace(3, 6) (small_init) and the other gates zero; all zero; or all uniform(+-1/sqrt(d_model))."""


def _check_init(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise XLSTMKitError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def headwise_gates(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """Gate pre-activations without a convolution: x [B, T, H*D], gate_w [4, H, D_out, D_in]
    -> [B, T, 4, H, D_out] (every gate maps x itself, head by head)."""
    B, T, _ = x.shape
    _, H, D, _ = gate_w.shape
    return torch.einsum("bthi,ghoi->btgho", x.view(B, T, H, D), gate_w.to(x.dtype))


class SLSTMLayer(nn.Module):
    """The sLSTM layer (without its LayerNorm, residual and feed-forward).

    forward(x [B, T, d_model], state=None, return_state=False) -> y [B, T, d_model]
        (or (y, new_state)); step(x [B, d_model], state) -> (y, new_state).
    Parameters: gate_weight [4, H, D, D] head-wise input maps (gate order i, f, z, o; each head
    maps its D input features by W [D_out, D_in]), recurrent [4, H, D, D] (D_in x D_out, used as
    h_{t-1} R), bias [4, H, D].
    conv_kernel_size=0: no convolution (no conv parameters; the state's conv is [B, 0, d_model]).
    recurrent_init (RECURRENT_INITS) and bias_init (BIAS_INITS) choose the official cell's
    initialisations; the defaults (zeros, powerlaw_blockdependent) are the language-model ones.
    """

    GATES = ("i", "f", "z", "o")

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        conv_kernel_size: int = 4,
        block_index: int = 0,
        n_blocks: int = 1,
        dropout: float = 0.0,
        backend: str | None = None,
        recurrent_init: str = "zeros",
        bias_init: str = "powerlaw_blockdependent",
    ):
        super().__init__()
        _check_init("recurrent_init", recurrent_init, RECURRENT_INITS)
        _check_init("bias_init", bias_init, BIAS_INITS)
        if conv_kernel_size < 0:
            raise XLSTMKitError(f"conv_kernel_size must be >= 0 (0: no convolution), got {conv_kernel_size}")
        self.recurrent_init, self.bias_init = recurrent_init, bias_init
        if d_model % n_heads:
            raise XLSTMKitError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.block_index, self.n_blocks, self.backend = block_index, n_blocks, backend
        H, D = n_heads, self.head_dim
        self.conv = CausalConv1d(d_model, conv_kernel_size) if conv_kernel_size > 0 else None
        self.gate_weight = nn.Parameter(torch.empty(4, H, D, D))
        self.recurrent = nn.Parameter(torch.empty(4, H, D, D))
        self.bias = nn.Parameter(torch.empty(4, H, D))
        self.out_norm = MultiHeadNorm(H, D)
        self.dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.conv is not None:
            self.conv.reset_parameters()
        small_init_(self.gate_weight, self.d_model)
        bound = self.d_model ** -0.5  # the official cell's hidden_size is the layer's width
        if self.recurrent_init == "standard":
            nn.init.uniform_(self.recurrent, -bound, bound)
        else:
            nn.init.zeros_(self.recurrent)
        with torch.no_grad():
            self.bias.zero_()
            if self.bias_init == "powerlaw_blockdependent":
                self.bias[1] = powerlaw_forget_bias(self.head_dim, self.block_index, self.n_blocks)
            elif self.bias_init == "small_init":
                self.bias[1] = torch.linspace(3.0, 6.0, self.head_dim)
            elif self.bias_init == "standard":
                nn.init.uniform_(self.bias, -bound, bound)
        self.out_norm.reset_parameters()

    def init_state(self, batch: int, device=None, dtype=None) -> SLSTMState:
        """Zero state for `batch` sequences (float32, or float64 for a float64 layer)."""
        device = self.bias.device if device is None else device
        dtype = state_dtype(self.bias.dtype) if dtype is None else dtype
        zeros = lambda: torch.zeros(batch, self.n_heads, self.head_dim, device=device, dtype=dtype)  # noqa: E731
        conv = (self.conv.init_state(batch, device, dtype) if self.conv is not None
                else torch.zeros(batch, 0, self.d_model, device=device, dtype=dtype))
        return SLSTMState(conv, zeros(), zeros(), zeros(), zeros())

    def _norm(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H, D] -> out_norm(dropout(h)) [..., H*D] (dropout before the norm, as upstream)."""
        h = self.dropout(h) if self.dropout.p > 0 else h
        return head_norm(h, self.out_norm.weight, self.out_norm.eps, self.backend).flatten(-2)

    def forward(self, x: torch.Tensor, state: SLSTMState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, lengths: torch.Tensor | None = None):
        """`cu_seqlens` [N+1]: documents packed in x [1, T, d], each from the zero state (state
        None); the returned state has N rows. `lengths` [B]: row b's steps from lengths[b] on
        are padding: they leave the state as it was (the returned state is the one after
        lengths[b] steps; their outputs mean nothing)."""
        x = x.to(activation_dtype(x))
        conv_in = None if state is None else state.conv
        pos = None if cu_seqlens is None else doc_positions(cu_seqlens, x.shape[1])
        gates = self._gates(x, conv_in, pos)  # [B, T, 4, H, D]
        if lengths is not None:
            # c, n and m stand still past lengths[b]; h (o c / n) does not, its state is taken
            # from the output at the last real step below
            i, f = gates_off_past(gates[:, :, 0], gates[:, :, 1], lengths)
            gates = torch.cat([i[:, :, None], f[:, :, None], gates[:, :, 2:]], dim=2)
        h, cell_state = slstm_recurrent(
            gates, self.recurrent, self.bias,
            initial_state=None if state is None else (state.h, state.c, state.n, state.m),
            output_final_state=return_state,
            backend=self.backend, cu_seqlens=cu_seqlens,
        )  # h [B, T, H, D]
        y = self._norm(h)
        if not return_state:
            return y
        if lengths is not None:
            last = (lengths.to(h.device, torch.long) - 1).view(-1, 1, 1, 1).expand(-1, 1, *h.shape[2:])
            cell_state = (h.gather(1, last)[:, 0].to(cell_state[0].dtype), *cell_state[1:])
            new_conv = (x.new_zeros(x.shape[0], 0, x.shape[2]) if self.conv is None
                        else conv_state_at(x, conv_in, self.conv.kernel_size, lengths))
        else:
            new_conv = self._conv_state(x, conv_in, cu_seqlens)
        return y, SLSTMState(new_conv.to(state_dtype(x.dtype)), *cell_state)

    def _gates(self, x: torch.Tensor, conv_in: torch.Tensor | None, pos: torch.Tensor | None = None) -> torch.Tensor:
        """Gate pre-activations [B, T, 4, H, D]; `pos`: each step's position in its document (packed x)."""
        if self.conv is None:
            return headwise_gates(x, self.gate_weight)
        return slstm_gates(x, conv_in, self.conv.weight, self.conv.bias, self.gate_weight, self.backend, pos)

    def _conv_state(self, x: torch.Tensor, conv_in: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """The convolution's state after x: [B, K-1, d], or one row per document of packed x."""
        rows = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if self.conv is None:
            return x.new_zeros(rows, 0, x.shape[2])
        if cu_seqlens is not None:
            return conv_state_varlen(x, cu_seqlens, self.conv.kernel_size)
        return conv_state(x, conv_in, self.conv.kernel_size)

    def step(self, x: torch.Tensor, state: SLSTMState, inplace: bool = False):
        """One token: x [B, d_model] -> (y [B, d_model], new_state). inplace (the caller gives the
        old state up) is accepted for a common block interface; the small state is written anew."""
        x = x.to(activation_dtype(x))[:, None]
        gates = self._gates(x, state.conv)[:, 0]
        new_conv = self._conv_state(x, state.conv).to(state.conv.dtype)
        h, cell_state = slstm_step(gates, self.recurrent, self.bias, (state.h, state.c, state.n, state.m))
        y = self._norm(h)
        return y, SLSTMState(new_conv, *cell_state)


class SLSTMBlock(nn.Module):
    """Residual sLSTM block: x + sLSTMLayer(LN(x)), then x + GatedFeedForward(LN(x)).

    Same interface as SLSTMLayer (conv_kernel_size=0, recurrent_init, bias_init as there);
    `ffn_dim` is the feed-forward hidden width.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        ffn_dim: int,
        *,
        conv_kernel_size: int = 4,
        block_index: int = 0,
        n_blocks: int = 1,
        bias: bool = False,
        dropout: float = 0.0,
        backend: str | None = None,
        recurrent_init: str = "zeros",
        bias_init: str = "powerlaw_blockdependent",
    ):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
        self.layer = SLSTMLayer(
            d_model, n_heads, conv_kernel_size=conv_kernel_size, block_index=block_index,
            n_blocks=n_blocks, dropout=dropout, backend=backend, recurrent_init=recurrent_init,
            bias_init=bias_init,
        )
        self.ffn_norm = nn.LayerNorm(d_model, eps=1e-5, bias=False)
        self.ffn = GatedFeedForward(d_model, ffn_dim, n_blocks=n_blocks, bias=bias, dropout=dropout)

    def reset_parameters(self) -> None:
        for module in (self.norm, self.layer, self.ffn_norm, self.ffn):
            module.reset_parameters()

    def init_state(self, batch: int, device=None, dtype=None) -> SLSTMState:
        return self.layer.init_state(batch, device, dtype)

    supports_cu_seqlens = True
    cu_seqlens_needs_zero_state = True  # the convolution's per-document state is not read in

    supports_lengths = True

    def forward(self, x: torch.Tensor, state: SLSTMState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, lengths: torch.Tensor | None = None):
        out = self.layer(self.norm(x), state, return_state=return_state, cu_seqlens=cu_seqlens, lengths=lengths)
        y, state = out if return_state else (out, None)
        x = x + y
        x = x + self.ffn(x, norm=self.ffn_norm)  # the norm fused with the up-projection
        return (x, state) if return_state else x

    def step(self, x: torch.Tensor, state: SLSTMState, inplace: bool = False):
        """One token: x [B, d_model] -> (x', new_state); on CUDA at small batch the three launches
        of ops/blocks/slstm_decode.py, else the PyTorch step. The small state is written anew
        (`inplace` is accepted for the common block interface)."""
        if self._fused_step(x, state):
            return self.fused_step(x, state)
        y, state = self.layer.step(self.norm(x), state, inplace=inplace)
        x = x + y
        return x + self.ffn(self.ffn_norm(x)), state

    def fused_step(self, x: torch.Tensor, state: SLSTMState):
        """`step` in the three Triton launches of ops/blocks/slstm_decode.py, at any batch:
        x [B, d_model] and a float32 `SLSTMState` → (x', new state)."""
        # imported here: Triton is an optional extra, and the sequence path never needs it
        from ..ops.blocks.slstm_decode import slstm_block_step

        layer = self.layer
        # without a convolution any tensor stands in for its parameters: the kernel never reads them
        conv_w, conv_b = (layer.conv.weight, layer.conv.bias) if layer.conv is not None else (layer.bias,) * 2
        y, *new = slstm_block_step(
            x.contiguous(), self.norm.weight, conv_w, conv_b, layer.gate_weight, layer.recurrent, layer.bias,
            layer.out_norm.weight, self.ffn_norm.weight, lora_weight(self.ffn.up_proj), lora_weight(self.ffn.down_proj),
            state.conv.contiguous(), *(s.contiguous() for s in state[1:]),
            0 if layer.conv is None else layer.conv.kernel_size, float(self.norm.eps), float(layer.out_norm.eps),
            float(self.ffn_norm.eps))
        return y, SLSTMState(*new)

    def _fused_step(self, x: torch.Tensor, state: SLSTMState) -> bool:
        layer = self.layer
        if state.c.dtype != torch.float32 or (self.training and layer.dropout.p > 0):
            return False
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        bias = self.ffn.up_proj.bias is not None or self.ffn.down_proj.bias is not None
        try:
            return choose_backend("slstm_block_step", layer.backend, x.device, (x,), dtype=x.dtype, batch=x.shape[0],
                                  requires_grad=needs_grad, bias=bias) == "triton"
        except BackendUnavailableError:
            return False  # a layer forced to "triton" means its sequence kernels; the step falls back
