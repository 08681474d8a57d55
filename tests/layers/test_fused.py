"""The fused layer pieces (xlstm_kit.layers.fused) against the unfused reference path
(tests/layers/reference_layers.py): float64 forward, every gradient, the carried state; gradcheck of
each piece; bf16 autocast accuracy; torch.compile(fullgraph=True) of a block."""
import importlib.util
import os

import pytest
import torch

from tests.helpers import rel_err, run_outside_interpreter
from tests.layers.reference_layers import mlstm_layer, slstm_layer
from tests.layers.test_layers import randomize_
from xlstm_kit.layers import MLSTMBlock, MLSTMLayer, SLSTMBlock, SLSTMLayer
from xlstm_kit.layers.fused import conv_silu, head_norm, mlstm_output
from xlstm_kit.layers.fused_slstm import slstm_gates

F64 = torch.float64


def make(kind, bias=False):
    torch.manual_seed(0)
    if kind == "mlstm":
        layer = MLSTMLayer(16, 32, 2, chunk_size=4, bias=bias, backend="torch")
    else:
        layer = SLSTMLayer(16, 2, backend="torch")
    return layer


def two_calls(fn, x, params, weights=None):
    """Outputs of fn over x[:, :5] then x[:, 5:] with the state carried, and the gradients of a
    random linear loss of both outputs and the final state wrt x and params."""
    y1, s1 = fn(x[:, :5], None)
    y2, s2 = fn(x[:, 5:], s1)
    outs = [y1, y2, *s2]
    if weights is None:
        g = torch.Generator().manual_seed(1)
        weights = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, [x, *params])
    return [o.detach() for o in outs], grads, weights


def assert_matches(module, ref):
    """module(x, s, return_state=True) against ref(x, s) over two calls carrying the state, in
    float64: outputs, states and the gradients wrt x and every parameter (each nonzero)."""
    x = torch.randn(2, 11, 16, dtype=F64, requires_grad=True)
    params = list(module.parameters())
    outs, grads, w = two_calls(lambda x, s: module(x, s, return_state=True), x, params)
    r_outs, r_grads, _ = two_calls(ref, x, params, w)
    for o, r in zip(outs, r_outs):
        assert o.dtype == r.dtype and rel_err(o, r) < 1e-10
    for n, g, r in zip(["x"] + [n for n, _ in module.named_parameters()], grads, r_grads):
        assert g.abs().sum() > 0, n
        assert rel_err(g, r) < 1e-9, n


@pytest.mark.parametrize("kind,bias", [("mlstm", False), ("mlstm", True), ("slstm", False)])
def test_fused_layer_matches_unfused_reference(kind, bias):
    layer = randomize_(make(kind, bias).double())
    ref = mlstm_layer if kind == "mlstm" else slstm_layer
    assert_matches(layer, lambda x, s: ref(layer, x, s))


@pytest.mark.parametrize("bias", [False, True])
def test_mlstm_block_matches_unfused_reference(bias):
    """The block (its norm fused with the up-projection)."""
    torch.manual_seed(0)
    block = randomize_(MLSTMBlock(16, 32, 2, chunk_size=4, bias=bias, backend="torch").double())

    def ref(x, s):
        y, s = mlstm_layer(block.layer, block.norm(x), s)
        return x + y, s

    assert_matches(block, ref)


@pytest.mark.parametrize("bias", [False, True])
def test_slstm_block_matches_unfused_reference(bias):
    """The sLSTM block (feed-forward norm fused with its up-projection, GELU gate recomputed)."""
    torch.manual_seed(0)
    block = randomize_(SLSTMBlock(16, 2, 24, bias=bias, backend="torch").double())

    def ref(x, s):
        y, s = slstm_layer(block.layer, block.norm(x), s)
        x = x + y
        g, u = block.ffn.up_proj(block.ffn_norm(x)).chunk(2, dim=-1)
        return x + block.ffn.down_proj(torch.nn.functional.gelu(g) * u), s

    assert_matches(block, ref)


