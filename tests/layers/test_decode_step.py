"""The fused one-token step of the mLSTM block (ops/blocks/decode.py) against the block's
PyTorch step in float64, under the Triton interpreter on CPU (and in bf16 on the GPU)."""
import importlib.util

import pytest
import torch

from tests.helpers import run_outside_interpreter

from xlstm_kit.layers.mlstm import MLSTMBlock, MLSTMState

from .decode_common import FALLBACKS, check_fallback, needs_kernels, rel_err, steps_after_prefill_error

pytestmark = [needs_kernels, pytest.mark.interpret]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _block(d, inner, H, block_size=4, conv=4, backend="triton"):
    blk = MLSTMBlock(d, inner, H, qkv_block_size=block_size, conv_kernel_size=conv, backend=backend)
    with torch.no_grad():  # off the init (zero gate weights, unit norms): every path matters
        for p in blk.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return blk.eval()


def _state(blk, B):
    st = blk.layer.init_state(B)
    st = MLSTMState(*(torch.randn_like(s) for s in st))
    return st._replace(m=st.m.abs())


def _double(st):
    return MLSTMState(*(s.double() for s in st))


@pytest.mark.parametrize("d,inner,H,B,block_size,conv", [
    (32, 64, 2, 1, 4, 4),     # 16 channel tiles of 4 (a P-block each)
    (40, 80, 1, 2, 4, 4),     # one head; widths not powers of two
    (48, 288, 4, 2, 4, 4),    # 72 tiles (not a power of two: the step's partial gate sums); D = 72
    (24, 48, 2, 1, 2, 3),     # 2-wide q/k/v blocks, two per tile; a 3-wide conv
    (24, 50, 1, 2, 2, 2),     # the last tile partial (one of its two blocks); a 2-wide conv
    (16, 30, 2, 1, 1, 4),     # 1-wide blocks (a diagonal), the last tile partial; D = 15
    (32, 72, 3, 2, 8, 5),     # 8-wide blocks (8-row tiles); a 5-wide conv
    (8, 4, 1, 1, 4, 4),       # a single tile: one partial gate sum
])
def test_fused_step_equals_float64_step(d, inner, H, B, block_size, conv):
    blk = _block(d, inner, H, block_size, conv)
    st = _state(blk, B)
    x = torch.randn(B, d)
    with torch.no_grad():
        ref, rst = blk.double().step(x.double(), _double(st))
        blk.float()
        assert blk._fused_step(x, st)
        y, new = blk.step(x, MLSTMState(*(s.clone() for s in st)))
    assert y.dtype == x.dtype
    assert rel_err(y, ref) < 1e-5
    for a, b in zip(new, rst):
        assert a.dtype == torch.float32 and rel_err(a, b) < 1e-5


def test_inplace_updates_c_and_conv_and_otherwise_leaves_the_state():
    blk = _block(32, 64, 2)
    st = _state(blk, 2)
    x = torch.randn(2, 32)
    keep = MLSTMState(*(s.clone() for s in st))
    with torch.no_grad():
        y1, new1 = blk.step(x, st)
        for a, b in zip(st, keep):
            assert torch.equal(a, b)
        y2, new2 = blk.step(x, st, inplace=True)
    assert new2.C is st.C and new2.conv is st.conv
    assert torch.equal(y1, y2)
    for a, b in zip(new1, new2):
        assert torch.equal(a, b)


def test_steps_continue_the_parallel_forward():
    """Prefill with the sequence kernels, then fused steps: the same outputs as one forward."""
    blk = _block(32, 64, 2, backend=None)
    assert steps_after_prefill_error(blk, blk.layer, MLSTMState, 32) < 1e-5


@pytest.mark.parametrize("why", FALLBACKS)
def test_unsupported_calls_take_the_pytorch_step(why):
    check_fallback(why, lambda backend: _block(32, 64, 2, backend=backend),
                   lambda blk: setattr(blk.layer.up_proj, "bias", torch.nn.Parameter(torch.zeros(128))), _state, 32)


