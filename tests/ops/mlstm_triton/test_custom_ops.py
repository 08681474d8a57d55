"""The kernels as torch.library custom ops: registration checks (opcheck) and torch.compile
treating them as opaque ops (one graph, same values and gradients as eager)."""
import pytest
import torch

from tests.helpers import rel_err
from tests.ops.mlstm_triton.phase_inputs import DEV
from xlstm_kit.ops import mlstm_chunkwise
from xlstm_kit.ops.mlstm.triton import MLSTMKernelConfig, mlstm_chunkwise_triton, mlstm_step_triton


def _inputs(B=1, T=20, H=2, K=16, V=16, grad=True):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g),
          torch.randn(B, T, H, V, generator=g), torch.randn(B, T, H, generator=g),
          torch.randn(B, T, H, generator=g) + 2.0]
    st = [torch.randn(B, H, K, V, generator=g), torch.randn(B, H, K, generator=g), torch.randn(B, H, generator=g)]
    return [x.to(DEV).requires_grad_(grad) for x in xs], [s.to(DEV).requires_grad_(grad) for s in st]


def _assert_compiled_equals_eager(fn, inputs):
    """fn(*inputs) -> (loss, h) under torch.compile(fullgraph) equals eager (h and every input
    gradient), with the mLSTM custom op one node of the graph."""
    graph_ops = []
    compiled = torch.compile(fn, backend=_recording_backend(graph_ops), fullgraph=True)
    results = []
    for f in (fn, compiled):
        ins = [x.detach().requires_grad_(True) for x in inputs]
        loss, h = f(*ins)
        results.append([h] + list(torch.autograd.grad(loss, ins)))
    for j, (a, b) in enumerate(zip(*results)):
        assert rel_err(a, b) < 1e-6, j
    assert "xlstm_kit.mlstm_chunkwise_fwd.default" in graph_ops, graph_ops


def test_chunkwise_fwd_op_passes_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of
    xlstm_kit::mlstm_chunkwise_fwd, with and without an initial state."""
    xs, st = _inputs(T=5, H=1)
    cfg = MLSTMKernelConfig.tuned(16, 16, torch.float32, 16)
    for state in (st, [None, None, None]):
        torch.library.opcheck(torch.ops.xlstm_kit.mlstm_chunkwise_fwd.default, (*xs, *state, 1e-6, cfg.key()))
    # without saved chunk states (the backward recomputes them): a 0-chunk cs output
    key = cfg.replace(recompute_states=True).key()
    torch.library.opcheck(torch.ops.xlstm_kit.mlstm_chunkwise_fwd.default, (*xs, *st, 1e-6, key))


def test_step_op_passes_opcheck():
    xs, st = _inputs(T=1, grad=False)
    step_in = [x[:, 0].contiguous() for x in xs]
    for state in (st, [None, None, None]):
        torch.library.opcheck(torch.ops.xlstm_kit.mlstm_step.default, (*step_in, *state, 1e-6, 0))


def test_compile_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) through the public op with backend="triton": no graph
    break, and h, the final state and every gradient equal eager's."""
    def fn(q, k, v, i, f, C, n, m):
        h, (C1, n1, m1) = mlstm_chunkwise(q, k, v, i, f, initial_state=(C, n, m), output_final_state=True,
                                          backend="triton", chunk_size=16)
        return (h * h).sum() + (C1 * C1).sum() + n1.sum() + m1.sum(), h

    xs, st = _inputs()
    _assert_compiled_equals_eager(fn, xs + st)


def _recording_backend(graph_ops):
    def backend(gm, example_inputs):  # "eager", recording the captured graph's calls
        graph_ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward
    return backend


