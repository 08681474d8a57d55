"""Ops pick their own precision: an enclosing torch.autocast region must not change the result."""
import torch

from xlstm_kit.ops import dplr_chunkwise, mlstm_chunkwise, slstm_recurrent


def _cases():
    B, T, H, K, V, D = 2, 37, 2, 8, 8, 8
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, H, V)
    i, f = torch.randn(B, T, H), torch.randn(B, T, H) + 2
    yield "mlstm", lambda *t: mlstm_chunkwise(*t, chunk_size=16)[0], (q, k, v, i, f)
    # the sLSTM's time loop is unrolled when compiled, at a cost per step: 6 steps, not 37
    xg, r, b = torch.randn(B, 6, 4, H, D), torch.randn(4, H, D, D) / D**0.5, torch.randn(4, H, D)
    yield "slstm", lambda *t: slstm_recurrent(*t)[0], (xg, r, b)
    a = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    bb = -a * torch.rand(B, T, H, 1)
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K) + 3)
    yield "dplr", lambda *t: dplr_chunkwise(*t, chunk_size=16)[0], (q, k, v, a, bb, gk)


def test_ops_ignore_enclosing_autocast():
    for name, op, inputs in _cases():
        plain = [t.clone().requires_grad_() for t in inputs]
        cast = [t.clone().requires_grad_() for t in inputs]
        ref = op(*plain)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = op(*cast)
        assert out.dtype == torch.float32, name
        torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=name)
        g = torch.randn_like(ref)
        ref.backward(g)
        out.backward(g)
        for x, y in zip(cast, plain):
            torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0, msg=name)


def test_autocast_off_traces_in_one_graph_under_autocast():
    """torch.compile traces an autocast_off op inside an autocast region without a graph break
    (an ExitStack of autocast contexts broke every compiled block's graph under bf16 training),
    and autocast is really off inside: the op's matmul stays float32."""
    from torch._dynamo.utils import counters

    from xlstm_kit.ops._checks import autocast_off

    @autocast_off
    def inner(a, b):
        return a @ b

    def f(a, b):
        return inner(a, b), a @ b

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    torch._dynamo.reset()
    counters.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        off, on = torch.compile(f, backend="eager", fullgraph=True)(a, b)
    assert off.dtype == torch.float32 and on.dtype == torch.bfloat16
    torch.testing.assert_close(off, a @ b)
    assert sum(counters["graph_break"].values()) == 0


def test_compiled_ops_backward_ignores_enclosing_autocast():
    """Under torch.compile, AOT autograd traces a hand-written backward under the forward's
    ambient autocast, where Dynamo sees the op's own autocast_off: each op's backward must turn
    autocast off itself (the mLSTM's float32 accumulators met bf16 matmuls: a dtype error); and
    fullgraph: the sLSTM's backward wrote through out= into strided views, which Dynamo refuses."""
    for name, op, inputs in _cases():
        plain = [t.clone().requires_grad_() for t in inputs]
        cast = [t.clone().requires_grad_() for t in inputs]
        ref = op(*plain)
        torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.compile(op, backend="aot_eager", fullgraph=True)(*cast)
        assert out.dtype == torch.float32, name
        g = torch.randn_like(ref)
        ref.backward(g)
        out.backward(g)
        for x, y in zip(cast, plain):  # aot_eager's decompositions reorder some float32 sums
            assert ((x.grad - y.grad).abs().max() / y.grad.abs().max()).item() < 1e-5, name
