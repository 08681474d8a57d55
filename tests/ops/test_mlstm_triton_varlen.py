"""Packed sequences (`cu_seqlens`) in the Triton chunkwise mLSTM kernels: h, the final states
and every gradient equal running each sequence alone through the same op, and the float64
recurrent reference; nothing crosses a boundary. Tiny float32 shapes under TRITON_INTERPRET=1
(how `make test` runs them); the lengths cover 1, chunk multiples and not, boundaries inside
a chunk and a single sequence."""
import os

import pytest
import torch

from tests.helpers import rel_err

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from xlstm_kit.errors import XLSTMKitError  # noqa: E402
from xlstm_kit.ops.mlstm.naive import mlstm_recurrent_naive  # noqa: E402
from xlstm_kit.ops.mlstm.triton import MLSTMKernelConfig, mlstm_chunkwise_triton  # noqa: E402
from xlstm_kit.ops.mlstm.triton import op as tri_op  # noqa: E402
from xlstm_kit.ops.mlstm.triton.varlen import chunk_table  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"
K = V = 16
L = 16


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)


def _inputs(lens, H, state, seed, gates="normal", K=K, V=V):
    """float64 inputs [1,T,...], initial states [N,...] (or None) and output weights."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    scale = 1.0 if gates == "normal" else 8.0
    xs = [r(1, T, H, K), r(1, T, H, K), r(1, T, H, V), r(1, T, H) * scale,
          r(1, T, H) * (1.0 if gates == "normal" else 10.0) + (2.0 if gates == "normal" else 0.0)]
    st = [r(N, H, K, V) * 0.5, r(N, H, K) * 0.5, r(N, H)] if state else None
    ups = [r(1, T, H, V), r(N, H, K, V), r(N, H, K), r(N, H)]
    return xs, st, ups


def _loss(h, fin, ups):
    C, n, m = fin
    return ((h.double() * ups[0]).sum() + (C.double() * ups[1]).sum() + (n.double() * ups[2]).sum()
            + (m.double() * ups[3]).sum())


def _grads(run, xs, st, ups, dtype):
    """(h, C, n, m) and the gradients of the weighted loss w.r.t. the inputs (and states)."""
    xs = [x.to(DEV, dtype).requires_grad_(True) for x in xs]
    st = None if st is None else [s.to(DEV, dtype).requires_grad_(True) for s in st]
    h, fin = run(xs, st)
    loss = _loss(h, fin, [u.to(DEV) for u in ups])
    ins = xs + ([] if st is None else st)
    return [h, *fin], list(torch.autograd.grad(loss, ins))


def _separately(fn, lens, cu):
    """fn applied to each sequence alone (its rows and its state row), results concatenated."""
    def run(xs, st):
        hs, fins = [], []
        for j in range(len(lens)):
            a, b = int(cu[j]), int(cu[j + 1])
            s = None if st is None else [x[j:j + 1] for x in st]
            h, fin = fn([x[:, a:b] for x in xs], s)
            hs.append(h)
            fins.append(fin)
        return torch.cat(hs, 1), [torch.cat(p, 0) for p in zip(*fins)]
    return run


def _triton(cu=None, **kw):
    def fn(xs, st):
        return mlstm_chunkwise_triton(*xs, initial_state=st, output_final_state=True, chunk_size=L,
                                      cu_seqlens=None if cu is None else cu.to(DEV), **kw)
    return fn


def _reference(xs, st):
    return mlstm_recurrent_naive(*xs, None if st is None else tuple(st), 1e-6)


CASES = [
    # lengths, heads, initial state, gates, extra op arguments
    ([5, 16, 1, 23], 2, True, "normal", {"recompute_states": True}),
    ([1, 1, 17, 32, 3], 1, False, "extreme", {}),
    ([33], 2, True, "normal", {}),
    ([16, 9, 20], 1, True, "normal",
     {"config": MLSTMKernelConfig.tuned(K, V, torch.float32, L).replace(fused_max_k=0)}),
]


@pytest.mark.parametrize("lens,H,state,gates,kw", CASES, ids=["mixed-recompute", "len1", "one", "ktiled"])
def test_packed_equals_each_sequence_alone(lens, H, state, gates, kw):
    """Packed run == each sequence through the same op alone (float32, the same kernels: equal
    up to rounding) and == the float64 recurrent reference; h, final states, every gradient."""
    cu = _cu(lens)
    xs, st, ups = _inputs(lens, H, state, seed=len(lens), gates=gates)
    packed = _grads(_triton(cu, **kw), xs, st, ups, torch.float32)
    alone = _grads(_separately(_triton(**kw), lens, cu), xs, st, ups, torch.float32)
    ref = _grads(_separately(_reference, lens, cu), xs, st, ups, torch.float64)
    names = "h C n m".split() + "dq dk dv di df dC0 dn0 dm0".split()
    for name, a, b, r in zip(names, packed[0] + packed[1], alone[0] + alone[1], ref[0] + ref[1]):
        assert a.shape == r.shape, (name, a.shape, r.shape)
        assert rel_err(a.cpu(), b.cpu()) < 1e-6, (name, rel_err(a.cpu(), b.cpu()))
        assert rel_err(a.cpu(), r) < 1e-4, (name, rel_err(a.cpu(), r))


def test_packed_without_final_state_equals_unpacked():
    """Without states (no final-state gradient: only h's flows back): one sequence with
    cu_seqlens = [0, T] gives the unpacked call's values and gradients, and two packed
    sequences those of each run alone."""
    T, H = 37, 2
    xs, _, ups = _inputs([T], H, False, seed=7)

    def run(lens, cu):
        ins = [x.to(DEV, torch.float32).requires_grad_(True) for x in xs]
        hs = []
        for a, b in ([(0, T)] if cu is not None else zip(_cu(lens)[:-1].tolist(), _cu(lens)[1:].tolist())):
            h, fin = mlstm_chunkwise_triton(*(x[:, a:b] for x in ins), chunk_size=L, cu_seqlens=cu)
            assert fin is None
            hs.append(h)
        h = torch.cat(hs, 1)
        return [h] + list(torch.autograd.grad((h.double() * ups[0].to(DEV)).sum(), ins))

    for lens in ([T], [7, 30]):
        for a, b in zip(run(lens, _cu(lens).to(DEV)), run(lens, None)):
            assert rel_err(a.cpu(), b.cpu()) < 1e-6


def test_chunk_table_splits_each_sequence_into_its_own_chunks():
    """The table: every real chunk inside one sequence, in order, the last one of each sequence
    partial; the spare chunks (the shape-only bound) marked −1."""
    lens = [5, 16, 1, 23, 32]
    cu = _cu(lens)
    vl = chunk_table(cu, sum(lens), L)
    assert vl.nc == -(-sum(lens) // L) + len(lens) - 1
    want = []
    for j, n in enumerate(lens):
        for c0 in range(0, n, L):
            want.append([j, int(cu[j]) + c0, int(cu[j + 1]), 0])
    tab = vl.tab.tolist()
    assert tab[:len(want)] == want
    assert all(row[0] == -1 for row in tab[len(want):])
    assert vl.sinfo[:, 3].tolist() == torch.tensor([-(-n // L) for n in lens]).cumsum(0).tolist()


def test_packed_rejects_bad_shapes():
    xs = [torch.randn(2, 8, 1, K), torch.randn(2, 8, 1, K), torch.randn(2, 8, 1, V), torch.randn(2, 8, 1),
          torch.randn(2, 8, 1)]
    with pytest.raises(XLSTMKitError, match="batch 1"):
        mlstm_chunkwise_triton(*xs, cu_seqlens=torch.tensor([0, 3, 8]))
    one = [x[:1] for x in xs]
    with pytest.raises(XLSTMKitError, match="int32 or int64"):
        mlstm_chunkwise_triton(*one, cu_seqlens=torch.tensor([0.0, 3.0, 8.0]))
    with pytest.raises(XLSTMKitError, match="rows"):
        mlstm_chunkwise_triton(*one, cu_seqlens=torch.tensor([0, 3, 8]),
                               initial_state=(torch.zeros(3, 1, K, V), torch.zeros(3, 1, K), torch.zeros(3, 1)))


def test_packed_16bit_stored_states_keep_final_state_gradient(monkeypatch):
    """16-bit stored states (bfloat16's numerics, emulated with float16 storage: the
    interpreter has no bfloat16) with a final-state gradient: packed sequences keep their
    δ-states in float32 and split them (every sequence has a last chunk; running alone takes
    the last-chunk launch of backward.last_chunk_apart instead). Each packed output and
    gradient is within 2x of the alone run's error against the float64 reference. (At these
    sizes float16 storage does not reproduce the bfloat16 cancellation that motivated the
    split: this guards the path, the H200 bfloat16 check judges its benefit.)"""
    orig = tri_op.numerics
    monkeypatch.setattr(tri_op, "numerics", lambda dt: (torch.float16, 1, 0, "tf32") if dt == torch.float16
                        else orig(dt))
    lens = [1, 20, 7]
    cu = _cu(lens)
    xs, st, ups = _inputs(lens, 1, True, seed=11)
    # q, k, v in float16, the gates and states in float32, as the model calls it
    def cast(run):
        return lambda a, s: run([x.half() if j < 3 else x for j, x in enumerate(a)], [x.float() for x in s])
    packed = _grads(cast(_triton(cu)), xs, st, ups, torch.float32)
    alone = _grads(cast(_separately(_triton(), lens, cu)), xs, st, ups, torch.float32)
    ref = _grads(_separately(_reference, lens, cu), xs, st, ups, torch.float64)
    names = "h C n m".split() + "dq dk dv di df dC0 dn0 dm0".split()
    for name, a, b, r in zip(names, packed[0] + packed[1], alone[0] + alone[1], ref[0] + ref[1]):
        ea, eb = rel_err(a.cpu(), r), rel_err(b.cpu(), r)
        assert ea <= 2 * eb + 1e-6, (name, ea, eb)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA (run with -m gpu on the GPU machine)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_packed_within_twice_each_sequence_alone(dtype):
    """On the GPU at the benchmark's head size (K = V = 128, chunk 64, default configuration):
    every packed output and gradient is within 2x of the alone runs' error against the float64
    reference (q, k, v in `dtype`; gates and states float32)."""
    lens = [1, 63, 64, 65, 200, 130]
    cu = _cu(lens)
    xs, st, ups = _inputs(lens, 4, True, seed=5, K=128, V=128)

    def cast(run):
        return lambda a, s: run([x.to(dtype) if j < 3 else x for j, x in enumerate(a)], [x.float() for x in s])

    def tri(c=None):
        return lambda xs, st: mlstm_chunkwise_triton(*xs, initial_state=st, output_final_state=True,
                                                     cu_seqlens=None if c is None else c.to(DEV))
    packed = _grads(cast(tri(cu)), xs, st, ups, torch.float32)
    alone = _grads(cast(_separately(tri(), lens, cu)), xs, st, ups, torch.float32)
    ref = _grads(_separately(_reference, lens, cu), xs, st, ups, torch.float64)
    names = "h C n m".split() + "dq dk dv di df dC0 dn0 dm0".split()
    for name, a, b, r in zip(names, packed[0] + packed[1], alone[0] + alone[1], ref[0] + ref[1]):
        ea, eb = rel_err(a.float().cpu(), r.cpu()), rel_err(b.float().cpu(), r.cpu())
        assert ea <= 2 * eb + 1e-6, (name, ea, eb)