def test_compile_step_and_config_fullgraph():
    """The decode step and a chunkwise call with an explicit configuration compile to one
    graph holding the custom op, with eager's values."""
    xs, st = _inputs(grad=False)
    graph_ops = []
    def step(*a):
        h, state = mlstm_step_triton(*a[:5], tuple(a[5:]))
        return (h, *state)

    step_in = [x[:, 0] for x in xs] + st
    for a, b in zip(torch.compile(step, backend=_recording_backend(graph_ops), fullgraph=True)(*step_in),
                    step(*step_in)):
        assert torch.equal(a, b)
    assert "xlstm_kit.mlstm_step.default" in graph_ops
    cfg = MLSTMKernelConfig.tuned(16, 16, torch.float32, 16).replace(seq_scan=True)
    chunk = lambda *a: mlstm_chunkwise_triton(*a, config=cfg)[0]
    assert torch.equal(torch.compile(chunk, backend=_recording_backend(graph_ops), fullgraph=True)(*xs), chunk(*xs))
    assert "xlstm_kit.mlstm_chunkwise_fwd.default" in graph_ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_compile_matches_eager_and_opcheck(dtype):
    """On the GPU: the compiled call (custom ops) equals the eager one (direct launches, the
    same kernels) in h and every gradient, at a benchmark-like head size; opcheck of the
    forward op at a small size."""
    xs, st = _inputs(B=1, T=300, H=2, K=128, V=128)
    xs = [x.detach().to(dtype) if j < 3 else x.detach() for j, x in enumerate(xs)]

    def fn(q, k, v, i, f, C, n, m):
        h, (C1, n1, m1) = mlstm_chunkwise(q, k, v, i, f, initial_state=(C, n, m), output_final_state=True)
        return (h.float() * h.float()).sum() + (C1 * C1).sum() + n1.sum() + m1.sum(), h

    results = []
    for f in (fn, torch.compile(fn, backend="eager", fullgraph=True)):
        ins = [x.detach().requires_grad_(True) for x in xs + st]
        loss, h = f(*ins)
        results.append([h] + list(torch.autograd.grad(loss, ins)))
    for j, (a, b) in enumerate(zip(*results)):
        assert rel_err(a.float(), b.float()) < 1e-6, j
    small, sst = _inputs(T=40, H=1, K=64, V=64)
    small = [x.detach().to(dtype).requires_grad_(True) if j < 3 else x for j, x in enumerate(small)]
    key = MLSTMKernelConfig.tuned(64, 64, dtype, 64).key()
    torch.library.opcheck(torch.ops.xlstm_kit.mlstm_chunkwise_fwd.default, (*small, *sst, 1e-6, key))


def test_public_recompute_states_gives_the_same_gradients():
    """mlstm_chunkwise(recompute_states=True) on the Triton path: same h, final state and
    gradients as keeping the chunk states (the backward recomputes exactly what was kept)."""
    xs, st = _inputs(T=150)  # three chunks of the kernels' 64
    results = []
    for recompute in (False, True):
        ins = [x.detach().requires_grad_(True) for x in xs + st]
        h, (C, n, m) = mlstm_chunkwise(*ins[:5], initial_state=tuple(ins[5:]), output_final_state=True,
                                       backend="triton", recompute_states=recompute)
        loss = (h * h).sum() + (C * C).sum() + n.sum() + m.sum()
        results.append([h, C] + list(torch.autograd.grad(loss, ins)))
    for j, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), j


def test_model_recompute_mlstm_states_saves_less_with_the_same_gradients():
    """XLSTMConfig.recompute_mlstm_states reaches the kernels: the model keeps fewer bytes for
    its backward and its gradients do not change."""
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

    tokens = torch.randint(0, 64, (2, 130), generator=torch.Generator().manual_seed(1)).to(DEV)
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        cfg = XLSTMConfig(vocab_size=64, d_model=32, n_blocks=1, n_heads=2, backend="triton",
                          recompute_mlstm_states=recompute)
        model = XLSTMLanguageModel(cfg).to(DEV)
        seen, total = set(), [0]

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total[0] += st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(tokens).logsumexp(-1).mean()
        loss.backward()
        results.append((total[0], [p.grad for p in model.parameters()]))
    (kept, g_kept), (lean, g_lean) = results
    assert lean < kept
    for a, b in zip(g_kept, g_lean):
        assert torch.equal(a, b)


def test_packed_sequences_opcheck_and_compile():
    """cu_seqlens through the custom ops: opcheck of the forward op with packed sequences (its
    fake implementation sizes the buffers from the shapes alone), and torch.compile(fullgraph)
    of a packed call with initial and final states: one graph, eager's values and gradients."""
    xs, _ = _inputs(T=21, H=2)
    cu = torch.tensor([0, 4, 20, 21], dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(3)
    st = [torch.randn(3, 2, 16, 16, generator=g), torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, generator=g)]
    st = [s.to(DEV).requires_grad_(True) for s in st]
    key = MLSTMKernelConfig.tuned(16, 16, torch.float32, 16).key()
    torch.library.opcheck(torch.ops.xlstm_kit.mlstm_chunkwise_fwd.default, (*xs, *st, 1e-6, key, cu))

    def fn(q, k, v, i, f, C, n, m):
        h, (C1, n1, m1) = mlstm_chunkwise_triton(q, k, v, i, f, initial_state=(C, n, m), output_final_state=True,
                                                 chunk_size=16, cu_seqlens=cu)
        return (h * h).sum() + (C1 * C1).sum() + n1.sum() + m1.sum(), h

    _assert_compiled_equals_eager(fn, xs + st)
