"""The sLSTM Triton package by phase, its configuration and its torch.library custom ops.

Each phase module (forward, backward, step) against its PyTorch reference under
TRITON_INTERPRET=1 with tiny shapes; the custom ops through `torch.library.opcheck`; and
`torch.compile(fullgraph=True)` over the public op with backend="triton" (no graph breaks,
same values and gradients as eager). `test_kernels_compile_for_sm90` (slow) compiles the real
kernels for the H200 with Triton's bundled ptxas, no GPU needed.
"""
import os

import pytest
import torch

from tests.helpers import rel_err, run_outside_interpreter
from xlstm_kit.ops.slstm import slstm_recurrent

triton_slstm = pytest.importorskip("xlstm_kit.ops.slstm.triton")
from xlstm_kit.ops.slstm.triton import backward as bwd_phase  # noqa: E402
from xlstm_kit.ops.slstm.triton import forward as fwd_phase  # noqa: E402
from xlstm_kit.ops.slstm.triton.common import prepare_r  # noqa: E402
from xlstm_kit.ops.slstm.triton.config import SLSTMKernelConfig, default_config, fits, launch  # noqa: E402
from xlstm_kit.ops.slstm.triton.step import step_reference  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="CPU kernel tests run under TRITON_INTERPRET=1 (make test sets it)")


def inputs(B=3, T=3, H=1, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 4, H, D, generator=g)
    r = torch.randn(4, H, D, D, generator=g) / D ** 0.5
    b = torch.randn(4, H, D, generator=g) * 0.1
    init = (torch.rand(B, H, D, generator=g) * 2 - 1, torch.randn(B, H, D, generator=g),
            torch.rand(B, H, D, generator=g) + 0.5, torch.randn(B, H, D, generator=g))
    return x, r, b, init


# ------------------------------------------------------------------ configuration

def test_config_is_typed_and_frozen():
    cfg = default_config(64, 1)
    assert isinstance(cfg, SLSTMKernelConfig)
    with pytest.raises(ValueError, match="no field block_bb"):
        cfg.replace(block_bb=32)
    assert cfg.replace(block_b=32).block_b == 32 and cfg.block_b == 16
    assert SLSTMKernelConfig.from_key(cfg.key()) == cfg
    for bad in (dict(num_warps=3, r_resident=True), dict(num_warps=4, r_resident=True, block_b=8),
                dict(num_warps=4, r_resident=True, k_chunk=24)):
        with pytest.raises(ValueError):
            SLSTMKernelConfig(**bad)


def test_default_config_splits_heads_only_when_the_grid_fits():
    # D = 192 at the 125M shape: 12 programs of 16 units per head, K in 3 chunks of 64 (no
    # padding to 256); 4x the batch: 32 units per program, so that 96 programs fit on 132 SMs.
    cfg = default_config(192, 1, 16, 4, 132)
    assert cfg.block_u == 16 and cfg.r_resident and cfg.stack_gates and cfg.bwd_partials
    assert not default_config(192, 1).bwd_partials  # one program per head: the partials are untimed there
    assert default_config(192, 2, 16, 4, 132).stack_gates  # float32 R (split hi + lo) as well
    lc = launch(cfg, 192)
    assert (lc.p, lc.kc, lc.nkc) == (12, 64, 3)
    assert default_config(192, 1, 64, 4, 132).block_u == 32
    # Without the device facts (CPU, the interpreter), or when the split grid would not fit on
    # the GPU at once, one program per head.
    assert default_config(192, 1).block_u is None
    assert default_config(192, 1, 1024, 4, 132).block_u is None
    assert fits(default_config(384, 1, 8, 4, 132), 384, 8, 4, 132)


def test_split_config_refused_without_room():
    # A barrier whose programs cannot all run at once would spin forever: refused before launch.
    x, r, b, init = inputs(B=3, T=2, D=32)
    r_hi, r_lo, mm = prepare_r(r, torch.float32)
    with pytest.raises(ValueError, match="split head"):
        fwd_phase.forward(x, r_hi, r_lo, mm, b, init, False, False,
                          SLSTMKernelConfig(4, True, block_u=16), sms=None)
    with pytest.raises(ValueError, match="block_u"):
        SLSTMKernelConfig(4, True, block_u=24)


@needs_interpreter
def test_config_none_is_the_default():
    x, r, b, init = inputs()
    h0, s0 = triton_slstm.slstm_recurrent_triton(x, r, b, initial_state=init, output_final_state=True)
    cfg = default_config(16, prepare_r(r, torch.float32)[2])
    h1, s1 = triton_slstm.slstm_recurrent_triton(x, r, b, initial_state=init, output_final_state=True,
                                                 config=cfg)
    assert torch.equal(h0, h1) and all(torch.equal(a, c) for a, c in zip(s0, s1))


