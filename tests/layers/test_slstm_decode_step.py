"""The fused one-token step of the sLSTM block (ops/blocks/slstm_decode.py) against the block's
PyTorch step in float64, under the Triton interpreter on CPU (and in bf16 on the GPU)."""
import importlib.util

import pytest
import torch

from tests.helpers import run_outside_interpreter

from xlstm_kit.layers.slstm import SLSTMBlock, SLSTMState

from .decode_common import FALLBACKS, check_fallback, needs_kernels, rel_err, steps_after_prefill_error

pytestmark = [needs_kernels, pytest.mark.interpret]


def _block(d, H, ffn, conv=4, backend="triton"):
    blk = SLSTMBlock(d, H, ffn, conv_kernel_size=conv, backend=backend)
    with torch.no_grad():  # off the init (zero recurrent weights, unit norms): every path matters
        for p in blk.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return blk.eval()


def _state(blk, B):
    st = blk.layer.init_state(B)
    st = SLSTMState(*(torch.randn_like(s) for s in st))
    return st._replace(n=st.n.abs() + 0.5)   # a normaliser stays positive


def _double(st):
    return SLSTMState(*(s.double() for s in st))


def _reference(blk, x, st):
    """The block's PyTorch step in float64 (the layer's Triton sequence kernels take no float64)."""
    backend, blk.layer.backend = blk.layer.backend, "torch"
    out = blk.double().step(x.double(), _double(st))
    blk.layer.backend = backend
    return out


@pytest.mark.parametrize("d,H,ffn,B,conv", [
    (32, 2, 48, 1, 4),        # one unit tile per head
    (44, 1, 56, 2, 4),        # one head; widths not powers of two, the last unit tile partial
    (96, 2, 72, 3, 4),        # D = 48: six unit tiles; head loops of 16
    (48, 4, 40, 1, 0),        # no convolution (the formal-language configuration)
    (24, 2, 32, 2, 2),        # a width-2 convolution
])
def test_fused_step_equals_float64_step(d, H, ffn, B, conv):
    blk = _block(d, H, ffn, conv)
    st = _state(blk, B)
    x = torch.randn(B, d)
    with torch.no_grad():
        ref, rst = _reference(blk, x, st)
        blk.float()
        assert blk._fused_step(x, st)
        y, new = blk.step(x, st)
    assert y.dtype == x.dtype
    assert rel_err(y, ref) < 1e-5
    for name, a, b in zip(SLSTMState._fields, new, rst):
        assert a.shape == b.shape, name
        if a.numel():
            assert a.dtype == torch.float32 and rel_err(a, b) < 1e-5, name


def test_fused_step_leaves_the_old_state():
    blk = _block(32, 2, 48)
    st = _state(blk, 2)
    keep = SLSTMState(*(s.clone() for s in st))
    with torch.no_grad():
        blk.step(torch.randn(2, 32), st, inplace=True)
    for a, b in zip(st, keep):
        assert torch.equal(a, b)


def test_steps_continue_the_parallel_forward():
    """Prefill with the sequence path, then fused steps: the same outputs as one forward."""
    blk = _block(32, 2, 48, backend=None)
    assert steps_after_prefill_error(blk, blk.layer, SLSTMState, 32) < 1e-5


@pytest.mark.parametrize("why", FALLBACKS)
def test_unsupported_calls_take_the_pytorch_step(why):
    # (a layer forced to "triton" has no float64 sequence kernels: its PyTorch step is not run)
    check_fallback(why, lambda backend: _block(32, 2, 48, backend=backend),
                   lambda blk: setattr(blk.ffn.down_proj, "bias", torch.nn.Parameter(torch.zeros(32))), _state, 32,
                   step_in_float64=False)


def test_fused_step_is_one_custom_op_under_compile():
    from xlstm_kit.ops.blocks.slstm_decode import block_step_op

    blk = _block(32, 2, 48)
    st = _state(blk, 1)
    layer = blk.layer
    args = (torch.randn(1, 32), blk.norm.weight, layer.conv.weight, layer.conv.bias, layer.gate_weight,
            layer.recurrent, layer.bias, layer.out_norm.weight, blk.ffn_norm.weight, blk.ffn.up_proj.weight,
            blk.ffn.down_proj.weight, *st, 4, 1e-5, 1e-5, 1e-5)
    with torch.no_grad():
        torch.library.opcheck(block_step_op, [a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                              test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_decode_kernels_compile_for_hopper_without_spills():
    """Compiled for sm_90 by Triton and ptxas (no GPU; outside the interpreter), at the 125M
    preset's sLSTM shapes with bf16 weights: no compile error and no register spills."""
    out = run_outside_interpreter("from tests.layers.test_slstm_decode_step import sm90; sm90()")
    assert len(out.splitlines()) == 3, out
    for line in out.splitlines():
        name, spills = line.split()
        assert int(spills) == 0, line


def sm90():
    from benchmarks.sm90 import sm90_resources
    from xlstm_kit.ops.blocks import slstm_decode as sd

    bf, f32 = "*bf16", "*fp32"
    cases = {
        "cell": (sd._cell_kernel, {**{n: bf for n in ("x_ptr", "lnw_ptr", "cw_ptr", "cb_ptr", "gw_ptr", "r_ptr",
                                                       "bias_ptr")}, "eps": "fp32"},
                 {"DM": 768, "H": 4, "D": 192, "KC": 4, "NT": 24, "BO": 8, "BJ": 64, "BK": 1024}),
        "ffn_up": (sd._ffn_up_kernel, {"x_ptr": bf, "nw_ptr": bf, "lnw_ptr": bf, "w_ptr": bf,
                                       "hn_eps": "fp32", "ln_eps": "fp32"},
                   {"DM": 768, "H": 4, "D": 192, "DMP": 1024, "F": 1024, "BN": 4}),
        "down": (sd._out_kernel, {"w_ptr": bf, "out_ptr": bf, "eps": "fp32", "n_b": "i32"},
                 {"N": 768, "K": 1024, "HD": 1024, "HDP": 1, "NORM": False, "BB": 1, "EXACT": False,
                  "BN": sd.gemv_config(768, 1024).block_n, "BK": sd.gemv_config(768, 1024).block_k}),
    }
    for name, (fn, sig, consts) in cases.items():
        full = {a: sig.get(a, "constexpr" if a in consts else f32) for a in fn.arg_names}
        r = sm90_resources(fn, full, consts, num_warps=4)
        print(name, r["spill_stores"] + r["spill_loads"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 4])
def test_gpu_bf16_fused_step_within_twice_the_pytorch_step_error(B):
    blk = _block(768, 4, 1024)
    st = SLSTMState(*(s.cuda() for s in _state(blk, B)))
    blk.cuda()
    x = torch.randn(B, 768, device="cuda")
    with torch.no_grad():
        exact, ex_st = _reference(blk, x, st)
        blk.bfloat16()
        assert blk._fused_step(x.bfloat16(), st)
        y, new = blk.step(x.bfloat16(), st)
        blk.layer.backend = "torch"
        y_ref, ref = blk.step(x.bfloat16(), st)
    assert rel_err(y, exact) <= 2 * rel_err(y_ref, exact)
    assert rel_err(new.h, ex_st.h) <= 2 * rel_err(ref.h, ex_st.h) + 1e-6
