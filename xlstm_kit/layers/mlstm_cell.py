"""The paper mLSTM layer's training cell: the causal conv + SiLU, the head-wise q/k/v maps, the
gate pre-activations and the chunkwise mLSTM as one autograd node on the Triton kernels.

Why one node: the chunkwise op's own autograd saves q, k and v (3 x inner values per token,
about a third of what a 125M mLSTM block keeps), and the conv, the maps and the gates are
separate passes over [N, inner] each way. The cell saves x_m (kept by the layer anyway) and
the op's own outputs; its backward recomputes x_conv, q, k, v, runs the op's backward and then
the maps' and the conv's backward in one sweep (`front_forward` / `front_backward`: the fused
kernels of ops/blocks/mlstm_front.py where Triton runs, else their PyTorch twins).

    mlstm_cell(x_m [B, T, C], conv_w [C, K], conv_b [C], wq, wk, wv [C/d, d, d],
               w_conv, w_m [2H, C], b [2H], ...) -> (h [B, T, H, C/H], x_conv [B, T, C])

with x_conv = SiLU(conv(x_m)), q = blockdiag(wq) x_conv, k likewise, v = blockdiag(wv) x_m,
[i, f] = x_conv w_convᵀ + x_m w_mᵀ + b, h = mLSTM(q, k, v, i, f) from the zero state.
"""
from __future__ import annotations

import torch

from ..ops._checks import LOG_GATE_FLOOR, floor_log_gate
from ..ops.backend import BackendUnavailableError, choose_backend, kernel_module, on_device
from .common import _packed_blocks, _packed_bmm, headwise_weight_grad
from .fused import _conv_bwd, _conv_fwd, _conv_kernels

# imported with the layer rather than on the first call: torch.compile sees the modules that
# existed when its trace began, so an import inside the trace is a graph break per block
_FRONT_KERNELS = kernel_module("mlstm_front")

EPS = 1e-6  # the cell's eps: mlstm_chunkwise's default, which the layer's other path uses


def _front(conv_kernels, x: torch.Tensor, d: int, taps: int):
    """The fused front kernels where the conv runs on Triton and they take the call (dtype,
    head-wise block width d, conv taps), else None (the PyTorch pieces)."""
    if conv_kernels is None:
        return None
    try:
        use = choose_backend("mlstm_front", "triton", x.device, inputs=(x,), dtype=x.dtype, block_size=d, taps=taps)
    except BackendUnavailableError:
        return None
    return _FRONT_KERNELS if use == "triton" else None


def front_forward(x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, pack: int, conv_kernels, pos,
                  gates: bool = True, front=None):
    """(x_conv, q, k, v, gates [N, 2H] or None) [B, T, C] each, from x_m [B, T, C] contiguous.
    gates=False: the backward's recomputation (no gate pre-activations; the fused kernels also
    skip x_conv, which their backward recomputes itself: x_conv is then None)."""
    B, T, C = x_m.shape
    if front is not None:
        with on_device(x_m):
            x_conv, q, k, v, g = front.mlstm_front_fwd(x_m, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates,
                                                       front.front_config_key())
        return (x_conv if gates else None), q, k, v, (g if gates else None)
    x_conv = _conv_fwd(conv_kernels, x_m, None, conv_w, conv_b, True, pos)
    xc2, xm2 = x_conv.view(-1, C), x_m.view(-1, C)
    q = _packed_bmm(xc2, _packed_blocks(wq, pack))
    k = _packed_bmm(xc2, _packed_blocks(wk, pack))
    v = _packed_bmm(xm2, _packed_blocks(wv, pack))
    g = None
    if gates:
        g = torch.addmm(b, xc2, w_conv.t()).addmm_(xm2, w_m.t())
    return x_conv, q.view(B, T, C), k.view(B, T, C), v.view(B, T, C), g


