"""Every mLSTM kernel compiles ahead of time for the H200 (sm_90) at its bfloat16 defaults,
without a GPU: Triton's compiler and bundled ptxas catch what the interpreter does not (a
module-level float inside a kernel, shared memory over the limit, unsupported dot shapes).
Slow (about two minutes on two cores): run with -m slow."""
import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from xlstm_kit.ops.mlstm.triton import backward, gates, output, scan, states, step, varlen  # noqa: E402
from xlstm_kit.ops.mlstm.triton.config import MLSTMKernelConfig, numerics  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
L = 64
BF16 = {"q_ptr", "k_ptr", "v_ptr", "dh_ptr", "h_ptr", "hlo_ptr", "cs_ptr", "dcs_ptr", "dq_ptr", "dk_ptr", "dv_ptr",
        "i_ptr", "f_ptr", "dio_ptr", "dfo_ptr"}
FP64 = {"x_ptr", "xm_ptr", "elast_ptr"}
INT32 = {"tab_ptr", "sinfo_ptr"}
INT64 = {"cu_ptr"}


def _cases():
    """(kernel, constexprs, warps, stages) at K = V = 128, and the K-tiled backward at 256/512."""
    c = MLSTMKernelConfig.tuned(128, 128, torch.bfloat16, L)
    w = MLSTMKernelConfig.tuned(256, 512, torch.bfloat16, L)
    x = MLSTMKernelConfig.tuned(384, 384, torch.bfloat16, L)
    kv3 = dict(K=384, V=384, L=L)
    _, upd, smode, prec = numerics(torch.bfloat16)
    kv = dict(K=128, V=128, L=L)
    kv2 = dict(K=256, V=512, L=L)
    return [
        (gates._gate_prep, dict(L=L), 1, 3),
        (gates._gate_tail, dict(L=L, BT=1024, HAS_LAST=True), 4, 3),
        (states._fwd_states, dict(kv, BK=c.states_bk, BV=c.states_bv, HAS_INIT=True, UPD_MODE=upd, PREC=prec),
         c.states_warps, c.states_stages),
        (states._bwd_dstates, dict(kv, BK=c.dstates_bk, BV=c.dstates_bv, HAS_DFINAL=True, UPD_MODE=upd, PREC=prec),
         c.dstates_warps, c.dstates_stages),
        (scan._m_chain, dict(L=L, BN=64), 4, 3),
        (scan._fwd_local, dict(kv, BK=c.local_bk, BV=c.local_bv, UPD_MODE=upd, PREC=prec), c.local_warps, 1),
        (scan._bwd_local, dict(kv, BK=c.local_bk, BV=c.local_bv, UPD_MODE=upd, PREC=prec), c.local_warps, 1),
        (scan._state_scan, dict(L=L, BE=c.scan_be, G=c.scan_g, HAS_INIT=True, REVERSE=True), c.scan_warps, 3),
        (output._fwd_out, dict(kv, BK=c.out_bk, BV=c.out_bv, STATE_MODE=smode, PREC=prec, P_SPLIT=True, H_LO=True),
         c.out_warps, c.out_stages),
        (backward._bwd_rows, dict(V=128, L=L, BT=32, BV=128, H_LO=True), 4, 3),
        (backward._bwd_fused, dict(kv, BK=128, BV=c.fused_bv, STATE_MODE=smode, PREC=prec, DS_SPLIT=True,
                                   DC_LAST=True, D_MODE=1), c.fused_warps, c.fused_stages),
        (backward._bwd_dqk, dict(kv2, BK=w.dqk_bk, BV=w.dqk_bv, STATE_MODE=smode, PREC=prec, DS_SPLIT=1,
                                 DC_LAST=False, D_MODE=smode), w.dqk_warps, w.dqk_stages),
        (backward._bwd_dv, dict(kv2, BK=w.dv_bk, BV=w.dv_bv, STATE_MODE=smode, PREC=prec, DC_LAST=False),
         w.dv_warps, w.dv_stages),
        (step._step_kernel, dict(K=128, V=128, BK=128, BV=64, HAS_STATE=True, NP=1, NPP=1), 4, 3),
        (varlen._chunk_table, dict(L=L, BN=64, BC=64), 1, 3),
        # the 125M model's heads (K = V = 384): the large-head tiles
        (states._fwd_states, dict(kv3, BK=x.states_bk, BV=x.states_bv, HAS_INIT=True, UPD_MODE=upd, PREC=prec),
         x.states_warps, x.states_stages),
        (states._bwd_dstates, dict(kv3, BK=x.dstates_bk, BV=x.dstates_bv, HAS_DFINAL=True, UPD_MODE=upd, PREC=prec),
         x.dstates_warps, x.dstates_stages),
        (output._fwd_out, dict(kv3, BK=x.out_bk, BV=x.out_bv, STATE_MODE=smode, PREC=prec, P_SPLIT=True, H_LO=True),
         x.out_warps, x.out_stages),
        (backward._bwd_dqk, dict(kv3, BK=x.dqk_bk, BV=x.dqk_bv, STATE_MODE=smode, PREC=prec, DS_SPLIT=1,
                                 DC_LAST=False, D_MODE=smode), x.dqk_warps, x.dqk_stages),
        (backward._bwd_dv, dict(kv3, BK=x.dv_bk, BV=x.dv_bv, STATE_MODE=smode, PREC=prec, DC_LAST=False),
         x.dv_warps, x.dv_stages),
    ]


def _all_cases():
    """_cases() unpacked (VARLEN False), and the packed-sequence variants (VARLEN True) of the
    kernels that take cu_seqlens's chunk table, at their first shape."""
    out, seen = [], set()
    for kernel, cx, warps, stages in _cases():
        varlen = "VARLEN" in kernel.arg_names
        out.append(pytest.param(kernel, dict(cx, VARLEN=False) if varlen else cx, warps, stages,
                                id=kernel.__name__))
        if varlen and kernel.__name__ not in seen:
            seen.add(kernel.__name__)
            out.append(pytest.param(kernel, dict(cx, VARLEN=True), warps, stages, id=kernel.__name__ + "-varlen"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kernel,constexprs,warps,stages", _all_cases())
def test_kernel_compiles_for_sm90(kernel, constexprs, warps, stages):
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ("*bf16" if name in BF16 else "*fp64" if name in FP64 else "*i32" if name in INT32
                         else "*i64" if name in INT64 else "*fp32")
        else:
            sig[name] = "fp32" if name in ("scale", "eps") else "i32"
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs), target=SM90,
                              options=dict(num_warps=warps, num_stages=stages))
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 227 * 1024
