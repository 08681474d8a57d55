"""Packed sequences (cu_seqlens) in the sLSTM Triton kernels: one launch with the
sequences as the kernels' batch, against padding every sequence to the longest and against
the former Python loop over the sequences.

    python3 benchmarks/slstm_varlen_speed.py [--out DIR] [--device cuda] [--quick]

The lengths of benchmarks/varlen_speed.py (64 sequences of 64…4096 steps, seed 0, 131,072
tokens in all); sLSTM heads H x D, bf16 inputs, forward + backward (gradients of x_gates, r,
b). The recurrence is sequential in time and a step's cost hardly depends on the batch, so the
packed call should cost about the padded one (the longest sequence's steps) and far less than
the loop (the sum of all lengths). Median of `--reps` runs after warm-up (CUDA events). Writes
DIR/slstm_varlen_speed.md (DIR = --out, else $OUT, else .). `--quick --device cpu` (under
TRITON_INTERPRET=1): a tiny smoke run of the script itself.
"""
from __future__ import annotations

import argparse
import os

import torch

from xlstm_kit.bench.scripts import median_fwbw_ms, packed_lengths
from xlstm_kit.ops import slstm_recurrent
from xlstm_kit.ops._checks import run_varlen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=192)
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    args = p.parse_args()
    device = torch.device(args.device)
    N, total, lo, hi = (3, 24, 2, 12) if args.quick else (64, 131072, 64, 4096)
    H, D = (1, 16) if args.quick else (args.heads, args.dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ls = packed_lengths(N, total, lo, hi)
    cu = torch.tensor([0] + ls, device=device).cumsum(0)
    leaf = lambda *s: (torch.randn(*s, device=device) * 0.5).to(dtype).requires_grad_()  # noqa: E731
    r, b = leaf(4, H, D, D), leaf(4, H, D)
    op = lambda x, r, b, **kw: slstm_recurrent(x, r, b, backend="triton", **kw)  # noqa: E731
    packed = median_fwbw_ms(lambda x, r, b: op(x, r, b, cu_seqlens=cu), (leaf(1, total, 4, H, D), r, b), args.reps, device)
    padded = median_fwbw_ms(op, (leaf(N, max(ls), 4, H, D), r, b), args.reps, device)
    bounds = cu.tolist()

    def loop_fn(x, r, b):  # what slstm_recurrent did before the kernels took cu_seqlens
        return run_varlen(lambda xs, **kw: op(xs, r, b, **kw), (x,), bounds, None, False)

    loop = median_fwbw_ms(loop_fn, (leaf(1, total, 4, H, D), r, b), 1, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"# sLSTM packed sequences, forward + backward ({name}, {dtype}, median of {args.reps})", "",
             f"{N} sequences, lengths {min(ls)}…{max(ls)} (seed 0), total {total:,} tokens, H = {H}, D = {D}.", "",
             "| packed (cu_seqlens) ms | padded to the longest ms | loop over sequences ms | loop / packed |",
             "|---:|---:|---:|---:|",
             f"| {packed:.1f} | {padded:.1f} | {loop:.1f} | {loop / packed:.1f}x |"]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "slstm_varlen_speed.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
