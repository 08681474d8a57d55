"""Chunkwise mLSTM (Triton) forward+backward at the paper model's heads under configuration
variants, in one process, against the tuned default timed in the same run:

    python3 benchmarks/mlstm_variants.py [--shapes 16,4] [--variants default,scan,...] [--out DIR]

Shapes: (B, 2048, 4, 384, 384), bf16, for each B of --shapes. Variants replace fields of
`MLSTMKernelConfig.tuned(384, 384, bfloat16, chunk)` (see VARIANTS). Every variant is first
checked at batch 1 against the float64 PyTorch path (relative error of h and of every input
gradient); then forward+backward is timed (median of CUDA events, L2 flushed) with the memory one
forward keeps for the backward. Prints one JSON row per case and writes DIR/mlstm_variants.jsonl.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from xlstm_kit.bench.timing import Budget, measure
from xlstm_kit.ops.mlstm import mlstm_chunkwise
from xlstm_kit.ops.mlstm.triton import MLSTMKernelConfig, mlstm_chunkwise_triton

# name -> (chunk, fields replaced over the tuned config of that chunk)
VARIANTS = {
    "default": (64, {}),
    "recompute": (64, {"recompute_states": True}),
    "scan": (64, {"seq_scan": True}),
    "recompute_scan": (64, {"recompute_states": True, "seq_scan": True}),
    "seq": (64, {"seq_scan": False}),
    "chunk32": (32, {}),
    "chunk32_scan": (32, {"seq_scan": True}),
    "chunk128": (128, {}),
}


def config(name: str) -> MLSTMKernelConfig:
    chunk, fields = VARIANTS[name]
    return MLSTMKernelConfig.tuned(384, 384, torch.bfloat16, chunk).replace(**fields)


def inputs(B, T, H, K, V, seed, dev, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=dev, generator=g)
    q, k, v = (r(B, T, H, d).to(dtype) for d in (K, K, V))
    i, f = r(B, T, H), r(B, T, H) + 3.0
    return [x.requires_grad_(True) for x in (q, k, v, i, f)], r(B, T, H, V).to(dtype)


def check(name, T, dev):
    """Largest relative error of h and the input gradients against float64, batch 1."""
    xs, dh = inputs(1, T, 4, 384, 384, 1, dev)
    h = mlstm_chunkwise_triton(*xs, config=config(name))[0]
    grads = torch.autograd.grad(h, xs, dh)
    rx = [x.detach().double().requires_grad_(True) for x in xs]
    rh = mlstm_chunkwise(*rx, backend="torch", chunk_size=64)[0]
    rg = torch.autograd.grad(rh, rx, dh.double())
    errs = {}
    for nm, a, b in zip(["h", "dq", "dk", "dv", "di", "df"], [h, *grads], [rh, *rg]):
        errs[nm] = ((a.double() - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="16,4", help="batch sizes B of (B, 2048, 4, 384, 384), e.g. 16,4,1")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    names = args.variants.split(",")
    for name in names:
        t0 = time.time()
        try:
            row = dict(kind="check", variant=name, **check(name, args.T, dev))
        except Exception as e:  # a tile set over the shared-memory limit: the next variant
            row = dict(kind="error", variant=name, error=str(e)[:300])
        row["compile_s"] = round(time.time() - t0, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    bad = {r["variant"] for r in rows if r["kind"] == "error"}
    for B in (int(b) for b in args.shapes.split(",")):
        xs, dh = inputs(B, args.T, 4, 384, 384, 0, dev)
        for name in names:
            if name in bad:
                continue
            cfg = config(name)

            def fb():
                for x in xs:
                    x.grad = None
                mlstm_chunkwise_triton(*xs, config=cfg)[0].backward(dh)

            fb()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            h = mlstm_chunkwise_triton(*xs, config=cfg)[0]
            kept = torch.cuda.memory_allocated() - base
            del h
            t = measure(fb, dev, Budget(rep_s=0.5, min_reps=10), flush_cache=True)
            row = dict(kind="time", shape=[B, args.T, 4, 384, 384], variant=name, fwbw_ms=round(t.median_ms, 3),
                       kept_gib=round(kept / 2**30, 3))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "mlstm_variants.jsonl"), "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
