"""sLSTM options of the paper's formal-language configuration: no convolution, the
official cell's init modes, and the experiment presets that choose them."""
import math
import os

import pytest
import torch

from xlstm_kit.errors import XLSTMKitError
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.layers.slstm import SLSTMBlock, SLSTMLayer, powerlaw_forget_bias
from xlstm_kit.experiments.models import SLSTM_PRESETS, build_model


def test_no_conv_layer_has_no_conv_parameters_and_state():
    block = SLSTMBlock(32, 2, 64, conv_kernel_size=0, backend="torch")
    assert block.layer.conv is None
    assert not any("conv" in name for name, _ in block.named_parameters())
    with_conv = SLSTMBlock(32, 2, 64, backend="torch")
    n_conv = sum(p.numel() for n, p in with_conv.named_parameters() if "conv" in n)
    assert n_conv == 32 * 4 + 32
    assert sum(p.numel() for p in with_conv.parameters()) - sum(p.numel() for p in block.parameters()) == n_conv
    assert block.init_state(3).conv.shape == (3, 0, 32)


def test_no_conv_gates_see_x_and_step_matches_forward():
    torch.manual_seed(0)
    layer = SLSTMLayer(16, 2, conv_kernel_size=0, recurrent_init="standard", bias_init="standard",
                       backend="torch").double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    y, state = layer(x, return_state=True)
    # the gates by hand: each head's D inputs through W [D_out, D_in], no convolution, no SiLU
    xh = x.view(2, 7, 2, 8)
    gates = torch.stack([torch.stack([xh[:, :, h] @ layer.gate_weight[g, h].T for h in range(2)], 2)
                         for g in range(4)], 2)
    from xlstm_kit.layers.slstm import headwise_gates
    torch.testing.assert_close(headwise_gates(x, layer.gate_weight), gates)
    # a step at a time from the zero state gives the same outputs and final state
    st = layer.init_state(2, dtype=torch.float64)
    outs = []
    for t in range(7):
        o, st = layer.step(x[:, t], st)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), y)
    for a, b in zip(st[1:], state[1:]):
        torch.testing.assert_close(a, b)
    # the output depends on the previous inputs through the (non-zero) recurrent weights
    x2 = x.clone()
    x2[:, 0] += 1.0
    assert not torch.allclose(layer(x2)[:, -1], y[:, -1])


def test_init_modes_give_the_official_statistics():
    torch.manual_seed(0)
    d = 256
    std = SLSTMLayer(d, 1, recurrent_init="standard", bias_init="standard").requires_grad_(False)
    bound = 1 / math.sqrt(d)
    for p in (std.recurrent, std.bias):
        assert float(p.abs().max()) <= bound
        assert abs(float(p.std()) - bound / math.sqrt(3)) < 0.05 * bound  # uniform(-b, b) std
        assert abs(float(p.mean())) < 0.05 * bound
    assert float(std.bias[0].std()) > 0.5 * bound / math.sqrt(3)  # every gate, not only f
    lm = SLSTMLayer(d, 4, block_index=1, n_blocks=3).requires_grad_(False)
    assert float(lm.recurrent.abs().max()) == 0.0
    torch.testing.assert_close(lm.bias[1], powerlaw_forget_bias(64, 1, 3).expand(4, 64))
    assert float(lm.bias[[0, 2, 3]].abs().max()) == 0.0
    small = SLSTMLayer(d, 4, bias_init="small_init")
    torch.testing.assert_close(small.bias[1], torch.linspace(3.0, 6.0, 64).expand(4, 64))
    zero = SLSTMLayer(d, 4, bias_init="zeros")
    assert float(zero.bias.abs().max()) == 0.0
    with pytest.raises(XLSTMKitError, match="recurrent_init"):
        SLSTMLayer(d, 4, recurrent_init="normal")
    with pytest.raises(XLSTMKitError, match="bias_init"):
        SLSTMLayer(d, 4, bias_init="powerlaw")
    with pytest.raises(XLSTMKitError, match="conv_kernel_size"):
        SLSTMLayer(d, 4, conv_kernel_size=-1)


def test_paper_preset_swaps_only_the_slstm_blocks():
    torch.manual_seed(0)
    m = build_model("xlstm[1:1]", 20, d_model=32, n_heads=4, slstm="paper", backend="torch")
    kinds = [type(b).__name__ for b in m.blocks]
    assert kinds == ["MLSTMBlock", "SLSTMBlock"]  # mLSTM first, as in the paper
    layer = m.blocks[1].layer
    assert layer.conv is None and layer.n_heads == 1 and layer.head_dim == 32
    assert float(layer.recurrent.abs().max()) > 0
    assert m.blocks[0].layer.conv is not None  # the mLSTM keeps its convolution
    assert m(torch.randint(0, 20, (2, 9))).shape == (2, 9, 20)
    with pytest.raises(XLSTMKitError, match="sLSTM preset"):
        build_model("xlstm[0:1]", 20, slstm="official")
    assert SLSTM_PRESETS["paper"]["conv_kernel_size"] == 0


