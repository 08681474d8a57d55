"""The fused one-token step of the large (xLSTM-7B) block (ops/blocks/large_decode.py) against
the block's PyTorch step in float64, under the Triton interpreter on CPU (and in bf16 on the GPU)."""
import importlib.util

import pytest
import torch

from tests.helpers import run_outside_interpreter

from xlstm_kit.layers.large import LargeBlock
from xlstm_kit.layers.mlstm import MLSTMState

from .decode_common import FALLBACKS, check_fallback, needs_kernels, rel_err, steps_after_prefill_error

pytestmark = [needs_kernels, pytest.mark.interpret]


def _block(d, H, qk, v, ffn, backend="triton"):
    blk = LargeBlock(d, H, qk, v, ffn, backend=backend)
    with torch.no_grad():  # off the init (zero gate weights, unit norms): every path matters
        for p in blk.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return blk.eval()


def _state(blk, B):
    st = blk.init_state(B)
    st = MLSTMState(*(torch.randn_like(s) for s in st))
    return st._replace(m=st.m.abs())


def _double(st):
    return MLSTMState(*(s.double() for s in st))


def _small_tiles(monkeypatch):
    """16-row, 16-wide GEMV tiles: partial row tiles and several K tiles at these widths."""
    from xlstm_kit.ops.blocks import large_decode

    monkeypatch.setattr(large_decode, "gemv_config", lambda rows, k: large_decode.GemvConfig(16, 16))
    monkeypatch.setattr(large_decode, "matmul_config", lambda rows, k: large_decode.GemvConfig(16, 16))


@pytest.mark.parametrize("tiles", ["default", "small"])
@pytest.mark.parametrize("d,H,qk,v,ffn,B", [
    (32, 2, 32, 64, 96, 1),     # qk head dim = v head dim / 2, as the 7B
    (40, 1, 20, 40, 72, 3),     # one head; widths not powers of two
    (48, 3, 36, 72, 136, 3),    # three heads (the gate tile padded to 4 rows); head dims 12 and 24
    (40, 1, 20, 40, 72, 13),    # one block of 16 batch rows, 3 of them masked
    (32, 2, 32, 64, 96, 35),    # three blocks of 16 rows, the last with 3 (beyond what the model fuses)
])
def test_fused_step_equals_float64_step(d, H, qk, v, ffn, B, tiles, monkeypatch):
    if tiles == "small":
        _small_tiles(monkeypatch)
    blk = _block(d, H, qk, v, ffn)
    st = _state(blk, B)
    x = torch.randn(B, d)
    with torch.no_grad():
        ref, rst = blk.double().step(x.double(), _double(st))
        blk.float()
        # the model fuses up to one block of 16 rows; the kernels take any batch (called directly here)
        assert blk._fused_step(x, st) == (B <= 16)
        y, new = blk.fused_step(x, MLSTMState(*(s.clone() for s in st)))
    assert y.dtype == x.dtype
    assert rel_err(y, ref) < 1e-5
    for a, b in zip(new[1:], rst[1:]):
        assert a.dtype == torch.float32 and rel_err(a, b) < 1e-5


@pytest.mark.parametrize("tiles", ["default", "small"])
def test_half_precision_batch_block_keeps_float32_accuracy(tiles, monkeypatch):
    """float16 weights at batch 4 (a block of 16 rows on the tensor cores): each activation
    enters the product as two float16 parts, so the step is float32-accurate against float64 on
    the same float16 weights, up to the output's own rounding. One part alone (the PyTorch
    step's rounding) misses it: n 2e-6, m 3e-5, x' 7e-4 at this seed."""
    if tiles == "small":
        _small_tiles(monkeypatch)
    torch.manual_seed(0)
    blk = _block(64, 2, 64, 128, 192).half()
    st = _state(blk, 4)
    x = torch.randn(4, 64).half()
    with torch.no_grad():
        ref, rst = blk.double().step(x.double(), _double(st))
        blk.half()
        y, new = blk.fused_step(x, MLSTMState(*(s.clone() for s in st)))
    assert rel_err(y, ref) < 4e-4   # float16's own rounding of x' is ~3e-4 here
    for a, b in zip(new[1:], rst[1:]):
        assert rel_err(a, b) < 1e-6