@pytest.mark.parametrize("kind", ["mlstm", "slstm"])
def test_fused_layer_step_equals_forward(kind):
    layer = randomize_(make(kind).double())
    x = torch.randn(2, 6, 16, dtype=F64)
    y, state = layer(x, layer.init_state(2), return_state=True)
    s, ys = layer.init_state(2), []
    for t in range(6):
        o, s = layer.step(x[:, t], s)
        ys.append(o)
    assert rel_err(torch.stack(ys, 1), y) < 1e-10
    for a, b in zip(s, state):
        assert rel_err(a, b) < 1e-10


@pytest.mark.parametrize("T", [2, 7])  # shorter and longer than the conv's K-1 = 3 inputs of state
@pytest.mark.parametrize("act", [True, False])
def test_conv_silu_gradcheck(T, act):
    x = torch.randn(2, T, 3, dtype=F64, requires_grad=True)
    state = torch.randn(2, 3, 3, dtype=F64, requires_grad=True)
    w = torch.randn(3, 4, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: conv_silu(*a, act=act), (x, state, w, b))
    assert torch.autograd.gradcheck(lambda x, w, b: conv_silu(x, None, w, b, act=act), (x, w, b))


def test_head_norm_and_mlstm_output_gradcheck():
    N, H, D, d = 5, 2, 3, 4
    t = lambda *s: torch.randn(*s, dtype=F64, requires_grad=True)  # noqa: E731
    assert torch.autograd.gradcheck(lambda x, w: head_norm(x, w, 1e-5), (t(2, N, H, D), t(H * D)))
    args = (t(N, H, D), t(N, H * D), t(N, H * D), t(H * D), t(H * D), t(d, H * D))
    assert torch.autograd.gradcheck(lambda *a: mlstm_output(*a, 1e-5), (*args, t(d)))
    assert torch.autograd.gradcheck(lambda *a: mlstm_output(*a, None, 1e-5), args)


def test_slstm_gates_gradcheck():
    t = lambda *s: torch.randn(*s, dtype=F64, requires_grad=True)  # noqa: E731
    args = (t(2, 5, 6), t(2, 3, 6), t(6, 4), t(6), t(4, 2, 3, 3))
    assert torch.autograd.gradcheck(slstm_gates, args)
    assert torch.autograd.gradcheck(lambda x, *a: slstm_gates(x, None, *a), (args[0], *args[2:]))


@pytest.mark.parametrize("kind", ["mlstm", "slstm"])
def test_bf16_autocast_accuracy(kind):
    """Under bf16 autocast (float32 parameters) the fused layer is within 2x the unfused path's
    error against float64, and its output is bf16."""
    layer = randomize_(make(kind), 0.1)
    ref = mlstm_layer if kind == "mlstm" else slstm_layer
    x = torch.randn(2, 16, 16)
    exact = ref(layer.double(), x.double())[0]
    layer.float()
    with torch.autocast("cpu", torch.bfloat16):
        y = layer(x)
        y_ref = ref(layer, x)[0]
    assert y.dtype == torch.bfloat16
    assert rel_err(y.double(), exact) <= 2 * rel_err(y_ref.double(), exact) + 1e-3


needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tail_inputs(N=13, H=2, D=24, d=8, dtype=torch.float32):
    """D not a power of two and N not a multiple of the rows per tile: the masks are exercised."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    xs = [r(N, H, D) * 2 + 0.5, r(N, H * D), r(N, H * D), 1 + 0.3 * r(H * D), r(H * D), r(d, H * D) / 5, r(d)]
    return [x.to(DEV, dtype) for x in xs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["mlstm", "slstm"])
def test_bf16_autocast_accuracy_gpu(kind):
    """On the GPU (Triton conv, tail and sequence kernels) under bf16 autocast: within 2x the
    unfused PyTorch path's error against float64, forward and input gradient."""
    layer = randomize_(make(kind), 0.1).cuda()
    layer.backend = None
    ref = mlstm_layer if kind == "mlstm" else slstm_layer
    x = torch.randn(2, 64, 16, device="cuda")
    dy = torch.randn(2, 64, 16, device="cuda")

    def run(fn, dtype=None):
        xi = x.detach().to(dtype or x.dtype).requires_grad_(True)
        with torch.autocast("cuda", torch.bfloat16, enabled=dtype is None):
            y = fn(xi)
        return [y.double(), torch.autograd.grad(y, xi, dy.to(y.dtype))[0].double()]

    exact = run(lambda x: ref(layer.double(), x)[0], F64)
    layer.float()
    got = run(layer)
    base = run(lambda x: ref(layer, x)[0])
    for g, b, e in zip(got, base, exact):
        assert rel_err(g, e) <= 2 * rel_err(b, e) + 1e-3


@needs_triton
def test_tail_triton_matches_float64_reference():
    """The Triton tail (float32) against the torch path in float64: output and every gradient."""
    xs = _tail_inputs()
    results = []
    for dtype, backend in ((F64, "torch"), (torch.float32, "triton")):
        ins = [x.detach().to(dtype).requires_grad_(True) for x in xs]
        y = mlstm_output(*ins, 1e-5, backend=backend)
        g = torch.Generator().manual_seed(4)
        dy = torch.randn(y.shape, generator=g, dtype=F64).to(y.device, dtype)
        results.append([y, *torch.autograd.grad(y, ins, dy)])
    for j, (ref, got) in enumerate(zip(*results)):
        assert rel_err(got.double(), ref) < 2e-5, j


@needs_triton
def test_head_norm_triton_matches_float64_reference():
    xs = _tail_inputs(N=37)
    x, w = xs[0].view(37, 2, 24), xs[3]
    dy = torch.randn_like(x)
    results = []
    for dtype, backend in ((F64, "torch"), (torch.float32, "triton")):
        ins = [t.detach().to(dtype).requires_grad_(True) for t in (x, w)]
        y = head_norm(ins[0], ins[1], 1e-5, backend=backend)
        results.append([y, *torch.autograd.grad(y, ins, dy.to(dtype))])
    for j, (ref, got) in enumerate(zip(*results)):
        assert rel_err(got.double(), ref) < 2e-5, j


@needs_triton
def test_tail_triton_backward_sums_over_programs():
    """Fewer programs than row tiles: each program loops over several tiles and sums dw, dskip."""
    from xlstm_kit.layers.fused import _tail_bwd_torch, _tail_fwd_torch
    from xlstm_kit.ops.blocks.triton import TailKernelConfig, mlstm_tail_bwd, mlstm_tail_fwd
    h, xc, z, w, skip = _tail_inputs(N=37)[:5]
    key = TailKernelConfig(rows=2, programs=3).key()
    got_f = mlstm_tail_fwd(h, xc, z, w, skip, 1e-5, key)
    ref_f = _tail_fwd_torch(*(x.double() for x in (h, xc, z, w, skip)), 1e-5)
    for a, b in zip(got_f, ref_f):
        assert rel_err(a.double(), b) < 1e-5
    du = torch.randn_like(xc)
    got = mlstm_tail_bwd(h, xc, z, w, skip, got_f[1], got_f[2], du, key)
    ref = _tail_bwd_torch(*(x.double() for x in (h, xc, z, w, skip, got_f[1], got_f[2], du)))
    for j, (a, b) in enumerate(zip(got, ref)):
        assert rel_err(a.double(), b) < 1e-5, j


