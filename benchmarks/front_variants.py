"""The paper mLSTM layer's front (causal conv + SiLU, head-wise q/k/v maps, gate pre-activations)
forward and backward at the `125M` preset's layer (C = 1536, 4 heads, 4-wide head-wise blocks,
conv 4), bf16, on one GPU: the fused kernels under FrontKernelConfig variants against the
PyTorch pieces (Triton conv + batched matmuls), all timed in one process:

    python3 benchmarks/front_variants.py [--batches 16,4] [--out DIR]

Every variant is checked against the PyTorch pieces first (largest relative error over the
outputs and the gradients). Prints one JSON row per case; writes DIR/front_variants.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from xlstm_kit.bench.timing import Budget, measure
from xlstm_kit.layers import mlstm_cell
from xlstm_kit.models import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.ops.blocks import mlstm_front
from xlstm_kit.ops.blocks.mlstm_front import FrontKernelConfig

DEV, DT = "cuda", torch.bfloat16  # --quick: the CPU under TRITON_INTERPRET=1, float16

VARIANTS = {  # H100 numbers of each: docs/kernels.md ("The paper mLSTM layer's front")
    "default": {},
    "before": dict(bwd_warps=8, programs=128, maxnreg=0),  # earlier defaults
    "p1024": dict(programs=1024),  # the default before 256
    "p128": dict(programs=128),
    "p512": dict(programs=512),
    "p256_bt64": dict(programs=256, bt=64),
    "bwd8w": dict(bwd_warps=8),
    "bt64_8w": dict(bt=64, warps=8, bwd_warps=8, programs=128),
    "fwd_bc64_8w": dict(bc=64, warps=8),
    "dx_bt32": dict(dx_bt=32, dx_bc=64, dx_warps=4),
    "bwd_r128": dict(bwd_maxnreg=128),
    "fwd_r96": dict(maxnreg=96),
    "fwd_uncapped": dict(maxnreg=0),
}


def layer_args(B, T):
    cfg = XLSTMConfig.from_name("125M", slstm_at="1:0", vocab_size=256, n_blocks=1)
    layer = next(m for m in XLSTMLanguageModel(cfg).modules() if hasattr(m, "_gate_weights")).to(DEV, DT)
    g = torch.Generator(device=DEV).manual_seed(0)
    C = layer.conv.weight.shape[0]
    x = torch.randn(B, T, C, device=DEV, generator=g).to(DT)
    w_conv, w_m, b = layer._gate_weights(DT)
    ws = (layer.conv.weight.detach(), layer.conv.bias.detach(), layer.q_proj.weight.detach(),
          layer.k_proj.weight.detach(), layer.v_proj.weight.detach(), w_conv.detach(), w_m.detach(), b.detach())
    grads = [torch.randn(B * T, C, device=DEV, generator=g).to(DT) for _ in range(3)]
    dg = torch.randn(B * T, w_conv.shape[0], device=DEV, generator=g).to(DT)
    dxc = torch.randn(B, T, C, device=DEV, generator=g).to(DT)
    return x, ws, layer.q_proj.pack, grads, dg, dxc


def run(fused: bool, x, ws, pack, grads, dg, dxc):
    conv_kernels = mlstm_cell._conv_kernels(x, "triton")
    front = mlstm_front if fused else None
    fw = lambda: mlstm_cell.front_forward(x, *ws, pack, conv_kernels, None, front=front)  # noqa: E731
    out = fw()
    x_conv = out[0]

    def bw():
        return mlstm_cell.front_backward(*grads, dg, dxc, x, x_conv, *ws[:-1], pack, conv_kernels, None, front=front)

    res = [t for t in (*out, *bw()) if t is not None]
    tf = measure(fw, x.device, Budget(rep_s=0.3, min_reps=10), flush_cache=True).median_ms
    tb = measure(bw, x.device, Budget(rep_s=0.3, min_reps=10), flush_cache=True).median_ms
    return res, tf, tb


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,4")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a test of the mechanics)")
    args = ap.parse_args()
    global DEV, DT
    T = 2048
    if args.quick:
        DEV, DT, T = "cpu", torch.float16, 40
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        inp = layer_args(B, T)
        ref, tf, tb = run(False, *inp)
        rows.append(dict(B=B, variant="pytorch", fwd_ms=round(tf, 3), bwd_ms=round(tb, 3)))
        print(json.dumps(rows[-1]), flush=True)
        for name in args.variants.split(","):
            mlstm_front._FRONT_KEY = FrontKernelConfig(**VARIANTS[name]).key()
            try:
                res, tf, tb = run(True, *inp)
                err = max(((a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
                          for a, r in zip(res, ref))
                rows.append(dict(B=B, variant=name, fwd_ms=round(tf, 3), bwd_ms=round(tb, 3), max_rel_err=err))
            except Exception as e:  # a tile set over the register or shared-memory budget: the next one
                rows.append(dict(B=B, variant=name, error=str(e)[:200]))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "front_variants.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
