"""Packed sequences (`cu_seqlens`) in the Triton chunkwise DPLR/KDA kernels: outputs, final
states and every gradient (initial state included) equal each sequence run alone through the
float64 PyTorch reference (`backend="torch"`, its per-sequence loop); nothing crosses a
boundary. Tiny float32 shapes under TRITON_INTERPRET=1; lengths cover 1, chunk multiples and
not, boundaries inside a chunk, one and several sequences."""
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err

triton = pytest.importorskip("triton")
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not HAS_CUDA and not INTERPRET:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from xlstm_kit.errors import XLSTMKitError  # noqa: E402
from xlstm_kit.ops import dplr_chunkwise, kda_chunkwise  # noqa: E402
from xlstm_kit.ops.dplr.triton import op as tri  # noqa: E402
from xlstm_kit.ops.dplr.triton.op import dplr_chunkwise_triton  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"


def _cu(lens, device=DEV):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _inputs(kind, lens, H, K, V, state, seed, gmin=-2.0):
    """float64 packed inputs [1, T, ...] of `kind` ("dplr": q, k, v, a, b, gk; "kda": q, k, v, g,
    beta), initial states [N, H, K, V] or None, and the weights of the loss (o, final state)."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q, k, v = r(1, T, H, K), r(1, T, H, K) / K ** 0.5, r(1, T, H, V)
    gk = u(1, T, H, K) * gmin
    if kind == "dplr":
        a = F.normalize(r(1, T, H, K), dim=-1)
        xs = [q, k, v, a, -a * u(1, T, H, 1), gk]
    else:
        xs = [q, F.normalize(k, dim=-1), v, gk, u(1, T, H)]
    s0 = r(N, H, K, V) if state else None
    return xs, s0, (r(1, T, H, V), r(N, H, K, V))


def _run(op, xs, s0, ws, dtype, **kw):
    """(o, final state, gradients of Σ o·w_o + Σ S·w_S w.r.t. the inputs and the initial state)."""
    ys = [x.to(DEV, dtype).requires_grad_() for x in xs]
    y0 = None if s0 is None else s0.to(DEV, dtype).requires_grad_()
    o, sT = op(*ys, initial_state=y0, output_final_state=True, **kw)
    loss = (o.double() * ws[0].to(DEV)).sum() + (sT.double() * ws[1].to(DEV)).sum()
    grads = torch.autograd.grad(loss, ys + ([] if y0 is None else [y0]))
    return [o, sT, *grads]


OPS = {"dplr": dplr_chunkwise, "kda": kda_chunkwise}
NAMES = {"dplr": ["o", "S", "q", "k", "v", "a", "b", "gk", "h0"],
         "kda": ["o", "S", "q", "k", "v", "g", "beta", "h0"]}


@pytest.mark.parametrize("kind,lens,H,L,state", [
    ("dplr", [1, 5, 64, 70], 1, 64, True),     # length 1, a chunk multiple, a partial tail
    ("dplr", [130], 1, 64, False),             # one sequence, no initial state
    ("dplr", [20, 1, 13], 1, 16, False),       # boundaries inside chunks of 16
    # the key gradient's two kernels: sub-chunks past a sequence's end, chunks of 32
    ("dplr", [1, 5, 64, 70], 2, 64, True),
    ("dplr", [20, 1, 45], 1, 32, False),
    ("kda", [1, 5, 64, 70], 1, 64, True),
    ("kda", [130], 2, 64, False),
    ("kda", [20, 1, 13], 2, 16, True),         # the KDA kernels with boundaries inside chunks
    ("kda", [1, 5, 64, 70], 2, 64, True),      # sub-chunks of the key gradient past a sequence's end
])
def test_packed_equals_each_sequence_alone(kind, lens, H, L, state):
    xs, s0, ws = _inputs(kind, lens, H, 16, 16, state, seed=len(lens) * 7 + H)
    cu = _cu(lens)
    got = _run(OPS[kind], xs, s0, ws, torch.float32, backend="triton", chunk_size=L, cu_seqlens=cu)
    ref = _run(OPS[kind], xs, s0, ws, torch.float64, backend="torch", chunk_size=L, cu_seqlens=cu)
    assert got[1].shape == (len(lens), H, 16, 16)
    for name, x, y in zip(NAMES[kind], got, ref):
        assert torch.isfinite(x).all(), name
        assert rel_err(x.double().cpu(), y.cpu()) < 1e-5, name


@pytest.mark.parametrize("kind", ["dplr", "kda"])
def test_packed_path_runs_no_python_loop(monkeypatch, kind):
    # the Triton path is one pass for all sequences: the per-sequence loop must not run, and the
    # kernels see the chunk table (one _fwd_state launch whose grid has a program per sequence)
    import xlstm_kit.ops.dplr as dplr_pkg
    import xlstm_kit.ops.dplr.triton.kda_op as kda_op
    monkeypatch.setattr(dplr_pkg, "run_varlen", lambda *a, **k: pytest.fail("Python loop on the Triton path"))
    launches = []
    mod = tri if kind == "dplr" else kda_op
    real = mod._fwd_state

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(mod, "_fwd_state", Spy())
    xs, s0, _ = _inputs(kind, [3, 17], 2, 16, 16, True, seed=1)
    o, sT = OPS[kind](*(x.float().to(DEV) for x in xs), initial_state=s0.float().to(DEV),
                      output_final_state=True, chunk_size=16, backend="triton", cu_seqlens=_cu([3, 17]))
    assert launches == [(1, 2 * 2)] and o.shape == (1, 20, 2, 16) and sT.shape == (2, 2, 16, 16)


def test_packed_custom_op_passes_opcheck():
    # schema and fake implementation with cu_seqlens (the unpacked opcheck in test_dplr_triton.py
    # covers autograd and aot_dispatch of the same op, at a few seconds each in the interpreter)
    from xlstm_kit.ops.dplr.triton.config import DPLRKernelConfig
    xs, s0, _ = _inputs("dplr", [10, 6], 1, 16, 16, True, seed=4)
    ys = [x.float().to(DEV).requires_grad_() for x in xs] + [s0.float().to(DEV).requires_grad_()]
    torch.library.opcheck(tri._fwd_op, (*ys, 0.25, 16, DPLRKernelConfig().key(), _cu([10, 6])),
                          test_utils=("test_schema", "test_faketensor"))


def test_packed_compiles_fullgraph_like_eager():
    # the kernel entry point takes cu_seqlens without a host sync: one graph, eager's values and
    # gradients (bit-identical: the same kernels run)
    lens = [4, 16, 1]
    xs, s0, ws = _inputs("dplr", lens, 2, 16, 16, True, seed=6)
    cu = _cu(lens)

    def fn(*ys, initial_state, output_final_state, **kw):
        return dplr_chunkwise_triton(*ys, initial_state=initial_state, output_final_state=output_final_state,
                                     chunk_size=16, cu_seqlens=cu)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    eager, comp = (_run(f, xs, s0, ws, torch.float32) for f in (fn, compiled))
    for name, x, y in zip(NAMES["dplr"], eager, comp):
        assert torch.equal(x, y), name


def test_bad_cu_seqlens_raise():
    xs, s0, _ = _inputs("dplr", [4, 4], 1, 16, 16, True, seed=2)
    xs = [x.float().to(DEV) for x in xs]
    for bad in (torch.tensor([0, 5, 4, 8]), torch.tensor([0, 4, 7]), torch.tensor([0., 4., 8.]),
                torch.tensor([1, 8])):
        with pytest.raises(XLSTMKitError):
            dplr_chunkwise(*xs, chunk_size=16, backend="triton", cu_seqlens=bad.to(DEV))
    with pytest.raises(XLSTMKitError):       # batch > 1
        dplr_chunkwise(*(x.expand(2, -1, -1, -1) for x in xs), chunk_size=16, backend="triton",
                       cu_seqlens=_cu([4, 4]))
    with pytest.raises(XLSTMKitError):       # one state row per sequence
        dplr_chunkwise(*xs, initial_state=s0[:1].float().to(DEV), chunk_size=16, backend="triton",
                       cu_seqlens=_cu([4, 4]))
    with pytest.raises(XLSTMKitError):       # the kernel entry point checks shapes too (no sync)
        dplr_chunkwise_triton(*xs, initial_state=s0[:1].float().to(DEV), chunk_size=16,
                              cu_seqlens=_cu([4, 4]))
    with pytest.raises(XLSTMKitError):
        dplr_chunkwise_triton(*xs, chunk_size=16, cu_seqlens=_cu([4, 4]).float())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dplr", "kda"])
def test_gpu_bf16_packed_within_twice_torch_bf16_error(kind):
    # the 2x rule per output and gradient: packed Triton in bf16 against the float64 reference
    # of each sequence alone, next to the PyTorch bf16 op (also each sequence alone)
    lens = [1, 63, 64, 65, 200, 1000, 7]
    xs, s0, ws = _inputs(kind, lens, 4, 128, 128, True, seed=3, gmin=-1.0)
    cu = _cu(lens, "cuda")
    got = _run(OPS[kind], xs, s0, ws, torch.bfloat16, backend="triton", cu_seqlens=cu)
    pt = _run(OPS[kind], xs, s0, ws, torch.bfloat16, backend="torch", cu_seqlens=cu)
    ref = _run(OPS[kind], xs, s0, ws, torch.float64, backend="torch", cu_seqlens=cu)
    for name, x, y, z in zip(NAMES[kind], got, pt, ref):
        assert rel_err(x.double(), z) <= 2 * rel_err(y.double(), z) + 1e-6, name
