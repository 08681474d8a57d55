"""Packed sequences (cu_seqlens) against one unpacked sequence and against padding.

    python3 benchmarks/varlen_speed.py [--out DIR] [--device cuda] [--quick]

A batch of N sequences with lengths drawn from 64…4096 (seed 0) and scaled to a total of
131,072 tokens, K = V = 128, 16 heads, bf16 inputs, forward + backward (gradients of all
inputs) of:
- ours packed: mlstm_chunkwise / dplr_chunkwise with cu_seqlens [N+1], batch 1;
- ours unpacked: one sequence of the same total length (the 1.15x target's reference);
- ours padded: every sequence padded to the longest, batch N;
- fla's chunk_dplr_delta_rule with the same cu_seqlens (when fla is installed).
Median of `--reps` timed runs after warm-up (CUDA events). Writes DIR/varlen_speed.md (DIR =
--out, else $OUT, else .). `--quick --device cpu`: a tiny smoke run of the script itself.
"""
from __future__ import annotations

import argparse
import importlib.util
import os

import torch
import torch.nn.functional as F

from xlstm_kit.bench.scripts import median_fwbw_ms, packed_lengths
from xlstm_kit.ops import dplr_chunkwise, mlstm_chunkwise


def inputs(op: str, B: int, T: int, H: int, K: int, device, dtype):
    """Leaves of one call: mLSTM (q, k, v, i, f) or DPLR (q, k, v, a, b, gk) in ours' convention."""
    leaf = lambda x: x.detach().to(dtype).requires_grad_()  # noqa: E731
    r = lambda *s: torch.randn(*s, device=device)  # noqa: E731
    if op == "mlstm":
        return [leaf(r(B, T, H, K)), leaf(r(B, T, H, K)), leaf(r(B, T, H, K)), leaf(r(B, T, H)),
                leaf(3 + r(B, T, H))]
    unit = F.normalize(r(B, T, H, K), dim=-1)
    # a unit rows, b = β a with β in (0, 1) (I − b aᵀ contracts), slow decay: as xlstm_kit.bench
    return [leaf(r(B, T, H, K)), leaf(r(B, T, H, K) * K ** -0.5), leaf(r(B, T, H, K)), leaf(unit.clone()),
            leaf(unit * torch.rand(B, T, H, 1, device=device)), leaf(-0.1 * torch.rand(B, T, H, K, device=device))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--no-fla", action="store_true", help="leave out fla's row (its first compile takes minutes)")
    args = p.parse_args()
    device = torch.device(args.device)
    N, total, lo, hi, H, K = (4, 256, 4, 96, 2, 16) if args.quick else (64, 131072, 64, 4096, 16, 128)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ls = packed_lengths(N, total, lo, hi)
    cu = torch.tensor([0] + ls, device=device).cumsum(0)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    head = [f"# Packed sequences, forward + backward ({name}, {dtype}, median of {args.reps})", "",
            f"{N} sequences, lengths {min(ls)}…{max(ls)} (seed 0), total {total:,} tokens, H = {H}, K = V = {K}.", "",
            "| op | packed (cu_seqlens) ms | one sequence of the total ms | packed / one | padded to the longest ms |",
            "|---|---:|---:|---:|---:|"]
    os.makedirs(args.out, exist_ok=True)
    rows = []

    def add(label, fn, op):
        # each row is written as soon as it is timed: a peer that compiles for minutes and
        # runs out of the caller's time limit leaves ours on disk
        packed = median_fwbw_ms(lambda *x: fn(*x, cu_seqlens=cu), inputs(op, 1, total, H, K, device, dtype), args.reps, device)
        whole = median_fwbw_ms(fn, inputs(op, 1, total, H, K, device, dtype), args.reps, device)
        padded = median_fwbw_ms(fn, inputs(op, N, max(ls), H, K, device, dtype), args.reps, device)
        rows.append(f"| {label} | {packed:.2f} | {whole:.2f} | {packed / whole:.2f}x | {padded:.2f} |")
        print(rows[-1], flush=True)
        with open(os.path.join(args.out, "varlen_speed.md"), "w") as f:
            f.write("\n".join(head + rows) + "\n")

    add("mlstm (ours)", mlstm_chunkwise, "mlstm")
    add("dplr (ours)", dplr_chunkwise, "dplr")
    if importlib.util.find_spec("fla") is not None and device.type == "cuda" and not args.no_fla:
        from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule

        def fla(q, k, v, a, b, gk, **kw):
            # fla's additive convention (S (Diag(α) + a bᵀ)): the same contraction as ours with
            # its a = −(our a), its b = our b, as in xlstm_kit.bench.peers
            return chunk_dplr_delta_rule(q, k, v, -a, b, gk, **kw)

        add("dplr (fla chunk_dplr_delta_rule)", fla, "dplr")
    print("\n".join(head + rows))


if __name__ == "__main__":
    main()
