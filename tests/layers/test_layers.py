"""Layers and blocks: building pieces against plain references, step path = parallel path,
state carried across calls, gradients, dtypes and the official initialisation."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from xlstm_kit.layers import (CausalConv1d, GatedFeedForward, HeadwiseLinear, MLSTMBlock, MLSTMLayer,
                          MultiHeadNorm, SLSTMBlock, SLSTMLayer)
from xlstm_kit.layers.slstm import powerlaw_forget_bias

F64 = torch.float64


def randomize_(module, scale=0.3):
    """Move every parameter off its initial value (zero gate weights and recurrent kernels
    would hide layout mistakes)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


# ------------------------------------------------------------------------------ pieces
def test_causal_conv_matches_conv1d_and_carries_state():
    conv = CausalConv1d(6, 4).double()
    x = torch.randn(2, 11, 6, dtype=F64)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight[:, None, :], conv.bias, groups=6).transpose(1, 2)
    y, state = conv(x)
    assert rel_err(y, ref) < 1e-12
    assert torch.equal(state, x[:, -3:])
    # two pieces with the carried state, and token by token, equal one call
    y1, s1 = conv(x[:, :5])
    y2, _ = conv(x[:, 5:], s1)
    assert rel_err(torch.cat([y1, y2], 1), ref) < 1e-12
    s, outs = conv.init_state(2), []
    for t in range(11):
        o, s = conv.step(x[:, t], s)
        outs.append(o)
    assert rel_err(torch.stack(outs, 1), ref) < 1e-12


def test_causal_conv_kernel_one_and_gradients():
    conv = CausalConv1d(3, 1).double()
    x = torch.randn(2, 4, 3, dtype=F64, requires_grad=True)
    y, state = conv(x)
    assert state.shape == (2, 0, 3)
    assert rel_err(y, x * conv.weight[:, 0] + conv.bias) < 1e-12
    conv4 = CausalConv1d(3, 4).double()
    assert torch.autograd.gradcheck(lambda x: conv4(x)[0], (x,))


@pytest.mark.parametrize("block", [4, 16])  # the broadcast path (<= 8) and the einsum path
def test_headwise_linear_is_block_diagonal(block):
    lin = HeadwiseLinear(4 * block, 4, bias=True).double()
    randomize_(lin)
    x = torch.randn(3, 5, 4 * block, dtype=F64)
    dense = torch.block_diag(*lin.weight)
    assert rel_err(lin(x), x @ dense.T + lin.bias) < 1e-12
    small = HeadwiseLinear(2 * block, 2).double()
    assert torch.autograd.gradcheck(small, (torch.randn(2, 2 * block, dtype=F64, requires_grad=True),))


def test_multihead_norm_is_groupnorm():
    norm = MultiHeadNorm(3, 5).double()
    randomize_(norm)
    x = torch.randn(2, 7, 3, 5, dtype=F64)
    ref = F.group_norm(x.reshape(14, 15), 3, norm.weight, eps=1e-5).reshape(2, 7, 3, 5)
    assert rel_err(norm(x), ref) < 1e-12


def test_gated_ffn_formula():
    ffn = GatedFeedForward(8, 12, n_blocks=2).double()
    x = torch.randn(4, 8, dtype=F64)
    g, u = (x @ ffn.up_proj.weight.T).split(12, dim=-1)
    assert rel_err(ffn(x), (F.gelu(g) * u) @ ffn.down_proj.weight.T) < 1e-12


# ------------------------------------------------------------------------------ layers/blocks
def make(kind, dtype=F64, **kw):
    if kind == "mlstm_layer":
        m = MLSTMLayer(16, 32, 2, chunk_size=4, **kw)
    elif kind == "mlstm_block":
        m = MLSTMBlock(16, 32, 2, chunk_size=4, **kw)
    elif kind == "slstm_layer":
        m = SLSTMLayer(16, 2, **kw)
    else:
        m = SLSTMBlock(16, 2, 24, **kw)
    return randomize_(m.to(dtype))


