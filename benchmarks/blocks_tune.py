"""Launch-parameter sweep of the fused block kernels (ops/blocks/triton.py) at the 125M model's
shapes, bf16, on the GPU: every TailKernelConfig / ConvKernelConfig candidate is checked against
the PyTorch twin (layers/fused.py) and timed; the table ends with the bandwidth floor (bytes each
kernel must move / the copy rate measured in the same call). Run from the repository root:

    PYTHONPATH=. python benchmarks/blocks_tune.py --out $OUT [--quick]

Writes $OUT/blocks_tune.jsonl (one line per kernel x config) and prints the best config per kernel.
"""
import argparse
import dataclasses
import itertools
import json
import os

import torch
import triton.testing

from xlstm_kit.layers import fused
from xlstm_kit.ops.blocks import triton as kern


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def copy_rate(nbytes=1 << 30) -> float:
    """bytes/s of a device-to-device copy (read + write counted)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * nbytes / (bench(lambda: y.copy_(x)) * 1e-3)


def tail_cases(N, H, D, quick):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    bf = torch.bfloat16
    h, xc, z, du = r(N, H, D).to(bf), r(N, H * D).to(bf), r(N, H * D).to(bf), r(N, H * D).to(bf)
    w, skip = 1 + 0.1 * r(H * D), r(H * D)
    u_ref, mean, rstd = fused._tail_fwd_torch(h, xc, z, w, skip, 1e-6)
    ref_b = fused._tail_bwd_torch(h, xc, z, w, skip, mean, rstd, du)
    rows = (4, 8) if quick else (4, 8, 16, 32)
    warps = (4, 8) if quick else (4, 8, 16)
    programs = (512, 1 << 20) if quick else (512, 2048, 1 << 20)
    out = []
    for rw, wp in itertools.product(rows, warps):
        cfg = kern.TailKernelConfig(rows=rw, warps=wp)
        res = kern.mlstm_tail_fwd(h, xc, z, w, skip, 1e-6, cfg.key())
        err = rel_err(res[0], u_ref)
        ms = bench(lambda: kern.mlstm_tail_fwd(h, xc, z, w, skip, 1e-6, cfg.key()))
        out.append(dict(kernel="tail_fwd", shape=[N, H, D], config=dataclasses.asdict(cfg), ms=ms, err=err,
                        bytes=N * H * D * 2 * 4))
    for rw, wp, P in itertools.product(rows, warps, programs):
        cfg = kern.TailKernelConfig(rows=rw, bwd_warps=wp, programs=P)
        try:
            res = kern.mlstm_tail_bwd(h, xc, z, w, skip, mean, rstd, du, cfg.key())
        except Exception as e:  # e.g. out of resources
            out.append(dict(kernel="tail_bwd", config=dataclasses.asdict(cfg), error=str(e)[:120]))
            continue
        err = max(rel_err(a, b) for a, b in zip(res, ref_b))
        ms = bench(lambda: kern.mlstm_tail_bwd(h, xc, z, w, skip, mean, rstd, du, cfg.key()))
        out.append(dict(kernel="tail_bwd", shape=[N, H, D], config=dataclasses.asdict(cfg), ms=ms, err=err,
                        bytes=N * H * D * 2 * 8))
    return out


def conv_cases(B, T, C, quick):
    g = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    x = torch.randn(B, T, C, device="cuda", generator=g).to(bf)
    dy = torch.randn(B, T, C, device="cuda", generator=g).to(bf)
    w = torch.randn(C, 4, device="cuda", generator=g) * 0.5
    b = torch.randn(C, device="cuda", generator=g) * 0.1
    base = kern.ConvKernelConfig()
    # float32 PyTorch reference: tap j of w [C, K] multiplies x[t - (K-1-j)]
    x32, w32, b32 = (t.float().detach().requires_grad_() for t in (x, w, b))
    pre = torch.nn.functional.conv1d(torch.nn.functional.pad(x32.transpose(1, 2), (3, 0)), w32.unsqueeze(1), b32,
                                     groups=C).transpose(1, 2)
    ref_f = torch.nn.functional.silu(pre)
    ref_b = (*torch.autograd.grad(ref_f, (x32, w32, b32), dy.float()),)
    ref_b = (ref_b[0], torch.empty(0), ref_b[1], ref_b[2])
    bts = (16, 32) if quick else (16, 32, 64)
    bcs = (64, 128) if quick else (64, 128, 256)
    warps = (4, 8)
    out = []
    configs = [dataclasses.replace(base, bt=bt, bc=bc, warps=wp, bwd_warps=wp)
               for bt, bc, wp in itertools.product(bts, bcs, warps)]
    for cfg in [base] + configs:
        try:
            yf = kern.conv_fwd(x, None, w, b, True, cfg.key())
            err = rel_err(yf, ref_f)
            ms = bench(lambda: kern.conv_fwd(x, None, w, b, True, cfg.key()))
            out.append(dict(kernel="conv_fwd", shape=[B, T, C], config=dataclasses.asdict(cfg), ms=ms, err=err,
                            bytes=B * T * C * 2 * 2))
            res = kern.conv_bwd(dy, x, None, w, b, True, cfg.key())
            err = max(rel_err(a, r) for a, r in zip(res, ref_b) if r.numel())
            ms = bench(lambda: kern.conv_bwd(dy, x, None, w, b, True, cfg.key()))
            out.append(dict(kernel="conv_bwd", shape=[B, T, C], config=dataclasses.asdict(cfg), ms=ms, err=err,
                            bytes=B * T * C * 2 * 3))
        except Exception as e:
            out.append(dict(kernel="conv", config=dataclasses.asdict(cfg), error=str(e)[:120]))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="a few configs only")
    ap.add_argument("--only", choices=("tail", "conv"), help="sweep one kernel family")
    a = ap.parse_args()
    rate = copy_rate()
    rows = []
    if a.only in (None, "tail"):
        rows += tail_cases(32768, 4, 384, a.quick)   # mLSTM block of 125M at 16 x 2048
    if a.only in (None, "conv"):
        rows += conv_cases(16, 2048, 1536, a.quick)  # its convolution
        rows += conv_cases(16, 2048, 768, a.quick)   # the sLSTM block's
    with open(os.path.join(a.out, "blocks_tune.jsonl"), "w") as f:
        for r in rows:
            r["floor_ms"] = r["bytes"] / rate * 1e3 if "bytes" in r else None
            f.write(json.dumps(r) + "\n")
    print(f"copy rate {rate / 1e12:.2f} TB/s")
    default = {"tail_fwd": kern.TailKernelConfig(), "tail_bwd": kern.TailKernelConfig(),
               "conv_fwd": kern.ConvKernelConfig(), "conv_bwd": kern.ConvKernelConfig()}
    best, base = {}, {}
    for r in rows:
        if "ms" not in r:
            continue
        k = (r["kernel"], tuple(r["shape"]))
        if r["config"] == dataclasses.asdict(default[r["kernel"]]):
            base.setdefault(k, r)
        if r["err"] < 2e-2 and (k not in best or r["ms"] < best[k]["ms"]):
            best[k] = r
    for k, r in best.items():
        print(k, f"best {r['ms']:.3f} ms (floor {r['floor_ms']:.3f}) err {r['err']:.1e} {r['config']}",
              f"default {base[k]['ms']:.3f} ms" if k in base else "")

if __name__ == "__main__":
    main()
