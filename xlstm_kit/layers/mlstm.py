"""mLSTM layer and residual block (pre up-projection; paper section 2.4, figure 10 right).

x -> up-projection into (x_m, z) -> causal conv1d + SiLU on x_m -> q, k (from the conv output)
and v (from x_m) through head-wise 4x4 block-diagonal maps -> input/forget gates, linear in
concat(q, k, v) -> mLSTM memory -> head-wise norm -> + learnable skip * conv output
-> * SiLU(z) -> down-projection. The block adds LayerNorm in front and the residual around it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from xlstm_kit.ops.backend import BackendUnavailableError, choose_backend
from xlstm_kit.ops.mlstm import mlstm_chunkwise, mlstm_step

from .lora import lora_weight
from .mlstm_cell import mlstm_cell
from .common import (PreNormResidual, CausalConv1d, HeadwiseLinear, MultiHeadNorm, _packed_blocks, _packed_bmm,
                     headwise_weight_grad, small_init_, state_dtype, wang_init_)
from .fused import (activation_dtype, conv_inputs, conv_recompute, conv_silu, conv_state,
                    conv_state_varlen, doc_positions, mlstm_output, norm_up, _tail_fwd_torch)
from .padding import conv_state_at, gates_off_past


class _ConvReadersFn(torch.autograd.Function):
    """The readers of x_conv = SiLU(conv(x_m)) before the mLSTM: q and k (head-wise maps) and
    x_conv's part of the gate pre-activations. Saves the conv's inputs (x_m is saved anyway)
    instead of x_conv and recomputes x_conv in the backward (one pass over [N, inner]).

    forward(x_conv [N, C], wq, wk [C/d, d, d], w_gates [2H, C], b [2H], pack, *conv_inputs)
        -> q, k [N, C], gates [N, 2H]
    """

    @staticmethod
    def forward(ctx, x_conv, wq, wk, w_gates, b, pack: int, cx, cstate, cw, cb, ckern, cpos):
        q = _packed_bmm(x_conv, _packed_blocks(wq, pack))
        k = _packed_bmm(x_conv, _packed_blocks(wk, pack))
        gates = torch.addmm(b, x_conv, w_gates.t())
        ctx.save_for_backward(wq, wk, w_gates, cx, cstate, cw, cb, cpos)
        ctx.pack, ctx.ckern = pack, ckern
        return q, k, gates

    @staticmethod
    def backward(ctx, dq, dk, dgates):
        wq, wk, w_gates, cx, cstate, cw, cb, cpos = ctx.saved_tensors
        g = ctx.pack
        x_conv = conv_recompute((cx, cstate, cw, cb, ctx.ckern, cpos)).view(-1, w_gates.shape[1])
        dq, dk, dgates = dq.contiguous(), dk.contiguous(), dgates.contiguous()
        dx = _packed_bmm(dq, _packed_blocks(wq, g).transpose(1, 2))
        dx += _packed_bmm(dk, _packed_blocks(wk, g).transpose(1, 2))
        dx.addmm_(dgates, w_gates)
        H = wq.shape[0]
        return (dx, headwise_weight_grad(dq, x_conv, H, g), headwise_weight_grad(dk, x_conv, H, g),
                dgates.t() @ x_conv, dgates.sum(0), None, None, None, None, None, None, None)


class MLSTMState(NamedTuple):
    """Recurrent state of one mLSTM layer; its size does not depend on the sequence length."""

    conv: torch.Tensor  # [B, K-1, inner]  last inputs of the causal convolution
    C: torch.Tensor  # [B, H, Dh, Dh]    matrix memory
    n: torch.Tensor  # [B, H, Dh]        normaliser
    m: torch.Tensor  # [B, H]            stabiliser


class ReadMaps(NamedTuple):
    """The weights a read without gradients derives from an mLSTM layer's parameters (see
    `MLSTMLayer.read_maps`)."""

    wq: torch.Tensor  # [P, c, c]  q's head blocks packed as _HeadwiseLinearFn packs them
    wk: torch.Tensor  # [P, c, c]
    wv: torch.Tensor  # [P, c, c]
    w_conv: torch.Tensor  # [2H, inner]  the gate maps folded through q, k (see _gate_weights)
    w_m: torch.Tensor  # [2H, inner]   ... and through v
    b: torch.Tensor  # [2H]


class MLSTMLayer(nn.Module):
    """The mLSTM layer of the pre up-projection block (without its LayerNorm and residual).

    forward(x [B, T, d_model], state=None, return_state=False) -> y [B, T, d_model]
        (or (y, new_state) with return_state=True); step(x [B, d_model], state) -> (y, new_state).
    The mLSTM runs on `inner_dim` = up-projected width split into `n_heads` heads.
    `recompute_states`: passed to `mlstm_chunkwise` (the kernels recompute their chunk states
    in the backward instead of keeping them).
    """

    def __init__(
        self,
        d_model: int,
        inner_dim: int,
        n_heads: int,
        *,
        conv_kernel_size: int = 4,
        qkv_block_size: int = 4,
        n_blocks: int = 1,
        bias: bool = False,
        dropout: float = 0.0,
        chunk_size: int = 64,
        backend: str | None = None,
        recompute_states: bool = False,
    ):
        super().__init__()
        self.recompute_states = recompute_states
        self.d_model, self.inner_dim, self.n_heads = d_model, inner_dim, n_heads
        self.head_dim = inner_dim // n_heads
        self.n_blocks, self.chunk_size, self.backend = n_blocks, chunk_size, backend

        self.up_proj = nn.Linear(d_model, 2 * inner_dim, bias=bias)
        self.conv = CausalConv1d(inner_dim, conv_kernel_size)
        n_qkv_heads = inner_dim // qkv_block_size
        self.q_proj = HeadwiseLinear(inner_dim, n_qkv_heads, bias=bias)
        self.k_proj = HeadwiseLinear(inner_dim, n_qkv_heads, bias=bias)
        self.v_proj = HeadwiseLinear(inner_dim, n_qkv_heads, bias=bias)
        self.igate = nn.Linear(3 * inner_dim, n_heads)
        self.fgate = nn.Linear(3 * inner_dim, n_heads)
        self.out_norm = MultiHeadNorm(n_heads, self.head_dim)
        self.skip = nn.Parameter(torch.ones(inner_dim))
        self.down_proj = nn.Linear(inner_dim, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        self._read_maps: tuple | None = None  # (key, ReadMaps) of read_maps
        self.reset_parameters()

    def reset_parameters(self) -> None:
        d = self.d_model
        small_init_(self.up_proj.weight, d)
        wang_init_(self.down_proj.weight, d, self.n_blocks)
        # q/k/v use the model width (not their own 4-wide blocks) for small init, like the
        # official package.
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            small_init_(proj.weight, d)
        for lin in (self.up_proj, self.down_proj, self.q_proj, self.k_proj, self.v_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        self.conv.reset_parameters()
        # Gates start input-independent: forget gates open (sigmoid(3..6) ~ 0.95..0.998, a
        # spread of memory time scales across heads), input gates near exp(0) = 1.
        nn.init.zeros_(self.fgate.weight)
        with torch.no_grad():
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, self.n_heads))
        nn.init.zeros_(self.igate.weight)
        nn.init.normal_(self.igate.bias, mean=0.0, std=0.1)
        self.out_norm.reset_parameters()
        nn.init.ones_(self.skip)

    def init_state(self, batch: int, device=None, dtype=None) -> MLSTMState:
        """Zero state for `batch` sequences (float32, or float64 for a float64 layer)."""
        device = self.up_proj.weight.device if device is None else device
        dtype = state_dtype(self.up_proj.weight.dtype) if dtype is None else dtype
        H, D = self.n_heads, self.head_dim
        return MLSTMState(
            conv=self.conv.init_state(batch, device, dtype),
            C=torch.zeros(batch, H, D, D, device=device, dtype=dtype),
            n=torch.zeros(batch, H, D, device=device, dtype=dtype),
            m=torch.zeros(batch, H, device=device, dtype=dtype),
        )

    def _up(self, x: torch.Tensor):
        """Up-projection into (x_m, z). Two matmuls on the halves of the weight give contiguous
        outputs (the halves of one wide output would be strided views that later ops copy)."""
        w_m, w_z = lora_weight(self.up_proj).chunk(2, dim=0)
        b_m, b_z = (None, None) if self.up_proj.bias is None else self.up_proj.bias.chunk(2)
        return F.linear(x, w_m, b_m), F.linear(x, w_z, b_z)

    def _gate_weights(self, dtype: torch.dtype):
        """(w_conv, w_m [2H, inner], b [2H]): the gate pre-activations [i, f] = x_conv w_convᵀ
        + x_m w_mᵀ + b. The gates are linear in concat(q, k, v), and q, k, v are block-diagonal
        maps of x_conv and x_m: folding those maps into the (2H x 3 inner) gate matrix reads two
        inner-wide inputs instead of writing and reading a 3x-wide concatenation."""
        w = torch.cat([lora_weight(self.igate), lora_weight(self.fgate)]).to(dtype)  # [2H, 3 inner]
        b = torch.cat([self.igate.bias, self.fgate.bias]).to(dtype)
        wq, wk, wv = w.split(self.inner_dim, dim=1)
        w_conv = self.q_proj.fold_into(wq) + self.k_proj.fold_into(wk)  # [2H, inner]
        w_m = self.v_proj.fold_into(wv)
        for proj, wg in ((self.q_proj, wq), (self.k_proj, wk), (self.v_proj, wv)):
            if proj.bias is not None:
                b = b + wg @ proj.bias.to(dtype)
        return w_conv, w_m, b

    def read_maps(self, dtype: torch.dtype) -> ReadMaps | None:
        """The weights derived from the parameters for a read without gradients, in `dtype`,
        kept while those parameters are unchanged (the same storage at the same version: an
        optimizer step, `load_state_dict` or `.to()` makes new ones). Derived afresh on every
        forward they are ~18 small kernels per block, a third of the kernels of a `125M` prompt
        piece (`benchmarks/results/2026-12-07-h100-prompt-pieces-padded.md`). None when adapters
        wrap the gates: whether those are active is no tensor's version."""
        if not (type(self.igate) is nn.Linear and type(self.fgate) is nn.Linear):
            return None
        sources = [t for t in (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.q_proj.bias,
                               self.k_proj.bias, self.v_proj.bias, self.igate.weight, self.igate.bias,
                               self.fgate.weight, self.fgate.bias) if t is not None]
        key = (dtype, *((t.data_ptr(), t._version) for t in sources))
        kept = getattr(self, "_read_maps", None)  # (absent from layers unpickled from before it)
        if kept is not None and kept[0] == key:
            return kept[1]
        with torch.no_grad():
            g = self.q_proj.pack
            blocks = [_packed_blocks(p.weight.to(dtype), g) for p in (self.q_proj, self.k_proj, self.v_proj)]
            maps = ReadMaps(*blocks, *self._gate_weights(dtype))
        # made while a CUDA graph records, they live in its memory pool: that graph's alone
        if not (maps.b.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._read_maps = (key, maps)
        return maps

    def _qkv_gates(self, x_m: torch.Tensor, x_conv: torch.Tensor, conv, maps: ReadMaps | None = None):
        """q, k, v [..., inner] and the gate pre-activations i, f [..., n_heads]; `conv` are
        x_conv's `conv_inputs` (the readers of x_conv recompute it in their backward). `maps`:
        read_maps (no gradients), else the weights are derived here."""
        dtype, C = x_m.dtype, self.inner_dim
        lead = x_m.shape[:-1]
        if maps is not None and maps.b.dtype == dtype:
            xc = x_conv.reshape(-1, C)
            q, k = _packed_bmm(xc, maps.wq), _packed_bmm(xc, maps.wk)
            gates = torch.addmm(maps.b, xc, maps.w_conv.t())
            v = _packed_bmm(x_m.reshape(-1, C).contiguous(), maps.wv).view(*lead, C)
            if self.v_proj.bias is not None:
                v = v + self.v_proj.bias
            w_m = maps.w_m
        else:
            w_conv, w_m, b = self._gate_weights(dtype)
            q, k, gates = _ConvReadersFn.apply(
                x_conv.reshape(-1, C), self.q_proj.weight.to(dtype), self.k_proj.weight.to(dtype),
                w_conv, b, self.q_proj.pack, *conv)
            v = self.v_proj(x_m)
        gates = torch.addmm(gates, x_m.reshape(-1, C), w_m.t())
        q, k = q.view(*lead, -1), k.view(*lead, -1)
        if self.q_proj.bias is not None:
            q, k = q + self.q_proj.bias, k + self.k_proj.bias
        i, f = gates.view(*lead, 2 * self.n_heads).chunk(2, dim=-1)
        return q, k, v, i, f

    def _output(self, h: torch.Tensor, x_conv: torch.Tensor, z: torch.Tensor, conv) -> torch.Tensor:
        """h [..., H, D], x_conv and z [..., inner] -> down((norm(h) + skip * x_conv) * SiLU(z))."""
        lead = x_conv.shape[:-1]
        y = mlstm_output(
            h.reshape(-1, self.n_heads, self.head_dim), x_conv.reshape(-1, self.inner_dim),
            z.reshape(-1, self.inner_dim), self.out_norm.weight, self.skip,
            lora_weight(self.down_proj), self.down_proj.bias, self.out_norm.eps, self.backend, conv,
        ).view(*lead, self.d_model)
        return self.dropout(y) if self.dropout.p > 0 else y

    def _cell_on_kernels(self, x_m: torch.Tensor) -> bool:
        """Whether the conv, the maps and the sequence op run as one `mlstm_cell` (Triton
        kernels, no q/k/v biases)."""
        if any(p.bias is not None for p in (self.q_proj, self.k_proj, self.v_proj)):
            return False
        try:
            return choose_backend("mlstm_chunkwise", self.backend, x_m.device, inputs=(x_m,), dtype=x_m.dtype,
                                  head_dims=(self.head_dim, self.head_dim)) == "triton"
        except BackendUnavailableError:
            return False

    def _cell(self, x_m: torch.Tensor, pos, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [B, T, H, D], x_conv [B, T, inner]) from the zero state through mlstm_cell."""
        dtype = x_m.dtype
        w_conv, w_m, b = self._gate_weights(dtype)
        return mlstm_cell(x_m, self.conv.weight, self.conv.bias, self.q_proj.weight.to(dtype),
                          self.k_proj.weight.to(dtype), self.v_proj.weight.to(dtype), w_conv, w_m, b,
                          n_heads=self.n_heads, pack=self.q_proj.pack, recompute_states=self.recompute_states,
                          backend=self.backend, pos=pos, cu_seqlens=cu_seqlens)

    def forward(self, x: torch.Tensor, state: MLSTMState | None = None, return_state: bool = False,
                *, norm: nn.LayerNorm | None = None, cu_seqlens: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, maps: ReadMaps | None = None):
        """`norm`: a bias-free LayerNorm that x passes through first, fused with the
        up-projection (the block's pre-norm; its normalised output is not kept for backward).
        `cu_seqlens` [N+1]: documents packed in x [1, T, d], each from the zero state (state
        None); the convolution masks its taps at the boundaries, the returned state has N rows.
        `lengths` [B]: row b's steps from lengths[b] on are padding: they leave the state as it
        was (the returned state is the one after lengths[b] steps; their outputs mean nothing).
        `maps`: `read_maps(...)` for a read without gradients (taken here where none are given
        and nothing is being compiled: under torch.compile the caller passes them in)."""
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        if norm is None:
            x_m, z = self._up(x.to(activation_dtype(x)))  # [B, T, inner] each
        else:
            x_m, z = norm_up(x, norm.weight, norm.eps, lora_weight(self.up_proj), self.up_proj.bias)
        conv_in = None if state is None else state.conv
        pos = None if cu_seqlens is None else doc_positions(cu_seqlens, T)
        conv = conv_inputs(x_m, conv_in, self.conv.weight, self.conv.bias, self.backend, pos)
        if state is None and not return_state and lengths is None and self._cell_on_kernels(x_m):
            h, x_conv = self._cell(conv[0], pos, cu_seqlens)
            return self._output(h, x_conv, z, conv)
        x_conv = conv_silu(x_m, conv_in, self.conv.weight, self.conv.bias, backend=self.backend, pos=pos)
        if maps is None and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            maps = self.read_maps(x_m.dtype)
        q, k, v, i, f = self._qkv_gates(x_m, x_conv, conv, maps if not torch.is_grad_enabled() else None)
        if lengths is not None:
            i, f = gates_off_past(i, f, lengths)
        h, cell_state = mlstm_chunkwise(
            q.view(B, T, H, D), k.view(B, T, H, D), v.view(B, T, H, D), i, f,
            initial_state=None if state is None else (state.C, state.n, state.m),
            output_final_state=return_state,
            chunk_size=self.chunk_size,
            backend=self.backend,
            recompute_states=self.recompute_states,
            cu_seqlens=cu_seqlens,
        )  # h [B, T, H, D]
        y = self._output(h, x_conv, z, conv)
        if not return_state:
            return y
        if lengths is not None:
            new_conv = conv_state_at(x_m, conv_in, self.conv.kernel_size, lengths)
        elif cu_seqlens is not None:
            new_conv = conv_state_varlen(x_m, cu_seqlens, self.conv.kernel_size)
        else:
            new_conv = conv_state(x_m, conv_in, self.conv.kernel_size)
        new_conv = new_conv.to(state_dtype(x_m.dtype))
        return y, MLSTMState(new_conv, *cell_state)

    def step(self, x: torch.Tensor, state: MLSTMState, inplace: bool = False):
        """One token: x [B, d_model] -> (y [B, d_model], new_state). inplace: the caller gives the
        old state up (a decode loop): its C is updated in place.

        Plain PyTorch ops around the recurrent step, not forward's fused training kernels: with
        one token those are launches of a few microseconds each that torch.compile cannot see
        into, where these fuse (model.compile_step) into a few kernels per block."""
        B = x.shape[0]
        H, D = self.n_heads, self.head_dim
        x_m, z = self._up(x.to(activation_dtype(x)))  # [B, inner] each
        conv, new_conv = self.conv.step(x_m, state.conv)
        x_conv = F.silu(conv)
        q, k, v = self.q_proj.step(x_conv), self.k_proj.step(x_conv), self.v_proj.step(x_m)
        dtype = x_m.dtype
        w = torch.cat([lora_weight(self.igate), lora_weight(self.fgate)]).to(dtype)
        b = torch.cat([self.igate.bias, self.fgate.bias]).to(dtype)
        # bias added apart: torch.compile turns a one-row matmul into a fused reduction, but
        # hands a matmul with bias (addmm) to cuBLAS as two launches
        i, f = (F.linear(torch.cat([q, k, v], dim=-1), w) + b).chunk(2, dim=-1)
        h, cell_state = mlstm_step(
            q.view(B, H, D), k.view(B, H, D), v.view(B, H, D), i, f, (state.C, state.n, state.m), inplace=inplace,
        )  # h [B, H, D]
        u = _tail_fwd_torch(h, x_conv, z, self.out_norm.weight, self.skip, self.out_norm.eps)[0]
        y = self.down_proj(u)
        return self.dropout(y) if self.dropout.p > 0 else y, MLSTMState(new_conv, *cell_state)


class MLSTMBlock(PreNormResidual):
    """Residual mLSTM block: x + mLSTMLayer(LayerNorm(x)). Same interface as MLSTMLayer."""

    supports_cu_seqlens = True
    cu_seqlens_needs_zero_state = True  # the convolution's per-document state is not read in

    def __init__(self, d_model: int, inner_dim: int, n_heads: int, **layer_kwargs):
        super().__init__(d_model, MLSTMLayer(d_model, inner_dim, n_heads, **layer_kwargs))

    supports_lengths = True

    def forward(self, x: torch.Tensor, state: MLSTMState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, lengths: torch.Tensor | None = None,
                maps: ReadMaps | None = None):
        out = self.layer(x, state, return_state, norm=self.norm, cu_seqlens=cu_seqlens,
                         lengths=lengths, maps=maps)  # the norm fused with the up-projection
        if not return_state:
            return x + out
        return x + out[0], out[1]

    def step(self, x: torch.Tensor, state: MLSTMState, inplace: bool = False):
        """One token: x [B, d_model] -> (x + layer(norm(x)), new_state); on CUDA at small batch
        the three launches of ops/blocks/decode.py, else the layer's PyTorch step."""
        if self._fused_step(x, state):
            return self.fused_step(x, state, inplace)
        return super().step(x, state, inplace)

    def fused_step(self, x: torch.Tensor, state: MLSTMState, inplace: bool = False):
        """`step` in the three Triton launches of ops/blocks/decode.py, at any batch: x [B, d_model]
        and a float32 `MLSTMState` → (x', new state). inplace: C and the conv state are updated in
        place (a decode loop); otherwise the old state is left as it was."""
        # imported here: Triton is an optional extra, and the sequence path never needs it
        from ..ops.blocks.decode import mlstm_block_step

        layer = self.layer
        conv, C = state.conv, state.C
        if not inplace:
            conv, C = conv.clone(), C.clone()
        y, n, m = mlstm_block_step(
            x.contiguous(), self.norm.weight, lora_weight(layer.up_proj), layer.conv.weight, layer.conv.bias,
            layer.q_proj.weight, layer.k_proj.weight, layer.v_proj.weight, lora_weight(layer.igate),
            lora_weight(layer.fgate), layer.igate.bias, layer.fgate.bias, layer.out_norm.weight, layer.skip,
            lora_weight(layer.down_proj),
            conv, C, state.n.contiguous(), state.m.contiguous(),
            float(self.norm.eps), float(layer.out_norm.eps), 1e-6)
        return y, MLSTMState(conv, C, n, m)

    def _fused_step(self, x: torch.Tensor, state: MLSTMState) -> bool:
        layer = self.layer
        if state.C.dtype != torch.float32 or (self.training and layer.dropout.p > 0):
            return False
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        bias = any(lin.bias is not None for lin in (layer.up_proj, layer.down_proj, layer.q_proj))
        try:
            return choose_backend("mlstm_block_step", layer.backend, x.device, (x,), dtype=x.dtype, batch=x.shape[0],
                                  requires_grad=needs_grad, bias=bias, block_size=layer.q_proj.weight.shape[-1],
                                  conv_kernel=layer.conv.kernel_size) == "triton"
        except BackendUnavailableError:
            return False  # a layer forced to "triton" means its sequence kernels; the step falls back
