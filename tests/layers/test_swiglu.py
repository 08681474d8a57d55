"""The fused SwiGLU activation (xlstm_kit.layers.fused.swiglu, kernels in ops/blocks/swiglu.py): the
Triton path against the float64 PyTorch path (forward, gradient; strided rows, odd F, several
column tiles), gradcheck of the PyTorch path, opcheck of the custom ops, torch.compile, the
large block's SwiGLU module against the formula it replaced, the sm_90 build's registers and
spills at the 7B's F, and (GPU) bf16 accuracy against the plain PyTorch formula."""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err, run_outside_interpreter
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.layers.fused import swiglu
from xlstm_kit.layers.large import SwiGLU
from xlstm_kit.ops.backend import BackendUnavailableError

F64 = torch.float64
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def plain(gu: torch.Tensor) -> torch.Tensor:
    """The formula the fused op replaced: two elementwise ops on the strided halves."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def strided_gu(lead, Fdim, dtype=F64, seed=0, pad=(3, 5)):
    """gu [*lead, 2F] as a column slice of a wider tensor (rows strided, not contiguous), with
    values over SiLU's curved range and its saturated tails."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(*lead, pad[0] + 2 * Fdim + pad[1], generator=g, dtype=F64) * 3
    gu = wide.to(DEV, dtype)[..., pad[0]: pad[0] + 2 * Fdim]
    assert not gu.is_contiguous() and gu.stride(-1) == 1
    return gu


def exact(gu: torch.Tensor, dy: torch.Tensor):
    """(y, dgu) by autograd of the plain formula in float64 on gu's (rounded) values."""
    gu = gu.detach().double().requires_grad_(True)
    y = plain(gu)
    return y, torch.autograd.grad(y, gu, dy.double())[0]


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("Fdim", [37, 100])
@pytest.mark.parametrize("lead", [(7,), (2, 3), (1, 4, 3)])
def test_triton_matches_float64_reference(dtype, tol, Fdim, lead):
    gu = strided_gu(lead, Fdim, dtype).requires_grad_(True)
    y = swiglu(gu, backend="triton")
    assert y.shape == (*lead, Fdim) and y.dtype == dtype
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    dgu = torch.autograd.grad(y, gu, dy.to(DEV, dtype))[0]
    assert dgu.shape == gu.shape and dgu.dtype == dtype
    y_ref, dgu_ref = exact(gu, dy.to(DEV))
    assert rel_err(y.double(), y_ref) < tol
    # each half on its own: a swapped or misplaced half would hide in the norm of the whole
    for got, ref in zip(dgu.chunk(2, -1), dgu_ref.chunk(2, -1)):
        assert rel_err(got.double(), ref) < tol


@needs_triton
def test_several_column_tiles_and_strided_gradient():
    """F wider than the tile (3 tiles of 32 + a partial one), the custom ops called directly with
    strided gu and strided dy: the kernels' row strides and the last tile's mask."""
    from xlstm_kit.ops.blocks.swiglu import SwiGLUKernelConfig, swiglu_bwd, swiglu_fwd
    key = SwiGLUKernelConfig(block=32).key()
    gu = strided_gu((9,), 100, torch.float32).view(9, 200)
    dy_wide = torch.randn(9, 130, generator=torch.Generator().manual_seed(2)).to(DEV)
    dy = dy_wide[:, 30:]
    y_ref, dgu_ref = exact(gu, dy)
    assert rel_err(swiglu_fwd(gu, key).double(), y_ref) < 1e-6
    assert rel_err(swiglu_bwd(gu, dy, key).double(), dgu_ref) < 1e-6


@needs_triton
def test_matches_pytorch_path_in_float32():
    """Triton and PyTorch paths on the same float32 inputs (contiguous, the GEMM's layout)."""
    gu = torch.randn(2, 5, 2 * 48, device=DEV, requires_grad=True)
    dy = torch.randn(2, 5, 48, device=DEV)
    out = [swiglu(gu, backend=b) for b in ("triton", "torch")]
    grads = [torch.autograd.grad(y, gu, dy)[0] for y in out]
    assert rel_err(out[0], out[1]) < 1e-6 and rel_err(grads[0], grads[1]) < 1e-6


def test_pytorch_path_gradcheck():
    gu = strided_gu((2, 3), 5).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: swiglu(t, backend="torch"), (gu,))
    assert torch.autograd.gradcheck(lambda t: swiglu(t, backend="torch"), (gu.detach().contiguous().requires_grad_(),))


def test_pytorch_path_is_the_plain_formula_bit_for_bit():
    """CPU results are unchanged: float32 and float64 give the bits of F.silu(g) * u and of its
    autograd; bf16 is computed in float32 and rounded once."""
    for dtype in (torch.float32, F64):
        gu = strided_gu((4, 3), 37, dtype).requires_grad_(True)
        dy = torch.randn(4, 3, 37, dtype=dtype)
        y, ref = swiglu(gu, backend="torch"), plain(gu)
        assert torch.equal(y, ref)
        assert torch.equal(*(torch.autograd.grad(t, gu, dy)[0] for t in (y, ref)))
    gu = strided_gu((4,), 37, torch.bfloat16)
    assert torch.equal(swiglu(gu), plain(gu.float()).bfloat16())


