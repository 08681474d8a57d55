"""The large block's output gate fused into the head-wise norm (xlstm_kit.layers.fused.gated_head_norm,
the GATE=2 mode of the tail kernels in ops/blocks/triton.py): the Triton path against a float64
reference (forward, every gradient; o a strided column slice, head dims not powers of two, one
and three heads, several row counts, several programs summing dw), gradcheck of the PyTorch
path, opcheck of the custom ops, torch.compile, LargeMLSTMLayer / LargeBlock against the formula
they replaced, the sm_90 build's registers and spills at the 7B's heads, and (GPU) bf16
accuracy against the plain PyTorch formula."""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err, run_outside_interpreter
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.layers.fused import gated_head_norm, head_norm
from xlstm_kit.layers.large import LargeBlock, LargeMLSTMLayer
from xlstm_kit.ops.backend import BackendUnavailableError

F64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def inputs(lead, H, D, dtype=F64, w_dtype=None, seed=0, pad=(5, 7)):
    """x [*lead, H, D] (per-head offsets and scales, so the norm matters), o [*lead, H*D] as a
    column slice of a wider GEMM-like output (rows strided), w [H*D] around 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, H, D, generator=g, dtype=F64) * 2 + torch.randn(H, 1, generator=g, dtype=F64)
    wide = torch.randn(*lead, pad[0] + H * D + pad[1], generator=g, dtype=F64) * 3
    w = 1 + 0.5 * torch.randn(H * D, generator=g, dtype=F64)
    o = wide.to(DEV, dtype)[..., pad[0]: pad[0] + H * D]
    assert o.stride(-2) == wide.shape[-1] and o.stride(-1) == 1  # one row counts as contiguous
    return x.to(DEV, dtype), o, w.to(DEV, w_dtype or dtype)


def exact(x, o, w, eps=EPS):
    """sigmoid(o) · LayerNorm_per_head(x) · w in float64 on the given (rounded) values."""
    H, D = x.shape[-2:]
    xn = F.layer_norm(x.double(), (D,), eps=eps).flatten(-2) * w.double()
    return torch.sigmoid(o.double()) * xn


def exact_grads(x, o, w, dy):
    ins = [t.detach().double().requires_grad_(True) for t in (x, o, w)]
    y = exact(*ins)
    return [y, *torch.autograd.grad(y, ins, dy.double())]


def plain(x, o, w, backend="torch"):
    """The formula LargeMLSTMLayer._output used: the norm in x's dtype, then the gate in o's."""
    return torch.sigmoid(o) * head_norm(x, w, EPS, backend).flatten(-2).to(o.dtype)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("H,D", [(1, 12), (3, 12), (1, 40), (3, 40)])
@pytest.mark.parametrize("lead", [(1,), (9,), (2, 19)])
def test_triton_matches_float64_reference(dtype, tol, H, D, lead):
    x, o, w = inputs(lead, H, D, dtype)
    ins = [t.detach().requires_grad_(True) for t in (x, o, w)]
    y = gated_head_norm(*ins, EPS, backend="triton")
    assert y.shape == o.shape and y.dtype == dtype
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(DEV, dtype)
    grads = torch.autograd.grad(y, ins, dy)
    assert grads[1].is_contiguous() and grads[1].dtype == dtype and grads[0].shape == x.shape
    ref = exact_grads(x, o, w, dy)
    for j, (got, want) in enumerate(zip([y, *grads], ref)):
        assert want.abs().max() > 0, j
        assert rel_err(got.double(), want) < tol, j


@needs_triton
def test_triton_mixed_dtypes_and_float32_weight():
    """bf16-autocast-like: x and o float16, w float32 (dw comes back float32); and x float32
    with o float16 (the result takes o's dtype, dx x's)."""
    x, o, w = inputs((11,), 3, 20, torch.float16, w_dtype=torch.float32)
    for xx in (x, x.float()):
        ins = [t.detach().requires_grad_(True) for t in (xx, o, w)]
        y = gated_head_norm(*ins, EPS, backend="triton")
        assert y.dtype == torch.float16
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(DEV, torch.float16)
        grads = torch.autograd.grad(y, ins, dy)
        assert [g.dtype for g in grads] == [xx.dtype, torch.float16, torch.float32]
        for j, (got, want) in enumerate(zip([y, *grads], exact_grads(xx, o, w, dy))):
            assert rel_err(got.double(), want) < 2e-3, j


@needs_triton
def test_backward_sums_dw_over_programs_and_rows_of_any_stride():
    """Fewer programs than row tiles (each loops over several tiles and sums dw), the custom
    ops called directly: o with a row stride, dy strided too; against the float64 twins."""
    from xlstm_kit.layers.fused import _gated_norm_bwd_torch, _gated_norm_fwd_torch
    from xlstm_kit.ops.blocks.triton import TailKernelConfig, gated_head_norm_bwd, gated_head_norm_fwd
    key = TailKernelConfig(rows=2, programs=3).key()
    x, o, w = inputs((37,), 3, 12, torch.float32)
    got_f = gated_head_norm_fwd(x, o, w, EPS, key)
    ref_f = _gated_norm_fwd_torch(x.double(), o.double(), w.double(), EPS)
    assert rel_err(got_f[0].double(), exact(x, o, w)) < 2e-6
    for a, b in zip(got_f, ref_f):
        assert rel_err(a.double(), b) < 2e-6
    dy = torch.randn(37, 50, generator=torch.Generator().manual_seed(3)).to(DEV)[:, 4:40]
    got = gated_head_norm_bwd(x, o, w, got_f[1], got_f[2], dy, key)
    ref = _gated_norm_bwd_torch(*(t.double() for t in (x, o, w, got_f[1], got_f[2], dy)))
    for j, (a, b) in enumerate(zip(got, ref)):
        assert b.abs().max() > 0 and rel_err(a.double(), b) < 2e-6, j
    for j, (a, b) in enumerate(zip(got, exact_grads(x, o, w, dy)[1:])):
        assert rel_err(a.double(), b) < 2e-6, j


@pytest.mark.parametrize("H,D", [(1, 5), (3, 4)])
def test_pytorch_path_gradcheck(H, D):
    x, o, w = (t.requires_grad_(True) for t in inputs((2, 3), H, D))
    fn = lambda *a: gated_head_norm(*a, EPS, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, o, w))
    assert torch.autograd.gradcheck(fn, (x, o.detach().contiguous().requires_grad_(True), w))


def test_pytorch_path_matches_float64_formula():
    x, o, w = inputs((4, 7), 3, 12)
    assert rel_err(gated_head_norm(x, o, w, EPS), exact(x, o, w)) < 1e-14
    # float32 and bf16 (CPU default: the PyTorch path): float32 arithmetic, one rounding to
    # o's dtype (bf16: within one rounding's error of the exact result)
    for dt, tol in ((torch.float32, 1e-6), (torch.bfloat16, 4e-3)):
        xs, os_, ws = (t.to(dt) for t in (x, o, w))
        y = gated_head_norm(xs, os_, ws, EPS)
        assert y.dtype == dt and rel_err(y, exact(xs, os_, ws)) < tol


def test_refuses_mismatched_shapes():
    x, o, w = inputs((3,), 2, 4)
    with pytest.raises(XLSTMKitError, match="H\\*D"):
        gated_head_norm(x, o[:, :7], w, EPS)
    with pytest.raises(XLSTMKitError, match="H\\*D"):
        gated_head_norm(x, o[:2], w, EPS)


@needs_triton
def test_kernels_refuse_float64():
    x, o, w = inputs((3,), 2, 4)
    with pytest.raises(BackendUnavailableError, match="float64"):
        gated_head_norm(x, o, w, EPS, backend="triton")
    with pytest.raises(BackendUnavailableError, match="float64"):  # a float64 gate beside float32 activations
        gated_head_norm(x.float(), o, w.float(), EPS, backend="triton")
    assert gated_head_norm(x.float(), o, w.float(), EPS).dtype == F64  # the default falls back to PyTorch


@needs_triton
def test_custom_ops_pass_opcheck():
    from xlstm_kit.ops.blocks.triton import config_key
    x, o, w = inputs((6,), 3, 12, torch.float32)
    key = config_key()
    for oo in (o, o.contiguous()):
        torch.library.opcheck(torch.ops.xlstm_kit.gated_head_norm_fwd.default, (x, oo, w, EPS, key))
        _, mean, rstd = torch.ops.xlstm_kit.gated_head_norm_fwd(x, oo, w, EPS, key)
        dy = torch.randn(6, 36, device=DEV)
        torch.library.opcheck(torch.ops.xlstm_kit.gated_head_norm_bwd.default, (x, oo, w, mean, rstd, dy, key))


@needs_triton
def test_compiles_fullgraph_with_eager_values():
    x, o, w = (t.requires_grad_(True) for t in inputs((2, 5), 3, 12, torch.float32, seed=4))

    def fn(x, o, w):
        return gated_head_norm(x, o, w, EPS, backend="triton").square().sum()

    eager = [fn(x, o, w), *torch.autograd.grad(fn(x, o, w), (x, o, w))]
    cfn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss = cfn(x, o, w)
    compiled = [loss, *torch.autograd.grad(loss, (x, o, w))]
    for j, (a, b) in enumerate(zip(compiled, eager)):
        assert b.abs().max() > 0 and rel_err(a, b) < 1e-6, j


# ----------------------------------------------------------------------------- the large block
def _perturbed(module, scale=0.3):
    torch.manual_seed(0)
    with torch.no_grad():  # the gate maps start at 0 and the norm at 1, which would hide mistakes
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


def _old_output(layer):
    def output(h, o):
        return layer.out_proj(torch.sigmoid(o) * layer.multihead_norm(h).to(o.dtype))
    return output


def _out_and_grads(module, x):
    y = module(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=F64).to(y)
    return [y, *torch.autograd.grad(y, [x, *module.parameters()], dy)]


def _against_old_formula(module, layer, x):
    """(new results, results with the replaced _output) of module's output and every gradient."""
    got = _out_and_grads(module, x)
    layer._output = _old_output(layer)  # the instance attribute shadows the method
    try:
        ref = _out_and_grads(module, x)
    finally:
        del layer._output
    return got, ref


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["layer", "block"])
def test_large_modules_unchanged_against_the_previous_formula(kind, bias):
    """float64: output and every gradient (each nonzero) of LargeMLSTMLayer / LargeBlock equal
    those of sigmoid(o) * multihead_norm(h) it replaced; state_dict names are unchanged."""
    if kind == "layer":
        module = LargeMLSTMLayer(32, 2, 16, 24, bias=bias, norm_eps=EPS, chunk_size=8)
        layer = module
    else:
        module = LargeBlock(32, 3, 24, 36, 40, bias=bias, norm_eps=EPS, chunk_size=8)
        layer = module.mlstm_layer
    _perturbed(module.double())
    x = torch.randn(2, 13, 32, dtype=F64, requires_grad=True)
    got, ref = _against_old_formula(module, layer, x)
    for j, (a, b) in enumerate(zip(got, ref)):
        assert b.abs().max() > 0, j
        assert rel_err(a, b) < 1e-13, j
    prefix = "" if kind == "layer" else "mlstm_layer."
    assert f"{prefix}multihead_norm.weight" in module.state_dict()
    assert (f"{prefix}multihead_norm.bias" in module.state_dict()) == bias