def front_backward(dq, dk, dv, dgates, dx_conv, x_m, x_conv, conv_w, conv_b, wq, wk, wv, w_conv, w_m,
                   pack: int, conv_kernels, pos, front=None):
    """Gradients (dx_m, dconv_w, dconv_b, dwq, dwk, dwv, dw_conv, dw_m, db) of `front_forward`
    from those of q, k, v [N, C], the gates [N, 2H] and x_conv (its other readers'; or None)."""
    B, T, C = x_m.shape
    if front is not None:
        return front.mlstm_front_bwd(
            dq.view(B, T, C), dk.view(B, T, C), dv.view(B, T, C), dgates.contiguous(),
            None if dx_conv is None else dx_conv.contiguous(), x_m, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m,
            front.front_config_key())
    xc2, xm2 = x_conv.reshape(-1, C), x_m.reshape(-1, C)
    H = wq.shape[0]
    dxc = _packed_bmm(dq, _packed_blocks(wq, pack).transpose(1, 2))
    dxc += _packed_bmm(dk, _packed_blocks(wk, pack).transpose(1, 2))
    dxc.addmm_(dgates, w_conv)
    if dx_conv is not None:
        dxc += dx_conv.reshape(-1, C)
    dx, _, dcw, dcb = _conv_bwd(conv_kernels, dxc.view(B, T, C), x_m, None, conv_w, conv_b, True, pos)
    dxm = _packed_bmm(dv, _packed_blocks(wv, pack).transpose(1, 2))
    dxm.addmm_(dgates, w_m)
    dx = dx + dxm.view(B, T, C)
    return (dx, dcw, dcb, headwise_weight_grad(dq, xc2, H, pack), headwise_weight_grad(dk, xc2, H, pack),
            headwise_weight_grad(dv, xm2, H, pack), dgates.t() @ xc2, dgates.t() @ xm2, dgates.sum(0))


class _MLSTMCellFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, n_heads: int, pack: int,
                recompute_states: bool, conv_kernels, front, pos, cu_seqlens):
        from xlstm_kit.ops.mlstm.triton.op import chunkwise_forward_for_cell

        B, T, C = x_m.shape
        H = n_heads
        x_conv, q, k, v, gates = front_forward(x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, pack,
                                               conv_kernels, pos, front=front)
        i, f = gates.chunk(2, dim=-1)
        shape = (B, T, H, C // H)
        h, saved = chunkwise_forward_for_cell(
            q.view(shape), k.view(shape), v.view(shape), i.reshape(B, T, H), floor_log_gate(f).reshape(B, T, H),
            EPS, recompute_states, cu_seqlens)
        ctx.save_for_backward(x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates, pos, cu_seqlens, *saved)
        ctx.n_heads, ctx.pack, ctx.recompute, ctx.conv_kernels, ctx.front = H, pack, recompute_states, conv_kernels, front
        return h, x_conv

    @staticmethod
    def backward(ctx, dh, dx_conv):
        from xlstm_kit.ops.mlstm.triton.op import chunkwise_backward_for_cell

        x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates, pos, cu, *saved = ctx.saved_tensors
        B, T, C = x_m.shape
        H, pack = ctx.n_heads, ctx.pack
        x_conv, q, k, v, _ = front_forward(x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, pack,
                                           ctx.conv_kernels, pos, gates=False, front=ctx.front)
        i, f = gates.chunk(2, dim=-1)
        shape = (B, T, H, C // H)
        if dh is None:
            dh = torch.zeros(shape, device=x_m.device, dtype=q.dtype)
        dq, dk, dv, di, df = chunkwise_backward_for_cell(
            q.view(shape), k.view(shape), v.view(shape), i.reshape(B, T, H), floor_log_gate(f).reshape(B, T, H),
            saved, dh, EPS, ctx.recompute, cu)
        df = torch.where(f.reshape(df.shape) >= LOG_GATE_FLOOR, df, 0)  # clamp_min's gradient
        dgates = torch.cat([di, df], dim=-1).view(-1, 2 * H).to(gates.dtype)
        grads = front_backward(dq.reshape(-1, C), dk.reshape(-1, C), dv.reshape(-1, C), dgates, dx_conv, x_m,
                               x_conv, conv_w, conv_b, wq, wk, wv, w_conv, w_m, pack, ctx.conv_kernels, pos,
                               front=ctx.front)
        return (*grads, None, None, None, None, None, None, None)


def mlstm_cell(x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, *, n_heads: int, pack: int,
               recompute_states: bool, backend: str | None, pos=None, cu_seqlens=None):
    """See the module docstring. x_m contiguous; `pack` heads of wq/wk/wv per batched-matmul
    block (HeadwiseLinear.pack); `pos` (int32 [T]) and `cu_seqlens` for packed documents (B = 1)."""
    # the kernel modules are chosen here, outside the autograd.Function: torch.compile traces
    # its forward as a subgraph, where the choice's import would be a graph break per block
    conv_kernels = _conv_kernels(x_m, backend)
    front = _front(conv_kernels, x_m, wq.shape[-1], conv_w.shape[1])
    return _MLSTMCellFn.apply(x_m, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, n_heads, pack,
                              bool(recompute_states), conv_kernels, front, pos, cu_seqlens)