@needs_triton
@pytest.mark.parametrize("T,with_state", [(2, True), (45, True), (45, False)])
@pytest.mark.parametrize("act", [True, False])
def test_conv_triton_matches_float64_reference(T, with_state, act):
    """The Triton conv (+ SiLU) in float32 against the torch path in float64: output, dx, the
    state's gradient, dw, db; T shorter than the state and longer than one 32-step tile, C = 20
    not a multiple of the channel tile."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, T, 20, generator=g, dtype=F64), torch.randn(2, 3, 20, generator=g, dtype=F64),
          torch.randn(20, 4, generator=g, dtype=F64), torch.randn(20, generator=g, dtype=F64)]
    dy = torch.randn(2, T, 20, generator=g, dtype=F64)
    results = []
    for dtype, backend in ((F64, "torch"), (torch.float32, "triton")):
        ins = [x.to(DEV, dtype).requires_grad_(True) for x in xs]
        state = ins[1] if with_state else None
        y = conv_silu(ins[0], state, ins[2], ins[3], act=act, backend=backend)
        grads = torch.autograd.grad(y, [ins[0], ins[2], ins[3]] + ([state] if with_state else []), dy.to(DEV, dtype))
        results.append([y, *grads])
    for j, (ref, got) in enumerate(zip(*results)):
        assert rel_err(got.double().cpu(), ref.cpu()) < 1e-5, j


@needs_triton
def test_slstm_gates_triton_matches_float64_reference():
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(2, 9, 8, generator=g, dtype=F64), torch.randn(2, 3, 8, generator=g, dtype=F64),
          torch.randn(8, 4, generator=g, dtype=F64), torch.randn(8, generator=g, dtype=F64),
          torch.randn(4, 2, 4, 4, generator=g, dtype=F64)]
    dy = torch.randn(2, 9, 4, 2, 4, generator=g, dtype=F64)
    results = []
    for dtype, backend in ((F64, "torch"), (torch.float32, "triton")):
        ins = [x.to(DEV, dtype).requires_grad_(True) for x in xs]
        y = slstm_gates(*ins, backend=backend)
        results.append([y, *torch.autograd.grad(y, ins, dy.to(DEV, dtype))])
    for j, (ref, got) in enumerate(zip(*results)):
        assert rel_err(got.double().cpu(), ref.cpu()) < 1e-5, j


@needs_triton
def test_tail_ops_pass_opcheck():
    from xlstm_kit.ops.blocks.triton import config_key
    h, xc, z, w, skip = _tail_inputs(N=5, D=8)[:5]
    key = config_key()
    torch.library.opcheck(torch.ops.xlstm_kit.mlstm_tail_fwd.default, (h, xc, z, w, skip, 1e-5, key))
    _, mean, rstd = torch.ops.xlstm_kit.mlstm_tail_fwd(h, xc, z, w, skip, 1e-5, key)
    torch.library.opcheck(torch.ops.xlstm_kit.mlstm_tail_bwd.default, (h, xc, z, w, skip, mean, rstd, torch.randn_like(xc), key))
    torch.library.opcheck(torch.ops.xlstm_kit.head_norm_fwd.default, (h, w, 1e-5, key))
    _, mean, rstd = torch.ops.xlstm_kit.head_norm_fwd(h, w, 1e-5, key)
    torch.library.opcheck(torch.ops.xlstm_kit.head_norm_bwd.default, (h, w, mean, rstd, torch.randn_like(h), key))
    from xlstm_kit.ops.blocks.triton import conv_config_key
    x, st, dout = torch.randn(2, 5, 6, device=DEV), torch.randn(2, 3, 6, device=DEV), torch.randn(2, 5, 6, device=DEV)
    cw, cb = torch.randn(6, 4, device=DEV), torch.randn(6, device=DEV)
    pos = torch.tensor([0, 1, 0, 0, 1], device=DEV, dtype=torch.int32)   # packed documents of lengths 2, 1, 2
    for state, p in ((st, None), (None, None), (None, pos)):
        torch.library.opcheck(torch.ops.xlstm_kit.conv_fwd.default, (x, state, cw, cb, True, conv_config_key(), p))
        torch.library.opcheck(torch.ops.xlstm_kit.conv_bwd.default, (dout, x, state, cw, cb, True, conv_config_key(), p))


@needs_triton
def test_mlstm_block_compiles_fullgraph():
    """One graph (the fused pieces' forward and backward traced, the mLSTM kernel an opaque
    custom op), with eager's values and gradients."""
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    block = randomize_(MLSTMBlock(16, 32, 2, chunk_size=16, backend="triton"), 0.1).to(dev)
    x = torch.randn(2, 16, 16, device=dev, requires_grad=True)
    y = block(x)
    gx, *gp = torch.autograd.grad(y.square().sum(), [x, *block.parameters()])
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    yc = compiled(x)
    cx, *cp = torch.autograd.grad(yc.square().sum(), [x, *block.parameters()])
    assert rel_err(yc, y) < 1e-5 and rel_err(cx, gx) < 1e-4
    for a, b in zip(cp, gp):
        assert rel_err(a, b) < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_kernels_compile_for_hopper():
    """The interpreter accepts code the compiler refuses (a variable changing shape inside a
    runtime branch did): compile every kernel variant for sm_90 (ptxas, no GPU needed), in a
    process without TRITON_INTERPRET (under it the kernels are not compilable objects)."""
    run_outside_interpreter("from tests.layers.test_fused import compile_kernels; compile_kernels()")


