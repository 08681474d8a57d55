"""The unfused layer paths: plain PyTorch formulas (autograd differentiates them) over a layer's
parameters, the reference the fused pieces in xlstm_kit.layers.fused are tested against."""
import torch
import torch.nn.functional as F

from xlstm_kit.layers.mlstm import MLSTMState
from xlstm_kit.layers.slstm import SLSTMState
from xlstm_kit.ops.mlstm import mlstm_chunkwise
from xlstm_kit.ops.slstm import slstm_recurrent


def causal_conv(x, state, w, b):
    """x [B, T, C], state [B, K-1, C] | None -> (conv1d output [B, T, C], new state)."""
    K = w.shape[1]
    if state is None:
        state = x.new_zeros(x.shape[0], K - 1, x.shape[2])
    xp = torch.cat([state.to(x.dtype), x], dim=1)
    y = F.conv1d(xp.transpose(1, 2), w[:, None, :].to(x.dtype), b.to(x.dtype), groups=x.shape[2]).transpose(1, 2)
    return y, xp[:, x.shape[1]:]


def head_norm(x, w, eps):
    H, D = x.shape[-2:]
    return F.layer_norm(x, (D,), eps=eps) * w.view(H, D)


def mlstm_layer(layer, x, state=None, backend="torch"):
    """MLSTMLayer.forward(x, state, return_state=True), unfused (`backend` of the sequence op)."""
    B, T, _ = x.shape
    H, D = layer.n_heads, layer.head_dim
    x_m, z = layer.up_proj(x).chunk(2, dim=-1)
    y, conv_state = causal_conv(x_m, None if state is None else state.conv, layer.conv.weight, layer.conv.bias)
    x_conv = F.silu(y)
    q, k, v = layer.q_proj(x_conv), layer.k_proj(x_conv), layer.v_proj(x_m)
    qkv = torch.cat([q, k, v], dim=-1)
    i, f = layer.igate(qkv), layer.fgate(qkv)
    h, cell = mlstm_chunkwise(q.view(B, T, H, D), k.view(B, T, H, D), v.view(B, T, H, D), i, f,
                              initial_state=None if state is None else (state.C, state.n, state.m),
                              output_final_state=True, chunk_size=layer.chunk_size, backend=backend)
    h = head_norm(h, layer.out_norm.weight, layer.out_norm.eps).reshape(B, T, -1)
    out = layer.down_proj((h + layer.skip * x_conv) * F.silu(z))
    return out, MLSTMState(conv_state, *cell)


def slstm_layer(layer, x, state=None, backend="torch"):
    """SLSTMLayer.forward(x, state, return_state=True), unfused (`backend` of the sequence op)."""
    B, T, C = x.shape
    H, D = layer.n_heads, layer.head_dim
    y, conv_state = causal_conv(x, None if state is None else state.conv, layer.conv.weight, layer.conv.bias)
    x_conv = F.silu(y).view(B, T, H, D)
    w = layer.gate_weight  # [4, H, D_out, D_in]
    src = (x_conv, x_conv, x.view(B, T, H, D), x.view(B, T, H, D))
    gates = torch.stack([torch.einsum("bthi,hoi->btho", s, w[g]) for g, s in enumerate(src)], dim=2)
    h, cell = slstm_recurrent(gates, layer.recurrent, layer.bias,
                              initial_state=None if state is None else (state.h, state.c, state.n, state.m),
                              output_final_state=True, backend=backend)
    return head_norm(h, layer.out_norm.weight, layer.out_norm.eps).reshape(B, T, C), SLSTMState(conv_state, *cell)