def test_inplace_updates_c_and_otherwise_leaves_the_state():
    blk = _block(32, 2, 32, 64, 96)
    st = _state(blk, 2)
    x = torch.randn(2, 32)
    keep = MLSTMState(*(s.clone() for s in st))
    with torch.no_grad():
        y1, new1 = blk.step(x, st)
        for a, b in zip(st, keep):
            assert torch.equal(a, b)
        y2, new2 = blk.step(x, st, inplace=True)
    assert new2.C is st.C
    assert torch.equal(y1, y2)
    for a, b in zip(new1, new2):
        assert torch.equal(a, b)


def test_steps_continue_the_parallel_forward():
    """Prefill with the sequence kernels, then fused steps: the same outputs as one forward."""
    blk = _block(32, 2, 32, 64, 96, backend=None)
    assert steps_after_prefill_error(blk, blk.mlstm_layer, MLSTMState, 32) < 1e-5


def test_batch_over_one_block_takes_the_compiled_pytorch_step():
    """The large step is fused up to one block of 16 batch rows (beyond, the blocks would re-read
    each weight tile): a batch of 17 is refused, with the reason."""
    from xlstm_kit.ops.blocks.large_decode import supports

    blk = _block(32, 2, 32, 64, 96)
    with torch.no_grad():
        assert blk._fused_step(torch.randn(16, 32), _state(blk, 16))
        assert not blk._fused_step(torch.randn(17, 32), _state(blk, 17))
    assert "batch <= 16" in supports("large_block_step", dtype=torch.bfloat16, batch=17)


@pytest.mark.parametrize("why", FALLBACKS)
def test_unsupported_calls_take_the_pytorch_step(why):
    check_fallback(why, lambda backend: _block(32, 2, 32, 64, 96, backend=backend),
                   lambda blk: setattr(blk.ffn.proj_down, "bias", torch.nn.Parameter(torch.zeros(32))), _state, 32,
                   max_batch=16)


@pytest.mark.parametrize("B", [1, 3])   # the GEMV kernels; a block of batch rows
def test_fused_step_is_one_custom_op_under_compile(B):
    from xlstm_kit.ops.blocks.large_decode import large_block_step_op

    blk = _block(32, 2, 32, 64, 96)
    st = _state(blk, B)
    x = torch.randn(B, 32)
    layer, ffn = blk.mlstm_layer, blk.ffn
    args = (x, blk.norm_mlstm.weight, layer.q.weight, layer.k.weight, layer.v.weight, layer.ogate_preact.weight,
            layer.igate_preact.weight, layer.fgate_preact.weight, layer.igate_preact.bias, layer.fgate_preact.bias,
            layer.multihead_norm.weight, layer.out_proj.weight, blk.norm_ffn.weight, ffn.proj_up_gate.weight,
            ffn.proj_up.weight, ffn.proj_down.weight, st.C.clone(), st.n, st.m, 1e-6, 1e-6, 1e-6, 15.0, 1e-6)
    with torch.no_grad():
        torch.library.opcheck(large_block_step_op, [a.detach() if isinstance(a, torch.Tensor) else a for a in args],
                              test_utils=("test_schema", "test_faketensor"))
        # model.compile_step compiles block.step whole: the step traces as the one custom op
        seen = []

        def backend(gm, example_inputs):
            seen.extend(str(node.target) for node in gm.graph.nodes)
            return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        y, new = blk.step(x, st)
        torch._dynamo.reset()
        yc, newc = torch.compile(blk.step, backend=backend, fullgraph=True)(x, st)
    assert any("large_block_step_" in s for s in seen)
    assert torch.equal(y, yc)
    for a, b in zip(new, newc):
        assert torch.equal(a, b)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_large_decode_kernels_compile_for_hopper_without_spills():
    """Compiled for sm_90 by Triton and ptxas (no GPU; outside the interpreter), at the 7B's
    shapes with bf16 weights and the default launch configs, one batch row and a block of 16: no
    compile error, no spills."""
    out = run_outside_interpreter("from tests.layers.test_large_decode_step import sm90; sm90()")
    lines = out.splitlines()
    assert len(lines) == 5 + 4, out
    for line in lines:
        name, regs, spills = line.split()
        assert int(spills) == 0, line