KINDS = ["mlstm_layer", "mlstm_block", "slstm_layer", "slstm_block"]


@pytest.mark.parametrize("kind", KINDS)
def test_step_path_equals_parallel_path(kind):
    m = make(kind)
    x = torch.randn(2, 11, 16, dtype=F64)
    ref, ref_state = m(x, return_state=True)
    state, outs = m.init_state(2), []
    for t in range(x.shape[1]):
        y, state = m.step(x[:, t], state)
        outs.append(y)
    assert rel_err(torch.stack(outs, 1), ref) < 1e-10
    for a, b in zip(state, ref_state):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("kind", KINDS)
def test_state_carried_across_calls(kind):
    m = make(kind)
    x = torch.randn(2, 13, 16, dtype=F64)
    whole = m(x)
    y1, s = m(x[:, :6], return_state=True)
    y2, s = m(x[:, 6:9], s, return_state=True)
    y3 = m(x[:, 9:], s)
    assert rel_err(torch.cat([y1, y2, y3], 1), whole) < 1e-10
    # an explicit zero state is the default state
    assert rel_err(m(x, m.init_state(2)), whole) < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_state_size_and_dtype(kind):
    m = make(kind, dtype=torch.float32)
    x = torch.randn(3, 9, 16)
    _, s_short = m(x[:, :2], return_state=True)
    _, s_long = m(x, return_state=True)
    assert [t.shape for t in s_short] == [t.shape for t in s_long] == [t.shape for t in m.init_state(3)]
    assert all(t.dtype == torch.float32 for t in s_long)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_layers(kind, dtype):
    ref_m = make(kind, dtype=torch.float32)
    m = make(kind, dtype=dtype)
    m.load_state_dict(ref_m.state_dict())
    x = torch.randn(2, 9, 16)
    y, s = m(x.to(dtype), return_state=True)
    assert y.dtype == dtype and all(t.dtype == torch.float32 for t in s)
    assert rel_err(y, ref_m(x)) < 0.05
    y_step, _ = m.step(x[:, 0].to(dtype), m.init_state(2))
    assert y_step.dtype == dtype


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_reach_every_parameter(kind):
    m = make(kind, dtype=torch.float32)
    x = torch.randn(2, 10, 16, requires_grad=True)
    y = m(x)
    (y * torch.randn_like(y)).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


# ------------------------------------------------------------------------------ initialisation
def test_mlstm_initialisation():
    torch.manual_seed(1)
    layer = MLSTMLayer(64, 128, 4, n_blocks=6)
    assert torch.equal(layer.fgate.bias.detach(), torch.linspace(3.0, 6.0, 4))
    assert not layer.fgate.weight.any() and not layer.igate.weight.any()
    assert layer.igate.bias.abs().max() < 0.5 and layer.igate.bias.abs().min() > 0
    assert torch.equal(layer.skip.detach(), torch.ones(128))
    small = math.sqrt(2 / (5 * 64))
    assert abs(layer.up_proj.weight.std().item() / small - 1) < 0.05
    assert abs(layer.q_proj.weight.std().item() / small - 1) < 0.1
    wang = 2 / 6 / math.sqrt(64)
    assert abs(layer.down_proj.weight.std().item() / wang - 1) < 0.05


def test_slstm_initialisation():
    layer = SLSTMLayer(32, 4, block_index=2, n_blocks=5)
    assert not layer.recurrent.any()
    assert not layer.bias[[0, 2, 3]].any()
    expected = 5.0 - 12.0 * torch.linspace(0, 1, 8) ** (0.3 + 1.3 * 2 / 4)
    assert torch.allclose(layer.bias[1], expected.expand(4, 8))
    assert layer.bias[1, 0, 0] == 5.0 and layer.bias[1, 0, -1] == -7.0
    # the first block's curve is flatter at the start than the last block's
    assert powerlaw_forget_bias(8, 0, 5)[1] < powerlaw_forget_bias(8, 4, 5)[1]
    assert torch.isfinite(powerlaw_forget_bias(1, 0, 1)).all()