@needs_triton
def test_large_layer_triton_path_matches_previous_formula():
    """float32 in the interpreter: the layer's kernels (mLSTM, gated norm) against the same layer
    with the separate norm kernel, sigmoid and multiply; v heads of 20."""
    layer = _perturbed(LargeMLSTMLayer(32, 2, 32, 40, norm_eps=EPS, chunk_size=16, backend="triton"))
    x = torch.randn(2, 21, 32, requires_grad=True)
    got, ref = _against_old_formula(layer, layer, x)
    for j, (a, b) in enumerate(zip(got, ref)):
        assert b.abs().max() > 0 and rel_err(a, b) < 1e-5, j


# ----------------------------------------------------------------------------- sm_90 build
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_kernels_compile_for_hopper_without_spills():
    """Compiled for sm_90 by Triton and ptxas (no GPU; outside the interpreter) at the 7B's
    heads (H = 8, D = 512), bf16, the default config: no compile error, no spills."""
    out = run_outside_interpreter("from tests.layers.test_gated_head_norm import sm90; sm90()")
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line in lines:
        name, regs, spills = line.split()
        assert int(spills) == 0 and 0 < int(regs) <= 255, line


def sm90(D=512):
    """Print `kernel registers spill-bytes` for both GATE=2 kernels at the default config."""
    import triton

    from benchmarks.sm90 import sm90_resources
    from xlstm_kit.ops.blocks import triton as kern

    cfg = kern.TailKernelConfig()
    bf, f32 = "*bf16", "*fp32"
    sigs = {
        "fwd": (kern._tail_fwd, {"h_ptr": bf, "xc_ptr": bf, "z_ptr": bf, "w_ptr": f32, "s_ptr": f32, "u_ptr": bf,
                                 "mean_ptr": f32, "rstd_ptr": f32, "eps": "fp32"}, cfg.warps),
        "bwd": (kern._tail_bwd, {"h_ptr": bf, "xc_ptr": bf, "z_ptr": bf, "w_ptr": f32, "s_ptr": f32,
                                 "mean_ptr": f32, "rstd_ptr": f32, "du_ptr": bf, "u_ptr": bf, "dh_ptr": bf,
                                 "dxc_ptr": bf, "dz_ptr": bf, "dw_part": f32, "ds_part": f32}, cfg.bwd_warps),
    }
    consts = {"ROWS": cfg.rows, "BD": triton.next_power_of_2(D), "GATE": 2}
    for name, (fn, sig, warps) in sigs.items():
        full = {a: "constexpr" if a in consts else sig.get(a, "i32") for a in fn.arg_names}
        # the 7B's D = 512 and its GEMM row (12304 columns) are multiples of 16, as are the
        # pointers: the launch specializes them so (H = 8 is not)
        r = sm90_resources(fn, full, consts, num_warps=warps,
                           divisible_by_16=[a for a in fn.arg_names if a not in consts and a not in ("H", "N", "eps")])
        print(name, r["regs"], r["spill_stores"] + r["spill_loads"])


# ----------------------------------------------------------------------------- GPU accuracy
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_within_twice_the_pytorch_formula_error():
    """bf16 on the GPU at the 7B's heads (H = 8, D = 512; o strided in a 12304-wide row, w
    float32 as under autocast): the kernels' output and gradients within 2x the error of the
    plain bf16 formula (norm kernel, then sigmoid and multiply in bf16), both against float64."""
    x, o, w = inputs((256,), 8, 512, torch.bfloat16, w_dtype=torch.float32, pad=(8192, 12304 - 8192 - 4096))
    dy = torch.randn(256, 4096, generator=torch.Generator().manual_seed(6), dtype=F64).to(DEV, torch.bfloat16)
    ref = exact_grads(x, o, w, dy)
    results = []
    for fn in (lambda *a: gated_head_norm(*a, EPS, backend="triton"), lambda *a: plain(*a, backend="triton")):
        ins = [t.detach().requires_grad_(True) for t in (x, o, w)]
        y = fn(*ins)
        results.append([y, *torch.autograd.grad(y, ins, dy)])
    for j, (g, b, e) in enumerate(zip(*results, ref)):
        assert rel_err(g, e) <= 2 * rel_err(b, e) + 1e-6, j