def test_lm_preset_and_lm_models_unchanged():
    """The defaults are the language-model blocks: the same model as XLSTMLanguageModel built
    directly, and the parameter count and fixed-seed forward recorded before the options existed
    (commit ccfdc3d)."""
    torch.manual_seed(0)
    cfg = XLSTMConfig(vocab_size=64, d_model=32, n_blocks=2, n_heads=4, slstm_at="1:1", backend="torch")
    m = XLSTMLanguageModel(cfg).double()
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        y = m(x)
    assert sum(p.numel() for p in m.parameters()) == 21640
    assert float(y.sum()) == pytest.approx(-10.22421481297536, rel=1e-9)
    assert float(y.abs().sum()) == pytest.approx(781.9175778753288, rel=1e-9)
    torch.manual_seed(0)
    a = build_model("xlstm[0:1]", 16, d_model=32, n_heads=4, backend="torch")
    torch.manual_seed(0)
    b = XLSTMLanguageModel(XLSTMConfig(vocab_size=16, d_model=32, n_blocks=2, n_heads=4, slstm_at="0:1",
                                       backend="torch"))
    assert a.state_dict().keys() == b.state_dict().keys()
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_no_conv_layer_equals_the_official_layer_without_conv():
    """Our conv_kernel_size=0 layer against the official sLSTMLayer(conv1d_kernel_size=0) with the
    same weights, and the official "standard" init's statistics against ours."""
    import types

    pytest.importorskip("xlstm")
    from xlstm.blocks.slstm.layer import sLSTMLayer, sLSTMLayerConfig

    from xlstm_kit.io.compat import _slstm_cell_from_ours

    torch.manual_seed(0)
    d = 16
    ours = SLSTMLayer(d, 2, conv_kernel_size=0, recurrent_init="standard", bias_init="standard", backend="torch")
    off = sLSTMLayer(sLSTMLayerConfig(embedding_dim=d, num_heads=2, conv1d_kernel_size=0, backend="vanilla",
                                      recurrent_weight_init="standard", bias_init="standard"))
    assert not any("conv" in n for n, _ in off.named_parameters())
    with torch.no_grad():
        ours.out_norm.weight.add_(0.1 * torch.randn_like(ours.out_norm.weight))
        _slstm_cell_from_ours(off, types.SimpleNamespace(layer=ours))
        off.group_norm.weight.copy_(ours.out_norm.weight - 1)  # official: a residual weight
        x = torch.randn(2, 9, d)
        torch.testing.assert_close(ours(x), off(x), atol=2e-5, rtol=1e-4)
    big = 256
    off = sLSTMLayer(sLSTMLayerConfig(embedding_dim=big, num_heads=1, conv1d_kernel_size=0, backend="vanilla",
                                      recurrent_weight_init="standard", bias_init="standard"))
    ours = SLSTMLayer(big, 1, conv_kernel_size=0, recurrent_init="standard", bias_init="standard")
    for a, b in ((ours.recurrent, off.slstm_cell._recurrent_kernel), (ours.bias, off.slstm_cell._bias)):
        assert float(a.detach().std()) == pytest.approx(float(b.detach().std()), rel=0.05)
        assert float(a.detach().abs().max()) == pytest.approx(float(b.detach().abs().max()), rel=0.02)


@pytest.mark.skipif(not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
                    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
def test_no_conv_layer_triton_matches_torch():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    a = SLSTMLayer(32, 1, conv_kernel_size=0, recurrent_init="standard", bias_init="standard", backend="torch").to(dev)
    b = SLSTMLayer(32, 1, conv_kernel_size=0, recurrent_init="standard", bias_init="standard", backend="triton").to(dev)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 7, 32, device=dev, requires_grad=True)
    ya, yb = a(x), b(x)
    torch.testing.assert_close(yb, ya, atol=1e-4, rtol=1e-4)
    ga = torch.autograd.grad(ya.square().sum(), [x, a.recurrent, a.gate_weight])
    gb = torch.autograd.grad(yb.square().sum(), [x, b.recurrent, b.gate_weight])
    for p, q in zip(gb, ga):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3)
