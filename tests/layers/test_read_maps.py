"""An mLSTM layer's weights derived from its parameters (packed q/k/v head blocks, gate maps
folded through them), kept between reads without gradients (`MLSTMLayer.read_maps`): the same
outputs as deriving them per forward, in float64, also after the parameters change; and none of
the derivation's ops left in a kept read, eager or under `compile_prefill`."""
import collections

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model(**kw):
    cfg = XLSTMConfig(vocab_size=64, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], backend="torch", **kw)
    m = XLSTMLanguageModel(cfg).double()
    with torch.no_grad():  # off the init (zero gate weights)
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def _read(m, ids, lens):
    return m(ids, m.init_state(2), return_state=True, lengths=lens)


def _same(a, b):
    assert torch.equal(a[0], b[0])
    for sa, sb in zip(a[1], b[1]):
        for x, y in zip(sa, sb):
            assert torch.equal(x, y)


def test_kept_weights_give_the_reads_of_derived_ones_and_skip_the_derivation():
    m = _model()
    ids, lens = torch.randint(0, 64, (2, 9)), torch.tensor([9, 5])
    derived = _read(m, ids, lens)  # gradients on: derived per forward
    with torch.no_grad():
        _read(m, ids, lens)
        with _Ops() as kept:
            out = _read(m, ids, lens)
    _same(out, derived)
    with torch.no_grad(), _Ops() as fresh:
        for blk in m.blocks:
            if hasattr(blk, "layer") and hasattr(blk.layer, "_read_maps"):
                blk.layer._read_maps = None
        _read(m, ids, lens)
    # each of the 2 mLSTM blocks derives 3 packed blocks (one eye each) once, then keeps them
    assert kept.count["eye"] == 0 and fresh.count["eye"] == 6
    assert fresh.count["bmm"] - kept.count["bmm"] == 6  # the gate maps folded through q, k, v


def test_kept_weights_follow_the_parameters():
    m = _model()
    ids, lens = torch.randint(0, 64, (2, 9)), torch.tensor([9, 5])
    with torch.no_grad():
        _read(m, ids, lens)
        for p in m.parameters():  # an optimizer step, in place
            p.mul_(1.01)
        stepped = _read(m, ids, lens)
    _same(stepped, _read(m, ids, lens))
    other = _model()
    with torch.no_grad():
        m.load_state_dict(other.state_dict())
        loaded = _read(m, ids, lens)
    _same(loaded, _read(other, ids, lens))
    m.float()
    with torch.no_grad():
        single = _read(m, ids, lens)
    assert single[0].dtype == torch.float32
    _same(single, _read(m, ids, lens))


def test_adapters_on_the_gates_are_derived_per_read():
    layer = _model().blocks[0].layer

    class Wrapped(nn.Linear):  # as an adapter wraps a gate: its weight is no longer the one applied
        pass

    assert layer.read_maps(torch.float64) is not None
    layer.igate = Wrapped(layer.igate.in_features, layer.igate.out_features)
    assert layer.read_maps(torch.float64) is None


def test_compiled_prefill_takes_the_kept_weights_as_inputs():
    m = _model()
    ids, lens = torch.randint(0, 64, (2, 9)), torch.tensor([9, 5])
    want = _read(m, ids, lens)
    traced = []

    def backend(gm, example_inputs):
        traced.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    m.compile_prefill(backend=backend)
    with torch.no_grad():
        got = _read(m, ids, lens)
    assert torch.allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    assert traced and not any("eye" in t for t in traced)
