"""The causal convolutions over packed documents (pos = position in document): no tap reaches
into an earlier document, in the forward and in every gradient; torch path against each
document alone (float64), Triton kernels (interpreter on CPU) against the torch path."""
import importlib.util
import os

import pytest
import torch

from tests.helpers import rel_err
from xlstm_kit.layers.fused import conv_silu, conv_state, conv_state_varlen, doc_positions
from xlstm_kit.layers.fused_slstm import slstm_gates

F64 = torch.float64
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 5, 2, 40, 3]       # length 1, shorter than the kernel, longer than one tile


def _cu(lengths, device="cpu"):
    return torch.tensor([0] + lengths, device=device).cumsum(0)


def test_doc_positions_and_varlen_conv_state():
    cu = _cu([1, 3, 2])
    assert doc_positions(cu, 6).tolist() == [0, 0, 1, 2, 0, 1]
    x = torch.randn(1, 6, 5, dtype=F64)
    st = conv_state_varlen(x, cu, 4)
    for n, (a, b) in enumerate([(0, 1), (1, 4), (4, 6)]):
        torch.testing.assert_close(st[n:n + 1], conv_state(x[:, a:b], None, 4))


@pytest.mark.parametrize("act", [True, False])
def test_conv_packed_equals_each_document(act):
    g = torch.Generator().manual_seed(0)
    T = sum(LENGTHS)
    x, w, b = (torch.randn(1, T, 6, generator=g, dtype=F64), torch.randn(6, 4, generator=g, dtype=F64),
               torch.randn(6, generator=g, dtype=F64))
    ins = [t.clone().requires_grad_(True) for t in (x, w, b)]
    dy = torch.randn(1, T, 6, generator=g, dtype=F64)
    y = conv_silu(ins[0], None, ins[1], ins[2], act=act, backend="torch", pos=doc_positions(_cu(LENGTHS), T))
    grads = torch.autograd.grad(y, ins, dy)
    ref_ins = [t.clone().requires_grad_(True) for t in (x, w, b)]
    bounds = _cu(LENGTHS).tolist()
    ref = torch.cat([conv_silu(ref_ins[0][:, a:e], None, ref_ins[1], ref_ins[2], act=act, backend="torch")
                     for a, e in zip(bounds[:-1], bounds[1:])], 1)
    ref_grads = torch.autograd.grad(ref, ref_ins, dy)
    torch.testing.assert_close(y, ref)
    for gr, r in zip(grads, ref_grads):
        torch.testing.assert_close(gr, r)
    assert rel_err(y, conv_silu(x, None, w, b, act=act, backend="torch")) > 1e-3   # the mask matters


@needs_triton
@pytest.mark.parametrize("act", [True, False])
def test_conv_triton_packed_matches_torch(act):
    g = torch.Generator().manual_seed(1)
    T = sum(LENGTHS)
    xs = [torch.randn(1, T, 20, generator=g, dtype=F64), torch.randn(20, 4, generator=g, dtype=F64),
          torch.randn(20, generator=g, dtype=F64)]
    dy = torch.randn(1, T, 20, generator=g, dtype=F64)
    results = []
    for dtype, backend in ((F64, "torch"), (torch.float32, "triton")):
        ins = [x.to(DEV, dtype).requires_grad_(True) for x in xs]
        pos = doc_positions(_cu(LENGTHS, DEV), T)
        y = conv_silu(ins[0], None, ins[1], ins[2], act=act, backend=backend, pos=pos)
        results.append([y, *torch.autograd.grad(y, ins, dy.to(DEV, dtype))])
    for j, (ref, got) in enumerate(zip(*results)):
        assert rel_err(got.double().cpu(), ref.cpu()) < 1e-5, j


@needs_triton
def test_slstm_gates_triton_packed_matches_torch():
    g = torch.Generator().manual_seed(2)
    lengths = [3, 1, 6]
    xs = [torch.randn(1, 10, 8, generator=g, dtype=F64), torch.randn(8, 4, generator=g, dtype=F64),
          torch.randn(8, generator=g, dtype=F64), torch.randn(4, 2, 4, 4, generator=g, dtype=F64)]
    dy = torch.randn(1, 10, 4, 2, 4, generator=g, dtype=F64)
    results = []
    for dtype, backend in ((F64, "torch"), (torch.float32, "triton")):
        ins = [x.to(DEV, dtype).requires_grad_(True) for x in xs]
        y = slstm_gates(ins[0], None, *ins[1:], backend=backend, pos=doc_positions(_cu(lengths, DEV), 10))
        results.append([y, *torch.autograd.grad(y, ins, dy.to(DEV, dtype))])
    bounds = _cu(lengths).tolist()
    ins = [x.clone().requires_grad_(True) for x in xs]
    ref = torch.cat([slstm_gates(ins[0][:, a:e], None, *ins[1:], backend="torch")
                     for a, e in zip(bounds[:-1], bounds[1:])], 1)
    results.append([ref, *torch.autograd.grad(ref, ins, dy)])
    for j, (ref, got, alone) in enumerate(zip(*results)):
        assert rel_err(ref.cpu(), alone) < 1e-12, j
        assert rel_err(got.double().cpu(), ref.cpu()) < 1e-5, j
