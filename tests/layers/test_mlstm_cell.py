"""The mLSTM layer's training cell on the Triton kernels (`_MLSTMCellFn`: q, k, v, the gates and
the chunkwise mLSTM in one autograd node that recomputes q, k, v in its backward) against the
layer's plain path in float64: output and every gradient, unpacked and packed; and what it saves."""
import importlib.util
import os

import pytest
import torch

from tests.helpers import rel_err
from tests.layers.test_layers import randomize_
from xlstm_kit.bench.memory import saved_bytes_per_token
from xlstm_kit.layers import MLSTMBlock, MLSTMLayer

F64 = torch.float64
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _block(backend, dtype):
    torch.manual_seed(0)
    block = randomize_(MLSTMBlock(16, 32, 2, chunk_size=16, backend="torch"), 0.2).to(DEV, dtype)
    block.layer.backend = backend
    return block


def _run(block, x, dy, **kw):
    xi = x.detach().to(next(block.parameters()).dtype).requires_grad_(True)
    y = block(xi, **kw)
    grads = torch.autograd.grad(y, [xi, *block.parameters()], dy.to(y.dtype))
    return [y, *grads]


@pytest.mark.parametrize("T,packed", [(37, False), (40, True)])
def test_cell_matches_the_plain_path_in_float64(T, packed):
    """Float32 kernels (T not a multiple of the chunk; or three packed documents) against the
    float64 torch path: the output, the input's gradient and every parameter's (each nonzero)."""
    g = torch.Generator().manual_seed(1)
    B = 1 if packed else 2
    x = torch.randn(B, T, 16, generator=g).to(DEV)
    dy = torch.randn(B, T, 16, generator=g).to(DEV)
    kw = {}
    if packed:
        kw["cu_seqlens"] = torch.tensor([0, 11, 29, 40], device=DEV, dtype=torch.int32)
    ref = _run(_block("torch", F64), x, dy, **kw)
    fast = _block("triton", torch.float32)
    assert fast.layer._cell_on_kernels(torch.empty(1, device=DEV))
    got = _run(fast, x, dy, **kw)
    names = ["y", "x"] + [n for n, _ in fast.named_parameters()]
    for n, a, r in zip(names, got, ref):
        assert r.abs().sum() > 0, n
        assert rel_err(a.double(), r) < 5e-5, n