def compile_kernels():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xlstm_kit.ops.blocks import triton as kern

    bf, f32 = "*bf16", "*fp32"
    tail = {"h_ptr": bf, "xc_ptr": bf, "z_ptr": bf, "w_ptr": f32, "s_ptr": f32}
    cases = []
    for gate in (0, 1, 2):
        consts = {"ROWS": 8, "BD": 512, "GATE": gate}
        cases.append((kern._tail_fwd, {**tail, "u_ptr": bf, "mean_ptr": f32, "rstd_ptr": f32, "N": "i32", "H": "i32",
                                       "D": "i32", "eps": "fp32", "stride_z": "i32", "ROWS": "constexpr",
                                       "BD": "constexpr", "GATE": "constexpr"}, consts))
        cases.append((kern._tail_bwd, {**tail, "mean_ptr": f32, "rstd_ptr": f32, "du_ptr": bf, "u_ptr": bf,
                                       "dh_ptr": bf, "dxc_ptr": bf, "dz_ptr": bf, "dw_part": f32, "ds_part": f32,
                                       "N": "i32", "H": "i32", "D": "i32", "stride_z": "i32", "ROWS": "constexpr",
                                       "BD": "constexpr", "GATE": "constexpr"}, consts))
    conv = {"K": "constexpr", "HAS_STATE": "constexpr", "HAS_POS": "constexpr", "ACT": "constexpr",
            "BT": "constexpr", "BC": "constexpr"}
    for has_state, has_pos in ((True, False), (False, False), (False, True)):
        for act in (True, False):
            consts = {"K": 4, "HAS_STATE": has_state, "HAS_POS": has_pos, "ACT": act, "BT": 32, "BC": 64}
            pos = "*i32" if has_pos else bf
            cases.append((kern._conv_fwd, {"x_ptr": bf, "s_ptr": bf, "p_ptr": pos, "w_ptr": f32, "b_ptr": f32,
                                           "out_ptr": bf, "T": "i32", "C": "i32", **conv}, consts))
            cases.append((kern._conv_dpre, {"g_ptr": bf, "x_ptr": bf, "s_ptr": bf, "p_ptr": pos, "w_ptr": f32,
                                            "b_ptr": f32, "d_ptr": f32, "dw_part": f32, "db_part": f32, "T": "i32",
                                            "C": "i32", "NT": "i32", **conv}, consts))
            dx_consts = {k: v for k, v in consts.items() if k != "ACT"}
            dx_sig = {k: v for k, v in conv.items() if k != "ACT"}
            cases.append((kern._conv_dx, {"d_ptr": f32, "p_ptr": pos, "w_ptr": f32, "dx_ptr": bf, "ds_ptr": bf,
                                          "T": "i32", "C": "i32", **dx_sig, "KP": "constexpr"}, {**dx_consts, "KP": 4}))
    for fn, sig, consts in cases:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], fn.__name__