def sm90(d=4096, H=8, qk=2048, v=4096, ffn=10944):
    """Print `kernel registers spill-bytes` for each launch of the step at these shapes: the
    batch-1 launches, then the weight passes at a block of 16 batch rows a program."""
    import triton

    from benchmarks.sm90 import sm90_resources
    from xlstm_kit.ops.blocks import large_decode as ld
    from xlstm_kit.ops.mlstm.triton import step

    bf, f32 = "*bf16", "*fp32"
    K, V = qk // H, v // H
    out_sig = {"u_ptr": f32, "o_ptr": f32, "nw_ptr": bf, "w_ptr": bf, "r_ptr": bf, "out_ptr": f32, "eps": "fp32",
               "n_b": "i32"}
    in_sig = {**{n: bf for n in ("x_ptr", "nw_ptr", "wq_ptr", "wk_ptr", "wv_ptr", "wo_ptr", "wi_ptr", "wf_ptr",
                                 "bi_ptr", "bf_ptr")},
              **{n: f32 for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr", "i_ptr", "f_ptr")},
              "n_b": "i32", "eps": "fp32", "cap": "fp32"}
    up_sig = {"x_ptr": f32, "nw_ptr": bf, "wg_ptr": bf, "wu_ptr": bf, "u_ptr": f32, "n_b": "i32", "eps": "fp32"}
    down_sig = {**out_sig, "nw_ptr": f32, "r_ptr": f32, "out_ptr": bf}
    cases = {"cell": (step._step_kernel, 4, {**{n: f32 for n in (
        "q_ptr", "k_ptr", "v_ptr", "i_ptr", "f_ptr", "c_ptr", "n_ptr", "m_ptr", "h_ptr", "co_ptr", "no_ptr",
        "mo_ptr")}, "scale": "fp32", "eps": "fp32"}, {"K": K, "V": V, "BK": K, "BV": 16, "HAS_STATE": True,
                                                      "NP": 1, "NPP": 1})}
    for bb in (1, ld.BATCH_BLOCK):
        config = ld.gemv_config if bb == 1 else ld.matmul_config
        cin, cout, cup, cdown = config(2 * qk + 2 * v, d), config(d, v), config(ffn, d), config(d, ffn)
        both = {"BB": bb, "EXACT": False}
        cases.update({
            f"in/{bb}": (ld._in_kernel, cin.num_warps, in_sig,
                         {"D": d, "QK": qk, "V": v, "H": H, "HP": max(triton.next_power_of_2(H), 1 if bb == 1 else 16),
                          "BN": cin.block_n, "BK": cin.block_k, **both}),
            f"out/{bb}": (ld._out_kernel, cout.num_warps, out_sig,
                          {"N": d, "K": v, "HD": V, "HDP": triton.next_power_of_2(V), "NORM": True,
                           "BN": cout.block_n, "BK": min(cout.block_k, triton.next_power_of_2(V)), **both}),
            f"ffn_up/{bb}": (ld._ffn_up_kernel, cup.num_warps, up_sig,
                             {"D": d, "F": ffn, "BN": cup.block_n, "BK": cup.block_k, **both}),
            f"down/{bb}": (ld._out_kernel, cdown.num_warps, down_sig,
                           {"N": d, "K": ffn, "HD": ffn, "HDP": 1, "NORM": False, "BN": cdown.block_n,
                            "BK": cdown.block_k, **both}),
        })
    for name, (fn, warps, sig, consts) in cases.items():
        full = {a: sig.get(a, "constexpr") for a in fn.arg_names}
        r = sm90_resources(fn, full, consts, num_warps=warps)
        print(name, r["regs"], r["spill_stores"] + r["spill_loads"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B", [1, 4, 16])
def test_gpu_bf16_fused_step_within_twice_the_pytorch_step_error(B):
    blk = _block(2048, 4, 1024, 2048, 5504)  # the large-1.3B preset's block
    st = MLSTMState(*(s.cuda() for s in _state(blk, B)))
    blk.cuda()
    x = torch.randn(B, 2048, device="cuda")
    with torch.no_grad():
        exact, _ = blk.double().step(x.double(), _double(st))
        blk.bfloat16()
        assert blk._fused_step(x.bfloat16(), st)
        y, new = blk.fused_step(x.bfloat16(), MLSTMState(*(s.clone() for s in st)))
        blk.mlstm_layer.backend = "torch"
        y_ref, ref = blk.step(x.bfloat16(), MLSTMState(*(s.clone() for s in st)))
    assert rel_err(y, exact) <= 2 * rel_err(y_ref, exact)
    assert rel_err(new.C, ref.C) < 1e-2
