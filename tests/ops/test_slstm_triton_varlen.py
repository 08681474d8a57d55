"""Packed sequences (cu_seqlens) in the fused Triton sLSTM kernels: sequence n runs as batch
entry n of the kernels (no Python loop over sequences), so every packed result must equal
running each sequence alone.

CPU: under TRITON_INTERPRET=1 in float32, against the float64 torch op run sequence by
sequence: h, the final (h, c, n, m) and the gradients of x_gates, r, b and the initial state.
The split-head path (programs meeting at a barrier) cannot run in the interpreter, which runs
the programs one after another; the GPU tests (-m gpu) cover it, with the 2x rule in bf16.
"""
import os

import pytest
import torch

from tests.helpers import rel_err
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.ops._checks import run_varlen
from xlstm_kit.ops.slstm import slstm_recurrent
from xlstm_kit.ops.slstm.naive import slstm_recurrent_naive
from xlstm_kit.ops.slstm.recurrent import slstm_recurrent_torch

triton_slstm = pytest.importorskip("xlstm_kit.ops.slstm.triton")
SLSTMKernelConfig = triton_slstm.SLSTMKernelConfig

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") != "1",
    reason="CPU kernel tests run under TRITON_INTERPRET=1 (make test sets it)")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
NAMES = ["h", "h_T", "c_T", "n_T", "m_T", "d_x", "d_r", "d_b", "d_h0", "d_c0", "d_n0", "d_m0"]


def _cu(lengths, device="cpu", dtype=torch.int32):
    return torch.tensor([0] + list(lengths), device=device).cumsum(0).to(dtype)


def make_case(lengths, H, D, init, forget_gate="sigmoid", seed=0, device="cpu"):
    """Inputs (x [1,T,4,H,D], r, b, initial state rows [N,H,D] or nothing) and the output
    gradients (dh [1,T,H,D], four [N,H,D]), float32."""
    g = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    x = torch.randn(1, T, 4, H, D, generator=g)
    if forget_gate == "exp":
        x[:, :, 1] = -x[:, :, 1].abs() - 0.1
    tensors = [x, torch.randn(4, H, D, D, generator=g) / D ** 0.5, torch.randn(4, H, D, generator=g) * 0.1]
    if init:
        tensors += [torch.rand(N, H, D, generator=g) * 2 - 1, torch.randn(N, H, D, generator=g),
                    torch.rand(N, H, D, generator=g) + 0.5, torch.randn(N, H, D, generator=g)]
    ups = [torch.randn(1, T, H, D, generator=g)] + [torch.randn(N, H, D, generator=g) for _ in range(4)]
    return [t.to(device) for t in tensors], [u.to(device) for u in ups]


