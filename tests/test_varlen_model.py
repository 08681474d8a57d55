"""Packed documents through the model (cu_seqlens): logits, per-document states and parameter
gradients equal running each document alone, for every block type (mLSTM, sLSTM, DPLR, large).
float64 on CPU, tiny models."""
from __future__ import annotations

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError

CONFIGS = {
    "mlstm": dict(n_blocks=2, slstm_at=[]),
    "slstm": dict(n_blocks=2, slstm_at=[1]),
    "dplr": dict(n_blocks=2, slstm_at=[], dplr_at=[0]),
    "large": dict(n_blocks=2, family="large", slstm_at=[]),
}


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def make_model(kind, seed=0):
    torch.manual_seed(seed)
    cfg = XLSTMConfig(vocab_size=64, d_model=32, n_heads=2, chunk_size=4, **CONFIGS[kind])
    model = XLSTMLanguageModel(cfg).double()
    with torch.no_grad():  # every weight off its initial value
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("lengths", [[1, 6, 3], [9]], ids=["1-6-3", "9"])
def test_packed_model_equals_each_document(kind, lengths):
    model = make_model(kind)
    g = torch.Generator().manual_seed(len(lengths))
    tokens = torch.randint(0, 64, (1, sum(lengths)), generator=g)
    w = torch.randn(1, sum(lengths), 64, generator=g, dtype=torch.float64)
    logits, state = model(tokens, return_state=True, cu_seqlens=_cu(lengths))
    (logits * w).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref, ref_states, pos = [], [], 0
    for ln in lengths:
        lg, st = model(tokens[:, pos:pos + ln], return_state=True)
        ref.append(lg)
        ref_states.append(st)
        pos += ln
    ref = torch.cat(ref, 1)
    (ref * w).sum().backward()
    torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-9)
    for t, s in enumerate(state):
        for name, x in zip(s._fields, s):
            assert x.shape[0] == len(lengths), (t, name)
            torch.testing.assert_close(x, torch.cat([getattr(rs[t], name) for rs in ref_states]), rtol=1e-9,
                                       atol=1e-9)
    for gp, p in zip(grads, model.parameters()):
        torch.testing.assert_close(gp, p.grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["mlstm", "large"])
def test_packed_model_continues_per_document_state(kind):
    """A state of N rows continues N packed documents; a wrong number of rows is refused."""
    model = make_model(kind, seed=1)
    tokens = torch.randint(0, 64, (1, 10))
    _, state = model(tokens, return_state=True, cu_seqlens=_cu([4, 6]))
    more = torch.randint(0, 64, (1, 5))
    logits, _ = model(more, state=state, return_state=True, cu_seqlens=_cu([2, 3]))
    full0 = model(torch.cat([tokens[:, :4], more[:, :2]], 1))
    full1 = model(torch.cat([tokens[:, 4:], more[:, 2:]], 1))
    torch.testing.assert_close(logits[:, :2], full0[:, 4:])
    torch.testing.assert_close(logits[:, 2:], full1[:, 6:])
    with pytest.raises(XLSTMKitError, match="batch size 2 but the tokens have 3 documents"):
        model(more, state=state, cu_seqlens=_cu([1, 1, 3]))


def test_model_rejects_bad_cu_seqlens():
    model = make_model("mlstm")
    with pytest.raises(XLSTMKitError, match="end at the total length"):
        model(torch.zeros(1, 6, dtype=torch.long), cu_seqlens=_cu([2, 3]))
    with pytest.raises(XLSTMKitError, match="B = 1"):
        model(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=_cu([2, 3]))
    with pytest.raises(XLSTMKitError, match="meta device") as err:
        model(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=_cu([2, 3]).to("meta"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("how", ["numpy", "data"])
def test_packed_model_reads_a_rewritten_cu_seqlens_again(kind, how, monkeypatch):
    """A cu_seqlens buffer rewritten between calls through numpy or .data (neither bumps the
    tensor's version counter): the model uses the new boundaries in every layer. Within one
    call the values are read back once, however many layers take them."""
    from xlstm_kit.ops import _checks

    model = make_model(kind)
    tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    cu = _cu([2, 4])
    first = model(tokens, cu_seqlens=cu)
    if how == "numpy":
        cu.numpy()[1] = 4
    else:
        cu.data[1] = 4
    reads = []
    read = _checks.read_cu_seqlens
    monkeypatch.setattr(_checks, "read_cu_seqlens", lambda c: reads.append(1) or read(c))
    out = model(tokens, cu_seqlens=cu)
    assert len(reads) == 1
    torch.testing.assert_close(out, model(tokens, cu_seqlens=_cu([4, 2])), rtol=0, atol=0)
    assert (out - first).abs().max() > 1e-6


def test_packed_model_under_activation_checkpointing():
    model = make_model("slstm", seed=2)
    model.set_activation_checkpointing("all")
    tokens = torch.randint(0, 64, (1, 9))
    cu = _cu([4, 5])
    out = model(tokens, cu_seqlens=cu)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = torch.cat([model(tokens[:, :4]), model(tokens[:, 4:])], 1)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_packed_model_under_bf16_autocast_close_to_float64():
    model = make_model("mlstm", seed=4)
    tokens = torch.randint(0, 64, (1, 12))
    cu = _cu([7, 5])
    exact = model(tokens, cu_seqlens=cu)
    model.float()
    with torch.autocast("cpu", torch.bfloat16):
        got = model(tokens, cu_seqlens=cu).double()
    assert (got - exact).abs().max() / exact.abs().max() < 5e-2