# ------------------------------------------------------------------ phases against their references

@needs_interpreter
@pytest.mark.parametrize("exp_forget", [False, True])
def test_forward_phase(exp_forget):
    x, r, b, init = inputs()
    r_hi, r_lo, mm = prepare_r(r, torch.float32)
    h, final, saved = fwd_phase.forward(x, r_hi, r_lo, mm, b, init, exp_forget, True,
                                        default_config(16, mm))
    h_ref, final_ref, saved_ref = fwd_phase.forward_reference(x, r, b, init, exp_forget)
    assert rel_err(h, h_ref) < 1e-5
    for got, ref in zip((*final, *saved[1:]), (*final_ref, *saved_ref)):
        assert rel_err(got, ref) < 1e-5


@needs_interpreter
def test_backward_phase():
    x, r, b, init = inputs(B=2, T=4)
    g = torch.Generator().manual_seed(1)
    dh = torch.randn(2, 4, 1, 16, generator=g)
    d_final = tuple(torch.randn(2, 1, 16, generator=g) for _ in range(4))
    r_hi, r_lo, mm = prepare_r(r, torch.float32)
    cfg = default_config(16, mm)
    _, _, saved = fwd_phase.forward(x, r_hi, r_lo, mm, b, init, False, True, cfg)
    dg, d_init = bwd_phase.backward(r_hi, r_lo, mm, saved, init, dh, d_final, False, 0.3, cfg)
    dg_ref, d_init_ref = bwd_phase.backward_reference(x, r, b, init, dh, d_final, clip=0.3)
    assert rel_err(dg, dg_ref) < 2e-5
    for got, ref in zip(d_init, d_init_ref):
        assert rel_err(got, ref) < 2e-5


@needs_interpreter
def test_step_phase_with_gradients():
    # The step op keeps nothing for a backward; its gradient recomputes the step.
    x, r, b, init = inputs(B=3, T=1)
    leaves = [t.clone().requires_grad_(True) for t in (x[:, 0], r, b, *init)]
    h, state = triton_slstm.slstm_step_triton(leaves[0], leaves[1], leaves[2], tuple(leaves[3:]),
                                              forget_gate="exp")
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    h_ref, state_ref = step_reference(ref_leaves[0], ref_leaves[1], ref_leaves[2],
                                        tuple(ref_leaves[3:]), forget_gate="exp")
    g = torch.Generator().manual_seed(2)
    ups = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in (h, *state)]
    sum((o * u).sum() for o, u in zip((h, *state), ups)).backward()
    sum((o * u).sum() for o, u in zip((h_ref, *state_ref), ups)).backward()
    for got, ref in zip((h, *state), (h_ref, *state_ref)):
        assert rel_err(got, ref) < 1e-5
    for leaf, ref in zip(leaves, ref_leaves):
        assert rel_err(leaf.grad, ref.grad) < 2e-5


# ------------------------------------------------------------------ custom ops

@needs_interpreter
def test_opcheck_custom_ops():
    # Every opcheck test for the sequence op (its autograd included); schema, fake tensors and
    # autograd registration for the other two (the AOT-dispatch tests re-run the interpreter).
    x, r, b, init = inputs(B=2, T=2)
    leaves = [t.clone().requires_grad_(True) for t in (x, r, b, *init)]
    torch.library.opcheck(torch.ops.xlstm_kit.slstm_recurrent_fwd.default,
                          (*leaves, "sigmoid", 0.5, "", True))
    quick = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.xlstm_kit.slstm_step.default,
                          (x[:, 0], r, b, *init, "exp", ""), test_utils=quick)
    _, _, _, _, _, hs, g, cs, ns, ms = torch.ops.xlstm_kit.slstm_recurrent_fwd(
        x, r, b, *init, "sigmoid", None, "", True)
    dh = torch.randn_like(x[:, :, 0])
    torch.library.opcheck(torch.ops.xlstm_kit.slstm_recurrent_bwd.default,
                          (r, g, cs, ns, ms, *init[1:], dh, None, init[0], None, None,
                           "sigmoid", 0.5, ""), test_utils=quick)