def test_refuses_odd_width_and_float64_kernels():
    with pytest.raises(XLSTMKitError, match="2F"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(BackendUnavailableError):
        swiglu(torch.randn(3, 8, dtype=F64), backend="triton")


@needs_triton
def test_custom_ops_pass_opcheck():
    from xlstm_kit.ops.blocks.swiglu import config_key
    gu = strided_gu((5,), 12, torch.float32).view(5, 24)
    dy = torch.randn(5, 12, device=DEV)
    torch.library.opcheck(torch.ops.xlstm_kit.swiglu_fwd.default, (gu, config_key()))
    torch.library.opcheck(torch.ops.xlstm_kit.swiglu_bwd.default, (gu, dy, config_key()))
    torch.library.opcheck(torch.ops.xlstm_kit.swiglu_fwd.default, (gu.contiguous(), config_key()))


@needs_triton
def test_compiles_fullgraph_with_eager_values():
    module = SwiGLU(16, 24, bias=True, backend="triton").to(DEV)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 5, 16, device=DEV, requires_grad=True)
    y = module(x)
    gx, *gp = torch.autograd.grad(y.square().sum(), [x, *module.parameters()])
    yc = torch.compile(module, backend="aot_eager", fullgraph=True)(x)
    cx, *cp = torch.autograd.grad(yc.square().sum(), [x, *module.parameters()])
    assert rel_err(yc, y) < 1e-6 and rel_err(cx, gx) < 1e-6
    for a, b in zip(cp, gp):
        assert rel_err(a, b) < 1e-6


def _module_and_formula(bias, dtype=F64, backend=None):
    torch.manual_seed(0)
    m = SwiGLU(16, 37, bias=bias, backend=backend).to(DEV, dtype)
    with torch.no_grad():
        for p in m.parameters():  # proj_up_gate starts at 0, which would hide a swapped half
            p.add_(torch.randn_like(p) * 0.3)

    def formula(x):
        return m.proj_down(F.silu(m.proj_up_gate(x)) * m.proj_up(x))

    return m, formula


def _out_and_grads(fn, m, x):
    y = fn(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=F64).to(y)
    return [y, *torch.autograd.grad(y, [x, *m.parameters()], dy)]


@pytest.mark.parametrize("bias", [False, True])
def test_module_unchanged_against_the_previous_formula(bias):
    """float64: output and every gradient (each nonzero) of SwiGLU.forward equal the separate
    up maps and F.silu(g) * u it replaced, and step (unchanged) still agrees."""
    m, formula = _module_and_formula(bias)
    x = torch.randn(2, 5, 16, dtype=F64, requires_grad=True)
    got, ref = _out_and_grads(m, m, x), _out_and_grads(formula, m, x)
    for j, (a, b) in enumerate(zip(got, ref)):
        assert a.abs().sum() > 0, j
        assert rel_err(a, b) < 1e-13, j
    with torch.no_grad():
        assert rel_err(m.step(x[:, 0]), got[0][:, 0]) < 1e-13


@needs_triton
def test_module_triton_path_matches_previous_formula():
    m, formula = _module_and_formula(True, torch.float32, backend="triton")
    x = torch.randn(3, 4, 16, device=DEV, requires_grad=True)
    for j, (a, b) in enumerate(zip(_out_and_grads(m, m, x), _out_and_grads(formula, m, x))):
        assert rel_err(a, b) < 1e-5, j


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_kernels_compile_for_hopper_without_spills():
    """Compiled for sm_90 by Triton and ptxas (no GPU; outside the interpreter) at the 7B's
    F = 10944, bf16, the default config: no compile error, no spills."""
    out = run_outside_interpreter("from tests.layers.test_swiglu import sm90; sm90()")
    lines = out.splitlines()
    assert len(lines) == 2, out
    for line in lines:
        name, regs, spills = line.split()
        assert int(spills) == 0 and 0 < int(regs) <= 255, line


def sm90(ffn=10944):
    """Print `kernel registers spill-bytes` for both kernels at the default config."""
    from benchmarks.sm90 import sm90_resources
    from xlstm_kit.ops.blocks import swiglu as sw

    cfg = sw.SwiGLUKernelConfig()
    block = min(cfg.block, 1 << (ffn - 1).bit_length())
    cases = {
        "fwd": (sw._swiglu_fwd, {"gu_ptr": "*bf16", "y_ptr": "*bf16"}, cfg.warps),
        "bwd": (sw._swiglu_bwd, {"gu_ptr": "*bf16", "dy_ptr": "*bf16", "dgu_ptr": "*bf16", "stride_dy": "i32"},
                cfg.bwd_warps),
    }
    for name, (fn, sig, warps) in cases.items():
        full = {a: sig.get(a, "i32" if a != "BLOCK" else "constexpr") for a in fn.arg_names}
        # F = 10944 and the row strides are multiples of 16: the launch gets 16-byte accesses
        r = sm90_resources(fn, full, {"BLOCK": block}, num_warps=warps,
                           divisible_by_16=[a for a in fn.arg_names if a not in ("NB", "BLOCK")])
        print(name, r["regs"], r["spill_stores"] + r["spill_loads"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_within_twice_the_pytorch_formula_error():
    """bf16 on the GPU at a 7B-like width (F = 10944, strided GEMM-like rows): the kernels'
    output and gradient within 2x the error of the plain bf16 formula, both against float64."""
    gu = strided_gu((64,), 10944, torch.bfloat16).requires_grad_(True)
    dy = torch.randn(64, 10944, device="cuda", dtype=F64)
    y_ex, dgu_ex = exact(gu, dy)
    y = swiglu(gu, backend="triton")
    got = [y, torch.autograd.grad(y, gu, dy.bfloat16())[0]]
    y_b = plain(gu)
    base = [y_b, torch.autograd.grad(y_b, gu, dy.bfloat16())[0]]
    for g, b, e in zip(got, base, (y_ex, dgu_ex)):
        assert rel_err(g, e) <= 2 * rel_err(b, e)
