"""Resources of a Triton kernel on the H200 (sm_90a), with no GPU: Triton compiles the kernel
to PTX for that target and its bundled ptxas reports registers and spills (`sm90_resources`, also
used by the sm_90 compile tests). A development tool; nothing in the library calls it.

Run as a script, it prints the registers and spills of the DPLR / KDA kernels, each compiled
with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` and Triton's bundled
ptxas, at the default configuration for bf16 inputs: one line per kernel.

    PYTHONPATH=. python benchmarks/sm90.py [K V L] [--gate f32] [--div16]   (default 128 128 64)

--gate f32: the gate gk read by `_fwd_gamma` is float32 (bf16 otherwise) and only the " mixed"
    backward rows are built, the configuration such a call gets (`for_dtypes`: the dk group at
    float32 accuracy, dg float32); the forward kernels other than `_fwd_gamma` do not see the
    gate's dtype. --div16: every pointer and T, H, Tp, NC specialized as multiples of 16, as a real
    launch at e.g. T = 2048, H = 16 compiles them (Triton's alignment specialization): loads then
    vectorize, and registers and spills can differ a lot from the default build, which assumes
    nothing about alignment.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from xlstm_kit.ops.dplr.triton.backward import _bwd_dv
from xlstm_kit.ops.dplr.triton.common import SUB
from xlstm_kit.ops.dplr.triton.config import DPLRKernelConfig, resolve
from xlstm_kit.ops.dplr.triton.dplr_dk import _bwd_dk_pairs, _bwd_dk_state
from xlstm_kit.ops.dplr.triton.kda import _bwd_dv_kda, _fwd_pairs_kda
from xlstm_kit.ops.dplr.triton.kda_dk import _bwd_dk_pairs_kda, _bwd_dk_state_kda
from xlstm_kit.ops.dplr.triton.pairs import _fwd_gamma, _fwd_pairs
from xlstm_kit.ops.dplr.triton.state import _bwd_state, _fwd_state
from xlstm_kit.ops.dplr.triton.wy import _fwd_wy

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def sm90_resources(fn, signature: dict, constexprs: dict, num_warps: int, divisible_by_16=()) -> dict:
    """Compile `fn` (a @triton.jit kernel) with `signature` (every argument: a Triton type or
    "constexpr") and `constexprs` -> {"regs", "spill_stores", "spill_loads", "smem"} (ints).
    `divisible_by_16`: argument names (pointers, ints) a real launch would find multiples of 16,
    as Triton's launcher specializes them; the build then vectorizes as that launch's does."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible_by_16}
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(k.asm["ptx"])
        out = subprocess.run([PTXAS, "-v", "-arch=sm_90a", os.path.join(d, "k.ptx"), "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    st, ld = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out).groups())
    return {"regs": regs, "spill_stores": st, "spill_loads": ld, "smem": k.metadata.shared}


BF16 = {"q", "k", "v", "a", "b", "O", "dO", "dv", "dq", "dk", "da", "db", "beta", "dg", "gk"}
SCALARS = {"Tp": "i32", "NC": "i32", "H": "i32", "T": "i32", "scale": "fp32"}


def build(name, fn, consts, num_warps, gate="*bf16", gk="*bf16", div16_all=False):
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg in SCALARS:
            sig[arg] = SCALARS[arg]
        elif arg in ("tab", "sinfo"):
            sig[arg] = "*i32"
        elif arg == "G":
            sig[arg] = "*fp64"
        elif arg == "dg":
            sig[arg] = gate
        elif arg == "gk":
            sig[arg] = gk
        else:
            sig[arg] = "*bf16" if arg in BF16 else "*fp32"
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    div16 = [a for a in sig if sig[a].startswith("*") or a in ("T", "H", "Tp", "NC")] if div16_all else ()
    r = sm90_resources(fn, sig, consts, num_warps, divisible_by_16=div16)
    print(f"{name:34s} regs {r['regs']:>3d}  spill {r['spill_stores']}/{r['spill_loads']} B  smem {r['smem']} B",
          flush=True)


def main(K=128, V=128, L=64, gk="*bf16", div16=False):
    # bf16 everything (every group low); "mixed": bf16 activations, float32 gk (dk group 3-pass)
    full = resolve(DPLRKernelConfig(), K, V, L, False)
    mixed = resolve(DPLRKernelConfig(lowp_outputs="o,dv"), K, V, L, False)
    c = full
    base = dict(K=K, V=V, L=L, S=SUB, PREC=c.prec, VARLEN=False, KDA=False)
    print(f"K={K} V={V} L={L} gate {gk[1:]}{' div16' if div16 else ''}")
    opts = dict(gk=gk, div16_all=div16)
    build("_fwd_gamma", _fwd_gamma, dict(K=K, L=L, BK=min(K, 64), VARLEN=False), 4, **opts)
    build("_fwd_pairs", _fwd_pairs, dict(base, BK=c.pairs_bk, LO=c.lo_qk), c.pairs_warps, **opts)
    build("_fwd_pairs_kda", _fwd_pairs_kda, dict(base, BK=c.pairs_bk), c.pairs_warps, **opts)
    build("_fwd_wy", _fwd_wy, dict(base, BK=c.wy_bk, BV=c.wy_bv), c.wy_warps, **opts)
    build("_fwd_wy KDA", _fwd_wy, dict(base, BK=c.wy_bk, BV=c.wy_bv, KDA=True), c.wy_warps, **opts)
    st = dict(base, BV=c.state_bv, HAS_H0=True, LO=c.lo_o)
    build("_fwd_state", _fwd_state, st, c.state_warps, **opts)
    build("_fwd_state KDA", _fwd_state, dict(st, KDA=True), c.state_warps, **opts)
    build("_bwd_state", _bwd_state, dict(base, BV=c.state_bv, HAS_DHT=True), c.state_warps, **opts)
    # float32 gates: only the configuration such a call gets (mixed)
    for tag, x in (("", full), (" mixed", mixed))[gk == "*fp32":]:
        dv = dict(base, BK=x.dv_bk, BV=x.bwd_bv, LO=x.lo_dk, LV=x.lo_dv, LG=x.lo_gc)
        dk = dict(base, BK=x.dk_bk, BV=x.bwd_bv, LO=x.lo_dk)
        gate = "*fp32" if tag else "*bf16"
        build("_bwd_dv" + tag, _bwd_dv, dv, x.dv_warps, **opts)
        build("_bwd_dv_kda" + tag, _bwd_dv_kda, dv, x.dv_warps, **opts)
        # the key gradient's two kernels (KDA's and the general op's) at K-tiles of
        # 32, 64 and K (the second kernel's V side read once)
        for bk in sorted({x.dk_bk, min(K, 64), K}):
            for name, pairs, state in (("_bwd_dk_pairs_kda", _bwd_dk_pairs_kda, _bwd_dk_state_kda),
                                       ("_bwd_dk_pairs", _bwd_dk_pairs, _bwd_dk_state)):
                build(f"{name}{tag} BK {bk}", pairs, dict(dk, BK=bk), x.dkp_warps, **opts)
                for w in (4, 8):
                    build(f"{state.__name__}{tag} BK {bk} {w} w", state, dict(dk, BK=bk), w, gate, **opts)


if __name__ == "__main__":
    gate_f32 = "--gate" in sys.argv[:-1] and sys.argv[sys.argv.index("--gate") + 1] == "f32"
    main(*(int(a) for a in sys.argv[1:] if a.isdigit()), gk="*fp32" if gate_f32 else "*bf16",
         div16="--div16" in sys.argv)
