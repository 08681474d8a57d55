"""cu_seqlens (packed sequences) in every sequence op: packed outputs, final states and all
gradients (inputs and initial states) equal running each sequence alone; bad cu_seqlens fail
clearly. float64 on the torch path, tiny shapes."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.ops import (dplr_chunkwise, dplr_recurrent, kda_chunkwise, mlstm_chunkwise, mlstm_parallel,
                           mlstm_recurrent, slstm_recurrent)

H, K, V, L = 2, 4, 3, 4        # chunk_size L = 4: lengths 1, 3, 4, 5, 9 cross and end on chunks
LENGTHS = [[7], [1], [5, 1, 4, 9, 3], [4, 8], [1, 1, 6]]
DT = torch.float64


def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)


def _mlstm_inputs(T, g):
    return [torch.randn(1, T, H, d, generator=g, dtype=DT) for d in (K, K, V)] + \
           [torch.randn(1, T, H, generator=g, dtype=DT), 2 + torch.randn(1, T, H, generator=g, dtype=DT)]


def _mlstm_state(N, g):
    return (torch.randn(N, H, K, V, generator=g, dtype=DT), torch.randn(N, H, K, generator=g, dtype=DT).abs(),
            torch.randn(N, H, generator=g, dtype=DT))


def _dplr_inputs(T, g, H=H, K=K, V=V):
    q, k = (torch.randn(1, T, H, K, generator=g, dtype=DT) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=g, dtype=DT)
    a = F.normalize(torch.randn(1, T, H, K, generator=g, dtype=DT), dim=-1)
    b = -a * torch.rand(1, T, H, 1, generator=g, dtype=DT)
    gk = -torch.rand(1, T, H, K, generator=g, dtype=DT)
    return [q, k, v, a, b, gk]


def _kda_inputs(T, g, H=H, K=K, V=V):
    q, k = (torch.randn(1, T, H, K, generator=g, dtype=DT) for _ in range(2))
    return [q, F.normalize(k, dim=-1), torch.randn(1, T, H, V, generator=g, dtype=DT),
            -torch.rand(1, T, H, K, generator=g, dtype=DT), torch.rand(1, T, H, generator=g, dtype=DT)]


def _slstm_inputs(T, g):
    return [torch.randn(1, T, 4, H, K, generator=g, dtype=DT)]


_SLSTM_R = torch.randn(4, H, K, K, generator=torch.Generator().manual_seed(5), dtype=DT) / 2
_SLSTM_B = torch.randn(4, H, K, generator=torch.Generator().manual_seed(6), dtype=DT)

# name -> (op(*xs, **kw), inputs(T, g), initial state(N, g) or None)
OPS = {
    "mlstm_chunkwise": (lambda *xs, **kw: mlstm_chunkwise(*xs, chunk_size=L, **kw), _mlstm_inputs, _mlstm_state),
    "mlstm_recurrent": (mlstm_recurrent, _mlstm_inputs, _mlstm_state),
    "mlstm_parallel": (mlstm_parallel, _mlstm_inputs, None),
    "slstm_recurrent": (lambda xg, **kw: slstm_recurrent(xg, _SLSTM_R, _SLSTM_B, **kw), _slstm_inputs,
                        lambda N, g: tuple(torch.randn(N, H, K, generator=g, dtype=DT) for _ in range(4))),
    "dplr_chunkwise": (lambda *xs, **kw: dplr_chunkwise(*xs, chunk_size=L, **kw), _dplr_inputs,
                       lambda N, g: torch.randn(N, H, K, V, generator=g, dtype=DT)),
    "dplr_recurrent": (dplr_recurrent, _dplr_inputs, lambda N, g: torch.randn(N, H, K, V, generator=g, dtype=DT)),
    "kda_chunkwise": (lambda *xs, **kw: kda_chunkwise(*xs, chunk_size=L, **kw), _kda_inputs,
                      lambda N, g: torch.randn(N, H, K, V, generator=g, dtype=DT)),
}


def _flat_state(s):
    return [] if s is None else ([s] if isinstance(s, torch.Tensor) else list(s))


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda ls: "-".join(map(str, ls)))
def test_packed_equals_each_sequence_alone(name, lengths):
    op, make_inputs, make_state = OPS[name]
    g = torch.Generator().manual_seed(sum(lengths) * 31 + len(lengths))
    T, N = sum(lengths), len(lengths)
    xs = [x.requires_grad_() for x in make_inputs(T, g)]
    s0 = None if make_state is None else make_state(N, g)
    state_kw = {} if make_state is None else {"output_final_state": True}
    if s0 is not None:
        s0 = tuple(s.requires_grad_() for s in _flat_state(s0))
        state_kw["initial_state"] = s0[0] if len(s0) == 1 else s0
    out, fin = op(*xs, cu_seqlens=_cu(lengths).to(torch.int64 if N % 2 else torch.int32), **state_kw)
    leaves = xs + list(s0 or ())
    # a loss that reaches every output and every final state
    wo = torch.randn(out.shape, generator=g, dtype=DT)
    fin_l = _flat_state(fin)
    wf = [torch.randn(f.shape, generator=g, dtype=DT) for f in fin_l]
    grads = torch.autograd.grad((out * wo).sum() + sum((f * w).sum() for f, w in zip(fin_l, wf)), leaves)

    ref_out, ref_fin, pos = [], [], 0
    for n, ln in enumerate(lengths):
        seg = [x[:, pos:pos + ln] for x in xs]
        kw = {}
        if make_state is not None:
            kw["output_final_state"] = True
            if s0 is not None:
                rows = tuple(s[n:n + 1] for s in s0)
                kw["initial_state"] = rows[0] if len(rows) == 1 else rows
        o, f = op(*seg, **kw)
        ref_out.append(o)
        ref_fin.append(_flat_state(f))
        pos += ln
    ref_out = torch.cat(ref_out, 1)
    ref_fin_l = [torch.cat(parts, 0) for parts in zip(*ref_fin)] if fin_l else []
    ref_grads = torch.autograd.grad((ref_out * wo).sum() + sum((f * w).sum() for f, w in zip(ref_fin_l, wf)),
                                    leaves)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    assert len(fin_l) == len(ref_fin_l)
    for f, r in zip(fin_l, ref_fin_l):
        assert f.shape[0] == N
        torch.testing.assert_close(f, r, rtol=1e-10, atol=1e-10)
    for gr, r in zip(grads, ref_grads):
        torch.testing.assert_close(gr, r, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", sorted(OPS))
def test_packed_differs_from_unpacked(name):
    """The boundary matters: the second sequence without the reset gives another output."""
    op, make_inputs, _ = OPS[name]
    xs = make_inputs(6, torch.Generator().manual_seed(1))
    packed, _ = op(*xs, cu_seqlens=_cu([3, 3]))
    whole, _ = op(*xs)
    torch.testing.assert_close(packed[:, :3], whole[:, :3])
    assert (packed[:, 3:] - whole[:, 3:]).abs().max() > 1e-6


BAD = [
    (torch.tensor([0, 3, 3, 6]), "strictly increasing"),
    (torch.tensor([0, 4, 2, 6]), "strictly increasing"),
    (torch.tensor([1, 3, 6]), "start at 0"),
    (torch.tensor([0, 3, 5]), "end at the total length"),
    (torch.tensor([0.0, 3.0, 6.0]), "int32 or int64"),
    (torch.tensor([[0, 3, 6]]), "1-D"),
    ([0, 3, 6], "torch.Tensor"),
    (torch.tensor([0, 3, 6], device="meta"), "meta device"),
]


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("cu,msg", BAD, ids=[m for _, m in BAD])
def test_invalid_cu_seqlens(name, cu, msg):
    op, make_inputs, _ = OPS[name]
    xs = make_inputs(6, torch.Generator().manual_seed(2))
    with pytest.raises(XLSTMKitError, match=msg):
        op(*xs, cu_seqlens=cu)


@pytest.mark.parametrize("name", sorted(OPS))
def test_varlen_batch_and_state_rows(name):
    op, make_inputs, make_state = OPS[name]
    g = torch.Generator().manual_seed(3)
    xs = [torch.cat([x, x]) for x in make_inputs(6, g)]
    with pytest.raises(XLSTMKitError, match="B = 1"):
        op(*xs, cu_seqlens=_cu([2, 4]))
    if make_state is not None:
        s = _flat_state(make_state(3, g))
        with pytest.raises(XLSTMKitError, match="needs 2 rows"):
            op(*make_inputs(6, g), cu_seqlens=_cu([2, 4]), initial_state=s[0] if len(s) == 1 else tuple(s))


def _rewrite(cu, how, index, value):
    if how == "numpy":
        cu.numpy()[index] = value
    elif how == "data":
        cu.data[index] = value
    else:
        cu[index] = value


@pytest.mark.parametrize("name", sorted(OPS))
# numpy and .data writes leave the tensor's version counter as it was; an in-place torch write
# bumps it
@pytest.mark.parametrize("how", ["numpy", "data", "torch"])
def test_a_rewritten_cu_seqlens_buffer_is_read_again(name, how):
    """A cu_seqlens buffer reused with other boundaries: every call uses the values it holds
    then, however they were written; invalid values written the same way are refused."""
    op, make_inputs, _ = OPS[name]
    xs = make_inputs(6, torch.Generator().manual_seed(4))
    cu = torch.tensor([0, 2, 6])
    first, _ = op(*xs, cu_seqlens=cu)
    _rewrite(cu, how, 1, 4)
    out, _ = op(*xs, cu_seqlens=cu)
    ref, _ = op(*xs, cu_seqlens=torch.tensor([0, 4, 6]))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert (out - first).abs().max() > 1e-6
    _rewrite(cu, how, 1, 7)
    with pytest.raises(XLSTMKitError, match="strictly increasing"):
        op(*xs, cu_seqlens=cu)


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
    reason="the Triton kernels on CPU need TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("name", ["mlstm_chunkwise", "dplr_chunkwise", "kda_chunkwise", "slstm_recurrent"])
def test_packed_triton_matches_each_sequence_alone_in_float64(name):
    """The Triton backend with cu_seqlens (float32, interpreter) against each sequence alone on
    the torch path in float64: outputs, final states, gradients of inputs and initial states."""
    from xlstm_kit.ops._checks import run_varlen

    Hh, D = 1, 16
    lengths = [1, 6, 17]
    g = torch.Generator().manual_seed(9)
    T, N = sum(lengths), len(lengths)
    if name == "mlstm_chunkwise":
        xs = [torch.randn(1, T, Hh, D, generator=g, dtype=DT) for _ in range(3)] + \
             [torch.randn(1, T, Hh, generator=g, dtype=DT), 2 + torch.randn(1, T, Hh, generator=g, dtype=DT)]
        s0 = (torch.randn(N, Hh, D, D, generator=g, dtype=DT), torch.rand(N, Hh, D, generator=g, dtype=DT),
              torch.randn(N, Hh, generator=g, dtype=DT))
        op = mlstm_chunkwise
    elif name == "slstm_recurrent":
        xs = [torch.randn(1, T, 4, Hh, D, generator=g, dtype=DT)]
        r, b = torch.randn(4, Hh, D, D, generator=g, dtype=DT) / 4, torch.randn(4, Hh, D, generator=g, dtype=DT)
        s0 = tuple(torch.randn(N, Hh, D, generator=g, dtype=DT) for _ in range(4))

        def op(xg, **kw):
            return slstm_recurrent(xg, r.to(xg.dtype), b.to(xg.dtype), **kw)
    else:
        xs = (_dplr_inputs if name == "dplr_chunkwise" else _kda_inputs)(T, g, Hh, D, D)
        s0 = (torch.randn(N, Hh, D, D, generator=g, dtype=DT),)
        op = dplr_chunkwise if name == "dplr_chunkwise" else kda_chunkwise

    def run(dtype, backend, packed):
        ins = [x.to(dtype).requires_grad_() for x in xs]
        st = tuple(s.to(dtype).requires_grad_() for s in s0)
        init = st[0] if len(st) == 1 else st
        fn = lambda *a, **kw: op(*a, backend=backend, **kw)  # noqa: E731
        if packed:
            out, fin = fn(*ins, cu_seqlens=_cu(lengths), initial_state=init, output_final_state=True)
        else:
            out, fin = run_varlen(fn, ins, _cu(lengths).tolist(), init, True)
        fin = _flat_state(fin)
        w = torch.Generator().manual_seed(1)
        loss = sum((o.double() * torch.randn(o.shape, generator=w, dtype=DT)).sum() for o in [out, *fin])
        return [out, *fin, *torch.autograd.grad(loss, ins + list(st))]

    got = run(torch.float32, "triton", True)
    ref = run(DT, "torch", False)
    for j, (a, b) in enumerate(zip(got, ref)):
        err = ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()
        assert err < 2e-4, (j, err)
