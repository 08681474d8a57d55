"""The xLSTM-7B ("large") residual block: NX-AI's `xlstm_large` and transformers' `xLSTMForCausalLM`.

    x -> x + mLSTMLayer(RMSNorm(x)) -> x + SwiGLU(RMSNorm(x))

mLSTM layer (post up-projection, no convolution): dense maps of the normalised input give
q, k [qk_dim], v and the output-gate pre-activation o [v_dim], and per-head input/forget gate
pre-activations (with bias) soft-capped as cap * tanh(x / cap); the mLSTM cell (q scaled by
1/sqrt(qk head dim) inside the op, eps 1e-6 in its normaliser max(|q̂·n|, exp(-m)) + eps)
runs on n_heads heads of qk_dim / n_heads (q, k) and v_dim / n_heads (v); its output goes
through a per-head LayerNorm (float32 statistics), times sigmoid(o) (one fused op), and out_proj.
SwiGLU: proj_down(SiLU(proj_up_gate(x)) * proj_up(x)).

Module names are those of transformers' xLSTMForCausalLM with weight_mode="single" (and the
official xLSTMLarge), so state_dicts map one to one. At run time the six input maps of the
mLSTM layer are one matmul (their weights concatenated on the fly) and so are the two up
maps of the feed-forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xlstm_kit.ops.backend import BackendUnavailableError, choose_backend
from xlstm_kit.ops.mlstm import mlstm_chunkwise, mlstm_step

from .common import small_init_, state_dtype, wang_init_
from .fused import _head_norm_fwd_torch, gated_head_norm, head_norm, swiglu
from .padding import gates_off_past
from .lora import lora_weight
from .mlstm import MLSTMState


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): x unchanged near 0, bounded by ±cap."""
    return cap * torch.tanh(x / cap)


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it is float64 (references keep their precision)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) (float32 statistics, result in x's dtype) * weight (+ bias).

    forward(x [..., d]) -> [..., d].
    """

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:
            # one pass on CUDA (aten::_fused_rms_norm: float32 statistics, the weight applied
            # before the one rounding), where the spelled-out form below reads and writes x
            # five times: 4 % of the 7B's prefill; on CPU the same arithmetic as below
            y = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:
            y = F.rms_norm(at_least_float32(x), self.weight.shape, eps=self.eps).to(x.dtype) * self.weight
        return y if self.bias is None else y + self.bias


class MultiHeadLayerNorm(nn.Module):
    """LayerNorm of each head's features on their own (float32 statistics), times weight [H*D]
    (+ bias). forward(h [..., H, D]) -> [..., H * D] in h's dtype."""

    def __init__(self, n_heads: int, head_dim: int, eps: float = 1e-6, bias: bool = False, backend: str | None = None):
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(n_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(n_heads * head_dim)) if bias else None

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = head_norm(h, self.weight, self.eps, self.backend).flatten(-2)
        return y if self.bias is None else y + self.bias

    def step(self, h: torch.Tensor) -> torch.Tensor:
        """forward for one token h [B, H, D] in PyTorch ops, which torch.compile fuses with the
        gating around them (forward's Triton kernel would be a launch of its own)."""
        y = _head_norm_fwd_torch(h, self.weight, self.eps)[0].flatten(-2)
        return y if self.bias is None else y + self.bias


class LargeMLSTMLayer(nn.Module):
    """The mLSTM layer of the large block (without its RMSNorm and residual).

    forward(x [B, T, d_model], state=None, return_state=False) -> y [B, T, d_model]
        (or (y, MLSTMState) with return_state=True); step(x [B, d_model], state) -> (y, state).
    The state's C is [B, H, qk_dim/H, v_dim/H], n [B, H, qk_dim/H], m [B, H]; its conv field is
    empty ([B, 0, 0]: this layer has no convolution).
    """

    def __init__(self, d_model: int, n_heads: int, qk_dim: int, v_dim: int, *, n_blocks: int = 1,
                 bias: bool = False, norm_eps: float = 1e-6, gate_soft_cap: float = 15.0, eps: float = 1e-6,
                 chunk_size: int = 64, backend: str | None = None, recompute_states: bool = False):
        super().__init__()
        self.d_model, self.n_heads, self.qk_dim, self.v_dim = d_model, n_heads, qk_dim, v_dim
        self.n_blocks, self.gate_soft_cap, self.eps = n_blocks, gate_soft_cap, eps
        self.chunk_size, self.backend, self.recompute_states = chunk_size, backend, recompute_states
        self.q = nn.Linear(d_model, qk_dim, bias=bias)
        self.k = nn.Linear(d_model, qk_dim, bias=bias)
        self.v = nn.Linear(d_model, v_dim, bias=bias)
        self.ogate_preact = nn.Linear(d_model, v_dim, bias=bias)
        self.igate_preact = nn.Linear(d_model, n_heads, bias=True)
        self.fgate_preact = nn.Linear(d_model, n_heads, bias=True)
        self.multihead_norm = MultiHeadLayerNorm(n_heads, v_dim // n_heads, norm_eps, bias=bias, backend=backend)
        self.out_proj = nn.Linear(v_dim, d_model, bias=bias)
        self._splits = (qk_dim, qk_dim, v_dim, v_dim, 2 * n_heads)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """transformers' xLSTM initialisation (`_init_weights`, weight_mode "single")."""
        d = self.d_model
        for lin in (self.q, self.k, self.v):
            small_init_(lin.weight, d)
        # transformers zeroes every linear map whose name contains "gate": the output gate
        # starts at sigmoid(0) = 1/2, the input gate at exp(-10), the forget gates open
        # (sigmoid(3..6)) with a spread of time scales across heads
        for lin in (self.ogate_preact, self.igate_preact, self.fgate_preact):
            nn.init.zeros_(lin.weight)
        wang_init_(self.out_proj.weight, d, self.n_blocks)
        for lin in (self.q, self.k, self.v, self.ogate_preact, self.out_proj):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        with torch.no_grad():
            self.igate_preact.bias.fill_(-10.0)
            self.fgate_preact.bias.copy_(torch.linspace(3.0, 6.0, self.n_heads))
        self.multihead_norm.reset_parameters()

    def init_state(self, batch: int, device=None, dtype=None) -> MLSTMState:
        """Zero state for `batch` sequences (float32, or float64 for a float64 layer)."""
        device = self.q.weight.device if device is None else device
        dtype = state_dtype(self.q.weight.dtype) if dtype is None else dtype
        H, K, V = self.n_heads, self.qk_dim // self.n_heads, self.v_dim // self.n_heads
        z = lambda *shape: torch.zeros(batch, *shape, device=device, dtype=dtype)  # noqa: E731
        return MLSTMState(conv=z(0, 0), C=z(H, K, V), n=z(H, K), m=z(H))

    def _inputs(self, x: torch.Tensor, one_matmul: bool = True):
        """x [..., d_model] -> q, k [..., qk_dim], v, o [..., v_dim], i, f [..., H] (float32,
        soft-capped). one_matmul: one matmul over the concatenated weights (many tokens: one
        large GEMM); else one per map (a decode step: concatenating would copy every weight
        each token, tripling the step's memory traffic)."""
        maps = (self.q, self.k, self.v, self.ogate_preact, self.igate_preact, self.fgate_preact)
        if one_matmul:
            w = torch.cat([lora_weight(m) for m in maps])
            b = None
            if self.q.bias is not None:
                b = torch.cat([m.bias for m in maps[:4]] + [self.q.bias.new_zeros(2 * self.n_heads)])
            q, k, v, o, g = F.linear(x, w, b).split(self._splits, dim=-1)
        else:
            q, k, v, o = (m(x) for m in maps[:4])
            g = F.linear(x, torch.cat([lora_weight(self.igate_preact), lora_weight(self.fgate_preact)]))
        # the gates in float32: the op computes them in float32 anyway, and bf16 pre-activations
        # would put rounding errors of ~0.1 into exponents
        gb = torch.cat([self.igate_preact.bias, self.fgate_preact.bias])
        i, f = soft_cap(at_least_float32(g) + gb, self.gate_soft_cap).chunk(2, dim=-1)
        return q, k, v, o, i, f

    def _output(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """h [..., H, Dv], o [..., v_dim] -> out_proj(sigmoid(o) * norm(h)) [..., d_model].

        Without a norm bias (the 7B) the gate and the norm are one kernel each way
        (`fused.gated_head_norm`: o read in place from the GEMM's output, float32 arithmetic,
        one rounding to o's dtype); a strided sigmoid and a multiply beside the norm's kernel
        cost 4x the norm's time on the H200."""
        norm = self.multihead_norm
        if norm.bias is None:
            return self.out_proj(gated_head_norm(h, o, norm.weight, norm.eps, norm.backend))
        return self.out_proj(torch.sigmoid(o) * norm(h).to(o.dtype))

    def forward(self, x: torch.Tensor, state: MLSTMState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, lengths: torch.Tensor | None = None):
        """cu_seqlens: packed sequences in x [1, T, d] (see `mlstm_chunkwise`); the state then
        has one row per sequence. lengths [B]: row b's steps from lengths[b] on are padding
        that leaves the state as it was (their outputs mean nothing)."""
        B, T, _ = x.shape
        H = self.n_heads
        # without autograd (prompt reads, generation) one GEMM per map: the concatenated weight
        # is a copy of all six per call (200 MB of traffic per block at xlstm-7b, twice what the
        # GEMMs read); training keeps the one GEMM, whose backward sums no partial gradients of x
        q, k, v, o, i, f = self._inputs(x, one_matmul=torch.is_grad_enabled())
        if lengths is not None:  # after the soft cap, which would bound the no-op's gates
            i, f = gates_off_past(i, f, lengths)
        h, cell = mlstm_chunkwise(
            q.view(B, T, H, -1), k.view(B, T, H, -1), v.view(B, T, H, -1), i, f,
            initial_state=None if state is None else (state.C, state.n, state.m),
            output_final_state=return_state, eps=self.eps, chunk_size=self.chunk_size,
            backend=self.backend, recompute_states=self.recompute_states, cu_seqlens=cu_seqlens,
        )  # h [B, T, H, Dv]
        y = self._output(h, o)
        if not return_state:
            return y
        conv = cell[0].new_zeros(cell[0].shape[0], 0, 0) if state is None else state.conv
        return y, MLSTMState(conv, *cell)

    def step(self, x: torch.Tensor, state: MLSTMState, inplace: bool = False):
        """One token: x [B, d_model] -> (y [B, d_model], new_state). inplace: the caller gives the
        old state up (a decode loop): its C is updated in place."""
        B = x.shape[0]
        H = self.n_heads
        q, k, v, o, i, f = self._inputs(x, one_matmul=False)
        h, cell = mlstm_step(q.view(B, H, -1), k.view(B, H, -1), v.view(B, H, -1), i, f,
                             (state.C, state.n, state.m), eps=self.eps, inplace=inplace)  # h [B, H, Dv]
        y = self.out_proj(torch.sigmoid(o) * self.multihead_norm.step(h).to(o.dtype))
        return y, MLSTMState(state.conv, *cell)


class SwiGLU(nn.Module):
    """proj_down(SiLU(proj_up_gate(x)) * proj_up(x)); forward(x [..., d_model]) -> [..., d_model].

    forward: one GEMM for both up maps, then SiLU(g) * u as one Triton kernel each way
    (`fused.swiglu`) where ops.backend chooses "triton" (`backend` as for the sequence ops)."""

    def __init__(self, d_model: int, hidden: int, *, n_blocks: int = 1, bias: bool = False,
                 backend: str | None = None):
        super().__init__()
        self.d_model, self.hidden, self.n_blocks, self.backend = d_model, hidden, n_blocks, backend
        self.proj_up_gate = nn.Linear(d_model, hidden, bias=bias)
        self.proj_up = nn.Linear(d_model, hidden, bias=bias)
        self.proj_down = nn.Linear(hidden, d_model, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # as transformers' _init_weights: its "gate" name rule zeroes proj_up_gate too (the
        # feed-forward starts at 0 and opens through the gate's gradient)
        nn.init.zeros_(self.proj_up_gate.weight)
        small_init_(self.proj_up.weight, self.d_model)
        wang_init_(self.proj_down.weight, self.hidden, self.n_blocks)
        for lin in (self.proj_up_gate, self.proj_up, self.proj_down):
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """forward for one token x [B, d_model]: two matrix-vector products read each weight once,
        where forward's concatenation would copy both every token."""
        return self.proj_down(F.silu(self.proj_up_gate(x)) * self.proj_up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and x.shape[:-1].numel() <= self.d_model:
            # few tokens without autograd (prompt reads): copying both up weights into one
            # moves more bytes than the unfused SiLU-and-product on the two outputs
            return self.step(x)
        w = torch.cat([lora_weight(self.proj_up_gate), lora_weight(self.proj_up)])
        b = None if self.proj_up.bias is None else torch.cat([self.proj_up_gate.bias, self.proj_up.bias])
        return self.proj_down(swiglu(F.linear(x, w, b), self.backend))


class LargeBlock(nn.Module):
    """x + mLSTM(RMSNorm(x)), then + SwiGLU(RMSNorm(x)).

    forward(x [B, T, d_model], state=None, return_state=False) -> y (or (y, MLSTMState));
    step(x [B, d_model], state) -> (y, state); init_state(batch).
    """

    def __init__(self, d_model: int, n_heads: int, qk_dim: int, v_dim: int, ffn_dim: int, *,
                 n_blocks: int = 1, bias: bool = False, norm_eps: float = 1e-6, gate_soft_cap: float = 15.0,
                 chunk_size: int = 64, backend: str | None = None, recompute_states: bool = False):
        super().__init__()
        self.norm_mlstm = RMSNorm(d_model, norm_eps, bias=bias)
        self.mlstm_layer = LargeMLSTMLayer(
            d_model, n_heads, qk_dim, v_dim, n_blocks=n_blocks, bias=bias, norm_eps=norm_eps,
            gate_soft_cap=gate_soft_cap, chunk_size=chunk_size, backend=backend, recompute_states=recompute_states)
        self.norm_ffn = RMSNorm(d_model, norm_eps, bias=bias)
        self.ffn = SwiGLU(d_model, ffn_dim, n_blocks=n_blocks, bias=bias, backend=backend)

    def reset_parameters(self) -> None:
        for m in (self.norm_mlstm, self.mlstm_layer, self.norm_ffn, self.ffn):
            m.reset_parameters()

    def init_state(self, batch: int, device=None, dtype=None) -> MLSTMState:
        return self.mlstm_layer.init_state(batch, device, dtype)

    # only the mLSTM mixes time steps here (no convolution): packed sequences go to the op
    supports_cu_seqlens = True

    supports_lengths = True

    def forward(self, x: torch.Tensor, state: MLSTMState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None, lengths: torch.Tensor | None = None):
        out = self.mlstm_layer(self.norm_mlstm(x), state, return_state, cu_seqlens, lengths)
        y, state = out if return_state else (out, None)
        x = x + y
        x = x + self.ffn(self.norm_ffn(x))
        return (x, state) if return_state else x

    def step(self, x: torch.Tensor, state: MLSTMState, inplace: bool = False):
        """One token: x [B, d_model] -> (x', new_state); on CUDA at small batch the five launches
        of ops/blocks/large_decode.py, else the layers' PyTorch steps."""
        if self._fused_step(x, state):
            return self.fused_step(x, state, inplace)
        y, state = self.mlstm_layer.step(self.norm_mlstm(x), state, inplace=inplace)
        x = x + y
        return x + self.ffn.step(self.norm_ffn(x)), state

    def fused_step(self, x: torch.Tensor, state: MLSTMState, inplace: bool = False):
        """`step` in the five Triton launches of ops/blocks/large_decode.py, at any batch:
        x [B, d_model] and an `MLSTMState` (C float32) → (x', new state). inplace: C is updated in
        place (a decode loop); otherwise the old state is left as it was."""
        # imported here: Triton is an optional extra, and the sequence path never needs it
        from ..ops.blocks.large_decode import large_block_step

        layer, ffn = self.mlstm_layer, self.ffn
        C = state.C if inplace else state.C.clone()
        y, n, m = large_block_step(
            x.contiguous(), self.norm_mlstm.weight, *(lora_weight(m) for m in (
                layer.q, layer.k, layer.v, layer.ogate_preact, layer.igate_preact, layer.fgate_preact)),
            layer.igate_preact.bias, layer.fgate_preact.bias, layer.multihead_norm.weight, lora_weight(layer.out_proj),
            self.norm_ffn.weight, lora_weight(ffn.proj_up_gate), lora_weight(ffn.proj_up), lora_weight(ffn.proj_down),
            C, state.n.contiguous(), state.m.contiguous(), float(self.norm_mlstm.eps), float(self.norm_ffn.eps),
            float(layer.multihead_norm.eps), float(layer.gate_soft_cap), float(layer.eps))
        return y, MLSTMState(state.conv, C, n, m)

    def _fused_step(self, x: torch.Tensor, state: MLSTMState) -> bool:
        layer, ffn = self.mlstm_layer, self.ffn
        if state.C.dtype != torch.float32:
            return False
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        bias = any(mod.bias is not None for mod in (
            self.norm_mlstm, self.norm_ffn, layer.q, layer.k, layer.v, layer.ogate_preact, layer.multihead_norm,
            layer.out_proj, ffn.proj_up_gate, ffn.proj_up, ffn.proj_down))
        try:
            return choose_backend("large_block_step", layer.backend, x.device, (x,), dtype=x.dtype, batch=x.shape[0],
                                  requires_grad=needs_grad, bias=bias) == "triton"
        except BackendUnavailableError:
            return False  # a layer forced to "triton" means its sequence kernels; the step falls back