def run(fn, tensors, ups, dtype, cu, packed, **kw):
    """Outputs and input gradients of fn over the packed inputs: in one call with cu_seqlens
    (packed), or one call per sequence (the reference)."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in tensors]
    x, r, b, *init = leaves
    init = tuple(init) or None

    def op(xg, **k):
        return fn(xg, r, b, **k, **kw)

    if packed:
        h, final = op(x, initial_state=init, output_final_state=True, cu_seqlens=cu)
    else:
        h, final = run_varlen(op, (x,), cu.tolist(), init, True)
    outs = [h, *final]
    loss = sum((o.double() * u.double()).sum() for o, u in zip(outs, ups))
    return outs + list(torch.autograd.grad(loss, leaves))


def check_packed(lengths, H, D, init, tol, fn=None, forget_gate="sigmoid", **kw):
    tensors, ups = make_case(lengths, H, D, init, forget_gate)
    cu = _cu(lengths, dtype=torch.int64 if len(lengths) % 2 else torch.int32)
    if fn is None:
        def fn(*a, **k):
            return slstm_recurrent(*a, backend="triton", **k)
    got = run(fn, tensors, ups, torch.float32, cu, True, forget_gate=forget_gate, **kw)
    ref = run(slstm_recurrent_torch, tensors, ups, torch.float64, cu, False, forget_gate=forget_gate, **kw)
    assert got[1].shape == (len(lengths), H, D)
    for name, a, b in zip(NAMES, got, ref):
        assert a.shape == b.shape, name
        assert rel_err(a, b) < tol, f"{name}: {rel_err(a, b):.3e} ({lengths}, {kw})"


# ------------------------------------------------------------------ interpreter (CPU, make test)

@needs_interpreter
@pytest.mark.parametrize("lengths,init,forget_gate,clip", [
    ([1, 3, 7], True, "sigmoid", None),
    ([1, 3, 7], False, "exp", 0.5),
    ([9], True, "exp", None),
    ([9], False, "sigmoid", None),
])
def test_packed_equals_each_sequence_alone(lengths, init, forget_gate, clip):
    # Through the public op (backend="triton"): the default configuration for D = 16.
    check_packed(lengths, 2, 16, init, 2e-5, forget_gate=forget_gate, recurrent_grad_clip=clip)


@needs_interpreter
@pytest.mark.parametrize("config", [SLSTMKernelConfig(4, False, 16), SLSTMKernelConfig(4, True, prefetch=False),
                                    SLSTMKernelConfig(4, True, 16, stack_gates=True),
                                    SLSTMKernelConfig(4, True, 16, stack_gates=True, bwd_partials=True)])
def test_packed_kernel_variants(config):
    # D = 32 in two K chunks of 16 (h_{t-1} and δg̃_t through the scratch, read back only for
    # the columns still running; R streamed per step); no prefetch.
    def fn(*a, **k):
        return triton_slstm.slstm_recurrent_triton(*a, config=config, **k)

    check_packed([1, 3, 7], 1, 32, True, 2e-5, fn=fn)


@needs_interpreter
def test_packed_two_batch_tiles_and_padded_units():
    # 18 sequences: two tiles of 16 columns (the second mostly padding), lengths 1-3 in both;
    # D = 20 padded to 32 units.
    lengths = [1, 3, 2, 1, 1, 2, 3, 3, 1, 2, 1, 1, 3, 2, 2, 1, 3, 1]
    check_packed(lengths, 1, 20, True, 2e-5)


@needs_interpreter
def test_packed_inference_without_saved_tensors():
    # No gradient needed (a packed prefill): the kernels save nothing; same h and final states.
    (x, r, b, *init), _ = make_case([2, 5, 1], 1, 16, True, forget_gate="exp")
    cu = _cu([2, 5, 1])
    with torch.no_grad():
        h, state = slstm_recurrent(x, r, b, initial_state=tuple(init), output_final_state=True,
                                   forget_gate="exp", backend="triton", cu_seqlens=cu)
        h_ref, state_ref = run_varlen(
            lambda xg, **k: slstm_recurrent_torch(xg, r.double(), b.double(), forget_gate="exp", **k),
            (x.double(),), cu.tolist(), tuple(s.double() for s in init), True)
    for got, ref in zip((h, *state), (h_ref, *state_ref)):
        assert rel_err(got, ref) < 1e-5


@needs_interpreter
def test_packed_opcheck_and_compile():
    # The forward op's fake sizes the states from cu_seqlens ([N,H,D]); torch.compile
    # (fullgraph) of a packed call: one graph, eager's values and gradients.
    (x, r, b, *init), _ = make_case([2, 1], 1, 16, True)
    cu = _cu([2, 1])
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.xlstm_kit.slstm_recurrent_fwd.default,
                          (x, r, b, *init, "sigmoid", None, "", True, cu), test_utils=quick)

    def fn(x, r, b, h0, c0, n0, m0):
        h, state = triton_slstm.slstm_recurrent_triton(x, r, b, initial_state=(h0, c0, n0, m0),
                                                       output_final_state=True, cu_seqlens=cu)
        return (h * h).sum() + sum((s * s).sum() for s in state)

    results = []
    for f in (fn, torch.compile(fn, backend="eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (x, r, b, *init)]
        loss = f(*leaves)
        results.append([loss, *torch.autograd.grad(loss, leaves)])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_packed_shape_errors():
    # The value checks (increasing, start, end) are the public op's (tests/ops/test_varlen.py);
    # the kernels' entry point checks what it can without reading the values back.
    (x, r, b, *init), _ = make_case([2, 3], 1, 16, True)
    op = triton_slstm.slstm_recurrent_triton
    with pytest.raises(XLSTMKitError, match="int32 or int64"):
        op(x, r, b, cu_seqlens=_cu([2, 3]).float())
    with pytest.raises(XLSTMKitError, match="batch 1"):
        op(torch.cat([x, x]), r, b, cu_seqlens=_cu([2, 3]))
    with pytest.raises(XLSTMKitError, match="rows"):
        op(x, r, b, initial_state=tuple(s[:1] for s in init), cu_seqlens=_cu([2, 3]))
    with pytest.raises(XLSTMKitError, match="strictly increasing"):
        slstm_recurrent(x, r, b, backend="triton", cu_seqlens=torch.tensor([0, 5, 5]))
    with pytest.raises(XLSTMKitError, match="end at the total length"):
        slstm_recurrent(x, r, b, backend="triton", cu_seqlens=torch.tensor([0, 2, 4]))


# ------------------------------------------------------------------ GPU (H200, -m gpu)

GPU_LENGTHS = [1, 300, 17, 64, 2, 129, 250, 5, 1, 77, 200, 33, 16, 3, 280, 100, 9, 48, 1, 150]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D", [64, 128, 192])
def test_gpu_packed_bfloat16_two_times_rule(D):
    # 20 sequences (two batch tiles), lengths 1-300. D = 192: the default splits each head over
    # programs that meet at a barrier per (tile, head) every step. bf16 kernels within 2x the
    # error of the bf16 PyTorch loop run sequence by sequence; both against float64 per sequence.
    tensors, ups = make_case(GPU_LENGTHS, 2, D, True, device="cuda")
    tensors = [t.bfloat16() for t in tensors]  # every run starts from the same rounded values
    cu = _cu(GPU_LENGTHS, device="cuda")

    def kernel(*a, **k):
        return slstm_recurrent(*a, backend="triton", **k)

    ref = run(slstm_recurrent_torch, tensors, ups, torch.float64, cu, False)
    got = run(kernel, tensors, ups, torch.bfloat16, cu, True)
    loop = run(slstm_recurrent_naive, tensors, ups, torch.bfloat16, cu, False)
    k_err = [rel_err(a, b) for a, b in zip(got, ref)]
    t_err = [rel_err(a, b) for a, b in zip(loop, ref)]
    for name, k, t in zip(NAMES, k_err, t_err):
        assert k <= 2 * t + 2e-6, (name, k_err, t_err)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("D,block_u", [(128, 32), (48, 16)])
def test_gpu_packed_split_head_float32(D, block_u):
    # An explicit split (D = 48: three programs of 16 units), float32 against float64.
    def fn(*a, **k):
        return triton_slstm.slstm_recurrent_triton(*a, config=SLSTMKernelConfig(4, True, block_u=block_u), **k)

    tensors, ups = make_case(GPU_LENGTHS, 2, D, True, device="cuda")
    cu = _cu(GPU_LENGTHS, device="cuda")
    got = run(fn, tensors, ups, torch.float32, cu, True, recurrent_grad_clip=5.0)
    ref = run(slstm_recurrent_torch, tensors, ups, torch.float64, cu, False, recurrent_grad_clip=5.0)
    for name, a, b in zip(NAMES, got, ref):
        assert rel_err(a, b) < 1e-4, name