def test_fused_step_is_one_custom_op_under_compile():
    from xlstm_kit.ops.blocks.decode import block_step_op

    blk = _block(32, 64, 2)
    st = _state(blk, 1)
    x = torch.randn(1, 32)
    layer = blk.layer
    args = (x, blk.norm.weight, layer.up_proj.weight, layer.conv.weight, layer.conv.bias, layer.q_proj.weight,
            layer.k_proj.weight, layer.v_proj.weight, layer.igate.weight, layer.fgate.weight, layer.igate.bias,
            layer.fgate.bias, layer.out_norm.weight, layer.skip, layer.down_proj.weight,
            st.conv.clone(), st.C.clone(), st.n, st.m, 1e-5, 1e-5, 1e-6)
    with torch.no_grad():
        torch.library.opcheck(block_step_op, [a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_decode_kernels_compile_for_hopper_without_spills():
    """Compiled for sm_90 by Triton and ptxas (no GPU; outside the interpreter), at the 125M
    preset's shapes with bf16 weights: no compile error and no register spills."""
    out = run_outside_interpreter("from tests.layers.test_decode_step import sm90; sm90()")
    for line in out.splitlines():
        name, spills, _regs = line.split()
        assert int(spills) == 0, line


def sm90():
    from benchmarks.sm90 import sm90_resources
    from xlstm_kit.ops.blocks import decode

    bf, f32 = "*bf16", "*fp32"
    cases = {
        "up_mix": (decode._up_mix_kernel,
                   {**{n: bf for n in ("x_ptr", "lnw_ptr", "w_ptr", "cw_ptr", "cb_ptr", "wq_ptr", "wk_ptr", "wv_ptr",
                                       "wi_ptr", "wf_ptr", "bi_ptr", "bf_ptr")},
                    **{n: f32 for n in ("cs_ptr", "z_ptr", "q_ptr", "k_ptr", "v_ptr", "xc_ptr", "ip_ptr", "fp_ptr")},
                    "eps": "fp32"},
                   {"D": 768, "DP": 1024, "C": 1536, "KC": 4, "KCP": 4, "P": 4, "H": 4, "HP": 4, "BN": 4,
                    "BK": 1024}),
        "out": (decode._out_kernel, {"h_ptr": f32, "xc_ptr": f32, "z_ptr": f32, "nw_ptr": bf, "skip_ptr": bf,
                                     "w_ptr": bf, "x_ptr": bf, "out_ptr": bf, "eps": "fp32"},
                {"C": 1536, "DM": 768, "H": 4, "D": 384, "DP": 512, "BN": 4}),
    }
    for name, (fn, sig, consts) in cases.items():
        order = [a for a in fn.arg_names]
        full = {a: sig.get(a, "constexpr") for a in order}
        r = sm90_resources(fn, full, consts, num_warps=4)
        print(name, r["spill_stores"] + r["spill_loads"], r["regs"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_bf16_fused_step_within_twice_the_pytorch_step_error(B):
    blk = _block(768, 1536, 4).to("cuda")
    st = MLSTMState(*(s.cuda() for s in _state(blk.cpu(), B)))
    blk.cuda()
    x = torch.randn(B, 768, device="cuda")
    with torch.no_grad():
        exact, _ = blk.double().step(x.double(), _double(st))
        blk.bfloat16()
        assert blk._fused_step(x.bfloat16(), st)
        y, new = blk.step(x.bfloat16(), MLSTMState(*(s.clone() for s in st)))
        blk.layer.backend = "torch"
        y_ref, ref = blk.step(x.bfloat16(), MLSTMState(*(s.clone() for s in st)))
    assert rel_err(y, exact) <= 2 * rel_err(y_ref, exact)
    assert rel_err(new.C, ref.C) < 1e-2
