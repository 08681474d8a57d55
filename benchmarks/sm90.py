"""Resources of a Triton kernel on the H200 (sm_90a), with no GPU: Triton compiles the kernel
to PTX for that target and its bundled ptxas reports registers and spills. A development tool
(benchmarks/dplr_sm90.py, the sm_90 compile tests); nothing in the library calls it."""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

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