def compile_matches_eager(x, r, b, init, tol=0.0):
    """Compiled (fullgraph: any graph break fails) and eager run the same kernels: equal
    outputs and gradients (tol > 0 allows for library reductions that pick other algorithms)."""

    def fn(x, r, b, h0, c0, n0, m0):
        return slstm_recurrent(x, r, b, initial_state=(h0, c0, n0, m0), output_final_state=True,
                               backend="triton", recurrent_grad_clip=0.5)

    g = torch.Generator().manual_seed(3)
    ups = [torch.randn(x[:, :, 0].shape, generator=g)]
    ups += [torch.randn(init[0].shape, generator=g) for _ in range(4)]
    ups = [u.to(x.device) for u in ups]
    results = []
    for f in (fn, torch.compile(fn, backend="eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_(True) for t in (x, r, b, *init)]
        h, state = f(*leaves)
        sum((o * u).sum() for o, u in zip((h, *state), ups)).backward()
        results.append([h, *state] + [t.grad for t in leaves])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled) if tol == 0 else rel_err(compiled, eager) <= tol


@needs_interpreter
def test_compile_fullgraph_matches_eager():
    compile_matches_eager(*inputs(B=3, T=3, H=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_compile_fullgraph_matches_eager():
    x, r, b, init = inputs(B=16, T=32, H=2, D=64)
    compile_matches_eager(x.cuda().bfloat16(), r.cuda().bfloat16(), b.cuda(),
                          [s.cuda() for s in init], tol=1e-6)


# ------------------------------------------------------------------ sm_90 compilation (no GPU)

SM90_SCRIPT = r"""
import itertools
from benchmarks.sm90 import sm90_resources
from xlstm_kit.ops.slstm.triton.forward import _slstm_fwd_kernel
from xlstm_kit.ops.slstm.triton.backward import _slstm_bwd_kernel
from xlstm_kit.ops.slstm.triton.config import default_config, flags, launch

FWD_PTRS = "X R RLO BIAS H0 C0 N0 M0 HOUT HS G CS NS MS HT CT NT MT HX CNT CU".split()
BWD_PTRS = "R RLO DH G CS NS MS C0 N0 M0 DHT DCT DNT DMT DG DH0 DC0 DN0 DM0 CNT CU PX".split()

def build(fn, ptrs, consts, num_warps, x_type, r_type):
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ("*i32" if name in ("CNT", "CU") else x_type if name in ("X", "HOUT", "DH")
                         else r_type if name in ("R", "RLO") else "*fp32")
        else:
            sig[name] = "fp32" if name == "clip" else "i32"
    r = sm90_resources(fn, sig, consts, num_warps)
    print(fn.__name__, x_type, consts["VARLEN"], "regs", r["regs"], "spill_bytes", r["spill_stores"])

# bf16 D = 128 (one program per head), float32 D = 64 (split R), bf16 D = 192 split over 3;
# each unpacked and packed (cu_seqlens)
for (x_type, dim, mm, cfg), varlen in itertools.product(
        (("*bf16", 128, 1, default_config(128, 1)), ("*fp32", 64, 2, default_config(64, 2)),
         ("*bf16", 192, 1, default_config(192, 1, 16, 4, 132))), (False, True)):
    lc = launch(cfg, dim)
    common = dict(BT=cfg.block_b, BU=lc.bu, KC=lc.kc, NKC=lc.nkc,
                  **flags(16, dim, cfg.block_b, lc, varlen),
                  EXP_FORGET=False, HAS_INIT=True, MM=mm, R_RESIDENT=cfg.r_resident,
                  PREFETCH=cfg.prefetch, SCRATCH=lc.scratch, SYNC=lc.p > 1, VARLEN=varlen)
    build(_slstm_fwd_kernel, FWD_PTRS, dict(common, SAVE=True, SAVE_H=x_type != "*fp32", STACK=cfg.stack_gates),
          cfg.num_warps, x_type, "*bf16")
    build(_slstm_bwd_kernel, BWD_PTRS, dict(common, HAS_DH=True, HAS_DFINAL=True, CLIP=True,
                                            PARTIALS=cfg.bwd_partials), cfg.num_warps, x_type, "*bf16")
    if dim == 192:  # the backward's exchange by partial sums, the forward's gates stacked
        build(_slstm_bwd_kernel, BWD_PTRS, dict(common, HAS_DH=True, HAS_DFINAL=True, CLIP=True, PARTIALS=True),
              cfg.num_warps, x_type, "*bf16")
        build(_slstm_fwd_kernel, FWD_PTRS, dict(common, SAVE=True, SAVE_H=True, STACK=True),
              cfg.num_warps, x_type, "*bf16")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    # The interpreter accepts Python the compiler rejects (e.g. list indexing): compile for real.
    out = run_outside_interpreter(SM90_SCRIPT)
    assert out.count("regs") == 16, out