def test_cell_saves_no_q_k_v(monkeypatch):
    """Saved bytes per token of the block on the kernels: the layer's other path (the chunkwise
    op's own autograd) keeps q, k and v (3 x inner values per token) beside the rest, the cell
    none of them."""
    def per_token():
        block = _block("triton", torch.float32)
        return saved_bytes_per_token(lambda n: torch.randn(2, n // 2, 16, device=DEV), block)["total"][0]

    cell = per_token()
    monkeypatch.setattr(MLSTMLayer, "_cell_on_kernels", lambda self, x_m: False)
    plain = per_token()
    inner = 32
    assert plain - cell >= 3 * inner * 4  # (and i, f: the cell keeps them as one [N, 2H] tensor)


@pytest.mark.parametrize("dtype,T,packed,gates", [(torch.float32, 70, False, True), (torch.float32, 40, True, True),
                                                  (torch.float16, 37, False, False)])
def test_front_kernel_matches_the_pytorch_pieces(dtype, T, packed, gates):
    """The fused front kernel (conv + SiLU, q/k/v maps, gates) against the PyTorch pieces it
    replaces: C = 84 (a partial 32-wide channel tile), T not a multiple of the step tile, packed
    documents; float16 within its rounding."""
    from xlstm_kit.layers.mlstm_cell import front_forward
    from xlstm_kit.ops.blocks import mlstm_front

    g = torch.Generator().manual_seed(2)
    B, C, d, H = (1 if packed else 2), 84, 4, 3
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    x = r(B, T, C).to(dtype)
    cw, cb = r(C, 4) / 2, r(C) / 4
    wq, wk, wv = (r(C // d, d, d).to(dtype) / 2 for _ in range(3))
    wc, wm, b = (r(2 * H, C) / 8).to(dtype), (r(2 * H, C) / 8).to(dtype), r(2 * H).to(dtype)
    pos = None
    if packed:
        from xlstm_kit.layers.fused import doc_positions
        pos = doc_positions(torch.tensor([0, 13, 40], device=DEV, dtype=torch.int32), T)
    want = front_forward(x, cw, cb, wq, wk, wv, wc, wm, b, 1, None, pos)
    got = mlstm_front.mlstm_front_fwd(x, pos, cw, cb, wq, wk, wv, wc, wm, b, gates, mlstm_front.front_config_key())
    tol = 2e-6 if dtype == torch.float32 else 2e-3
    for n, a, w in zip(["x_conv", "q", "k", "v", "gates"], got, want):
        if n in ("x_conv", "gates") and not gates:  # the backward's recomputation: q, k, v only
            assert a.numel() == 0
            continue
        if n == "gates":
            w = w.view(a.shape)
        assert rel_err(a.double(), w.double()) < tol, n


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_front_kernels_compile_for_hopper():
    """The front kernels compile for sm_90 (ptxas, no GPU needed; outside the interpreter),
    bf16 and float32, with and without packed documents and gates."""
    from tests.helpers import run_outside_interpreter

    run_outside_interpreter("from tests.layers.test_mlstm_cell import compile_front; compile_front()")


def compile_front():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from xlstm_kit.ops.blocks import mlstm_front as kern

    for act, prec in (("*bf16", "tf32"), ("*fp32", "ieee")):
        for has_pos in (False, True):
            for gates in (False, True):
                sig = {n: act for n in ("x_ptr", "wq_ptr", "wk_ptr", "wv_ptr", "wgc_ptr", "wgm_ptr", "gb_ptr",
                                        "xc_ptr", "q_ptr", "k_ptr", "v_ptr", "g_ptr")}
                sig.update(p_ptr="*i32" if has_pos else act, cw_ptr="*fp32", cb_ptr="*fp32", T="i32", C="i32",
                           G2="i32")
                consts = dict(K=4, d=4, HAS_POS=has_pos, GATES=gates, BT=32, BC=32, BG=16, PREC=prec)
                sig.update({k: "constexpr" for k in consts})
                compiled = triton.compile(ASTSource(fn=kern._front_fwd, signature=sig, constexprs=consts),
                                          target=GPUTarget("cuda", 90, 32))
                assert compiled.asm["cubin"]
            sig = {n: act for n in ("x_ptr", "wq_ptr", "wk_ptr", "wgc_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dg_ptr",
                                    "dxe_ptr")}
            f32 = "*fp32"
            sig.update(p_ptr="*i32" if has_pos else act, cw_ptr=f32, cb_ptr=f32, d_ptr=f32, wpart_ptr=f32,
                       gpart_ptr=f32, cpart_ptr=f32, T="i32", C="i32", G2="i32", NT="i32", NR="i32")
            consts = dict(K=4, d=4, HAS_POS=has_pos, HAS_DXE=True, BT=32, BC=32, BG=16, PREC=prec)
            sig.update({k: "constexpr" for k in consts})
            assert triton.compile(ASTSource(fn=kern._front_bwd_pre, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32)).asm["cubin"]
            sig = {n: act for n in ("wv_ptr", "wgm_ptr", "dv_ptr", "dg_ptr", "dx_ptr")}
            sig.update(d_ptr=f32, p_ptr="*i32" if has_pos else act, cw_ptr=f32, T="i32", C="i32", G2="i32")
            consts = dict(K=4, d=4, HAS_POS=has_pos, BT=64, BC=64, BG=16, PREC=prec)
            sig.update({k: "constexpr" for k in consts})
            assert triton.compile(ASTSource(fn=kern._front_bwd_dx, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.parametrize("T,packed,taps,extra", [(70, False, 4, True), (40, True, 4, False), (37, False, 2, True)])
def test_front_backward_kernel_matches_the_pytorch_pieces(T, packed, taps, extra):
    """The fused front backward (float32) against the PyTorch pieces' backward: every gradient,
    with and without the gradient x_conv gets from its other readers, packed documents, a
    2-tap conv, a partial channel tile (C = 84) and T not a multiple of the step tile."""
    from xlstm_kit.layers.mlstm_cell import front_backward
    from xlstm_kit.ops.blocks import mlstm_front

    g = torch.Generator().manual_seed(5)
    B, C, d, H = (1 if packed else 2), 84, 4, 3
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    x = r(B, T, C)
    cw, cb = r(C, taps) / 2, r(C) / 4
    wq, wk, wv = (r(C // d, d, d) / 2 for _ in range(3))
    wc, wm = r(2 * H, C) / 8, r(2 * H, C) / 8
    dq, dk, dv, dxe = (r(B, T, C) for _ in range(4))
    dg = r(B * T, 2 * H)
    pos = None
    if packed:
        from xlstm_kit.layers.fused import doc_positions
        pos = doc_positions(torch.tensor([0, 13, 40], device=DEV, dtype=torch.int32), T)
    x_conv = torch.nn.functional.silu(torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.transpose(1, 2), (taps - 1, 0)), cw[:, None, :], cb, groups=C)).transpose(1, 2)
    if packed:  # the reference's conv must not cross the document boundary either
        x_conv = torch.cat([front_forward_conv(x[:, :13], cw, cb), front_forward_conv(x[:, 13:], cw, cb)], 1)
    want = front_backward(dq.view(-1, C), dk.view(-1, C), dv.view(-1, C), dg, dxe if extra else None, x, x_conv,
                          cw, cb, wq, wk, wv, wc, wm, 1, None, pos)
    got = mlstm_front.mlstm_front_bwd(dq, dk, dv, dg, dxe if extra else None, x, pos, cw, cb, wq, wk, wv, wc, wm,
                                      mlstm_front.front_config_key())
    for n, a, w in zip(["dx", "dconv_w", "dconv_b", "dwq", "dwk", "dwv", "dw_conv", "dw_m", "db"], got, want):
        assert a.shape == w.shape and w.abs().sum() > 0, n
        assert rel_err(a.double(), w.double()) < 2e-6, n


def front_forward_conv(x, cw, cb):
    F = torch.nn.functional
    taps = cw.shape[1]
    return F.silu(F.conv1d(F.pad(x.transpose(1, 2), (taps - 1, 0)), cw[:, None, :], cb, groups=x.shape[-1])).transpose(1, 2)


_NO_BREAK = """
import torch
from xlstm_kit.models import XLSTMConfig, XLSTMLanguageModel
cfg = XLSTMConfig.from_name("125M", slstm_at="1:0", vocab_size=256, n_blocks=1, d_model=64, n_heads=4,
                            backend="triton")
block = XLSTMLanguageModel(cfg).to(torch.float16).blocks[0]
x = torch.randn(1, 32, 64, dtype=torch.float16, requires_grad=True)
ex = torch._dynamo.explain(block)(x)
print(ex.graph_count, ex.graph_break_count)
with torch.autocast("cpu", dtype=torch.float16):  # as training runs: the ops turn autocast off inside
    ex = torch._dynamo.explain(block)(x)
print(ex.graph_count, ex.graph_break_count)
# the xLSTM-7B block: its fused kernels' modules are imported with the layers, not in the trace
cfg = XLSTMConfig.from_name("large-125M", vocab_size=256, n_blocks=1, d_model=64, n_heads=2, backend="triton")
block = XLSTMLanguageModel(cfg).to(torch.float16).blocks[0]
ex = torch._dynamo.explain(block)(x)
print(ex.graph_count, ex.graph_break_count)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_cell_block_compiles_in_one_graph():
    """The paper mLSTM block on the cell compiles to one graph in a fresh process (the first
    trace is the one a user's compile_blocks makes; an import of the kernel modules inside it
    broke the graph per block, 8 breaks at the 125M model), also under autocast (where the ops'
    autocast_off broke it 5 times); and the xLSTM-7B block (its SwiGLU kernel module was
    imported in the trace on first use: one break)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", _NO_BREAK], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-6:] == ["1", "0", "1", "0", "1", "0"], run.stdout
