"""Tiny inputs for the per-phase kernel tests: float32 tensors on the kernels' device and the
prologue's gate tensors as the kernels take them, with the float64 [B,H,NC,L] reference gates."""
import os

import torch

from tests.ops.mlstm_triton import reference

DEV = "cpu" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "cuda"


def make(B=1, T=37, H=2, K=24, V=40, L=16, seed=0, gates="extreme"):
    from xlstm_kit.ops.mlstm.triton import gates as tri_gates
    from xlstm_kit.ops.mlstm.triton.config import MLSTMKernelConfig

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(DEV)
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, H, V)
    i, f = (rnd(B, T, H, sc=8.0), rnd(B, T, H, sc=10.0)) if gates == "extreme" else (rnd(B, T, H), rnd(B, T, H) + 2.0)
    C0, n0, m0 = rnd(B, H, K, V, sc=0.5), rnd(B, H, K, sc=0.5), rnd(B, H)
    beta, blo, ig, u, xm = tri_gates.gates_padded(i, f, L)
    NC = xm.shape[2]
    ref_gates = reference.gates(i.cpu(), f.cpu(), L)[:3]    # β, ĩ, u in float64
    cfg = MLSTMKernelConfig.tuned(K, V, torch.float32, L)
    return dict(q=q, k=k, v=v, i=i, f=f, C0=C0, n0=n0, m0=m0, gates=(beta, blo, ig, u, xm), ref_gates=ref_gates,
                cfg=cfg, NC=NC, L=L)
