"""The large (xLSTM-7B) block on the GPU, one block at a time, in one call:

1. decode: the fused one-token step (ops/blocks/large_decode.py) at batch 1 under each
   candidate of `gemv_config`'s parameters (programs per row, tile size, warps, minimum rows),
   timed as a replayed CUDA graph of the step; µs per block step and the rate at which it
   streams the block's weights and state, next to the copy rate measured in the same call;
2. batch: the step at batch 1-32, fused (at 2-16 a block of 16 rows a program, under each
   candidate of `matmul_config`) against the compiled PyTorch step, both CUDA-graph replays;
3. prefill: one block's no-grad forward at 32 x 2048 tokens as the model runs it, a profile of
   its kernels (where the time between the GEMMs goes), and the forward at mLSTM chunk
   lengths 128 and 256 as an A/B (the default is 64; six separate input GEMMs instead of the
   one fused GEMM lost twice, 52.4 and 53.4 ms against 49.0 and 45.8: docs/kernels.md, "Decode kernels").

    PYTHONPATH=. python benchmarks/large_tune.py --out $OUT [--sizes 7b,1.3b] [--parts decode,batch,prefill] [--quick]

Writes $OUT/large_tune.jsonl (a line per measurement, as they come) and $OUT/large_tune.md.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton.testing

from xlstm_kit.layers import LargeBlock
from xlstm_kit.layers.mlstm import MLSTMState
from xlstm_kit.ops.blocks import large_decode

# d_model, heads, qk_dim, v_dim, ffn: the presets "7b" and "large-1.3b"
SIZES = {"7b": (4096, 8, 2048, 4096, 10944), "1.3b": (2048, 4, 1024, 2048, 5504)}
QUICK = {"7b": (256, 2, 128, 256, 704), "1.3b": (128, 2, 64, 128, 384)}
# (programs, tile, num_warps, min_rows); the first is the default
CANDIDATES = [(512, 4096, 4, 4), (256, 4096, 4, 4), (1024, 4096, 4, 4), (1024, 4096, 4, 2), (2048, 4096, 4, 2),
              (512, 2048, 4, 4), (1024, 2048, 4, 2), (512, 8192, 8, 4), (1024, 8192, 8, 2), (256, 8192, 8, 4),
              (512, 4096, 8, 4), (1024, 4096, 8, 2)]


def emit(out: str, row: dict) -> None:
    print(json.dumps(row), flush=True)
    with open(os.path.join(out, "large_tune.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")


def copy_rate() -> float:
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * 2 / (triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50) * 1e-3)


def block(size: str, quick: bool) -> LargeBlock:
    d, H, qk, v, F = (QUICK if quick else SIZES)[size]
    torch.manual_seed(0)
    blk = LargeBlock(d, H, qk, v, F)
    with torch.no_grad():   # off the init (zero gate weights): every weight matters
        for p in blk.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return blk.to("cuda", torch.bfloat16).eval()


def step_inputs(blk: LargeBlock, B: int, g: torch.Generator) -> tuple[torch.Tensor, MLSTMState]:
    """A random token input x [B, d_model] (bf16) and a random state of the block at batch B."""
    layer = blk.mlstm_layer
    H, K, V = layer.n_heads, layer.qk_dim // layer.n_heads, layer.v_dim // layer.n_heads
    st = MLSTMState(torch.zeros(B, 0, 0, device="cuda"), torch.randn(B, H, K, V, device="cuda", generator=g),
                    torch.rand(B, H, K, device="cuda", generator=g) + 1, torch.zeros(B, H, device="cuda"))
    return torch.randn(B, layer.d_model, device="cuda", dtype=torch.bfloat16, generator=g), st


def decode(out: str, size: str, quick: bool, rate: float) -> None:
    blk = block(size, quick)
    x, st = step_inputs(blk, 1, torch.Generator(device="cuda").manual_seed(1))
    nbytes = sum(p.numel() * p.element_size() for p in blk.parameters()) + 2 * st.C.numel() * 4
    default = large_decode.gemv_config
    ref = None
    try:
        for prog, tile, warps, min_rows in CANDIDATES:
            large_decode.gemv_config = lambda r, k, a=(prog, tile, warps, min_rows): default(r, k, *a)  # noqa: E731
            row = dict(part="decode", size=size, programs=prog, tile=tile, num_warps=warps, min_rows=min_rows)
            try:
                with torch.no_grad():
                    y = blk.fused_step(x, st)[0]
                    ref = y if ref is None else ref
                    row["max_abs_vs_first"] = (y.float() - ref.float()).abs().max().item()
                    # a new state each call (inplace=False): the replays start from the same C
                    us = 1e3 * triton.testing.do_bench_cudagraph(lambda: blk.fused_step(x, st),
                                                                 rep=100)
                row.update(us=us, tb_s=nbytes / us / 1e6, of_copy_rate=nbytes / us * 1e6 / rate)
            except Exception as e:  # noqa: BLE001 - reported in the row
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            emit(out, row)
    finally:
        large_decode.gemv_config = default


# (block_n, tile, num_warps) of `matmul_config` for a block of batch rows; the first is the default
BATCH_CANDIDATES = [(32, 2048, 8), (16, 2048, 4), (32, 4096, 8), (64, 4096, 8), (16, 1024, 4), (64, 2048, 8)]


def batches(out: str, size: str, quick: bool, rate: float, sizes=(1, 2, 4, 8, 16, 32)) -> None:
    """The block's step at each batch: the fused step (batch 1: the GEMV kernels; 2-16: blocks
    of 16 rows under each `matmul_config` candidate) against the compiled PyTorch step that the
    model takes where the fused one refuses, both replayed as CUDA graphs; µs per block step and
    the share of the copy rate at which it moves the block's weights and states."""
    blk = block(size, quick)
    layer = blk.mlstm_layer
    wbytes = sum(p.numel() * p.element_size() for p in blk.parameters())

    def torch_step(x, st):
        y, st = layer.step(blk.norm_mlstm(x), st)
        x = x + y
        return x + blk.ffn.step(blk.norm_ffn(x)), st

    compiled = torch.compile(torch_step)
    default = large_decode.matmul_config
    g = torch.Generator(device="cuda").manual_seed(2)
    for B in sizes:
        x, st = step_inputs(blk, B, g)
        nbytes = wbytes + 2 * st.C.numel() * 4
        variants = [("compiled PyTorch", None, lambda: compiled(x, st))]
        variants += [("fused", None, lambda: blk.fused_step(x, st))] if B == 1 else \
            [("fused", c, lambda: blk.fused_step(x, st)) for c in BATCH_CANDIDATES]
        with torch.no_grad():
            ref = compiled(x, st)[0].float()
            for name, cand, fn in variants:
                row = dict(part="batch", size=size, batch=B, step=name,
                           config=None if cand is None else dict(zip(("block_n", "tile", "num_warps"), cand)))
                if cand is not None:
                    large_decode.matmul_config = lambda r, k, a=cand: default(r, k, *a)  # noqa: E731
                try:
                    row["max_abs_vs_compiled"] = (fn()[0].float() - ref).abs().max().item()
                    us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100)
                    row.update(us=us, of_copy_rate=nbytes / us * 1e6 / rate)
                except Exception as e:  # noqa: BLE001 - reported in the row
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                finally:
                    large_decode.matmul_config = default
                emit(out, row)


def prefill(out: str, size: str, quick: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    blk = block(size, quick)
    B, T = (2, 128) if quick else (32, 2048)
    x = torch.randn(B, T, blk.mlstm_layer.d_model, device="cuda", dtype=torch.bfloat16)
    layer = blk.mlstm_layer
    with torch.no_grad():
        ref = blk(x)
        ms = triton.testing.do_bench(lambda: blk(x), warmup=2, rep=30)
        emit(out, dict(part="prefill", size=size, variant="as is", ms=ms, tok_s=B * T / ms * 1e3))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            blk(x)
            torch.cuda.synchronize()
        rows = sorted(((e.key[:160], e.count, e.device_time_total / 1e3) for e in prof.key_averages()
                       if e.device_time_total > 0), key=lambda r: -r[2])
        emit(out, dict(part="prefill profile", size=size, kernels=[[k, n, round(t, 3)] for k, n, t in rows[:30]]))
        # the chunk length sets the per-chunk state traffic (B H T/L K V bf16 written by _fwd_states
        # and read by _fwd_out: ~2 GB per 7B block at L = 64) against L x L intra-chunk work
        chunk = layer.chunk_size
        try:
            for c in (128, 256):
                layer.chunk_size = c
                row = dict(part="prefill", size=size, variant=f"chunk {c}")
                try:
                    y = blk(x)
                    ms = triton.testing.do_bench(lambda: blk(x), warmup=2, rep=30)
                    row.update(ms=ms, tok_s=B * T / ms * 1e3,
                               max_abs_vs_as_is=(y.float() - ref.float()).abs().max().item())
                except Exception as e:  # noqa: BLE001 - e.g. a tile past the shared memory: in the row
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                emit(out, row)
        finally:
            layer.chunk_size = chunk


def render(rows: list[dict], rate: float) -> str:
    out = [f"copy rate {rate / 1e12:.2f} TB/s", "", "| size | programs | tile | warps | min rows | µs/block step | TB/s | "
           "of copy rate |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "decode" and "us" in r:
            out.append(f"| {r['size']} | {r['programs']} | {r['tile']} | {r['num_warps']} | {r['min_rows']} | "
                       f"{r['us']:.1f} | {r['tb_s']:.2f} | {100 * r['of_copy_rate']:.0f} % |")
    out += ["", "| size | batch | step | block_n, tile, warps | µs/block step | of copy rate | max abs vs compiled |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "batch":
            cfg = "" if r["config"] is None else ", ".join(str(v) for v in r["config"].values())
            out.append(f"| {r['size']} | {r['batch']} | {r['step']} | {cfg} | " + (
                f"{r['error']} | | |" if "error" in r else
                f"{r['us']:.1f} | {100 * r['of_copy_rate']:.0f} % | {r['max_abs_vs_compiled']:.3g} |"))
    out += ["", "| size | prefill variant | ms / block | tokens/s (one block) | max abs vs as is |", "|---|---|---|---|---|"]
    out += [f"| {r['size']} | {r['variant']} | {r['error']} | | |" if "error" in r else f"| {r['size']} | {r['variant']} | {r['ms']:.2f} | {r['tok_s']:,.0f} | {r.get('max_abs_vs_as_is', 0):.3g} |" for r in rows
            if r["part"] == "prefill"]
    for r in rows:
        if r["part"] == "prefill profile":
            out += ["", f"### {r['size']}: kernels of one block's forward", "", "| kernel | launches | ms |", "|---|---|---|"]
            out += [f"| `{k}` | {n} | {t} |" for k, n, t in r["kernels"]]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="7b,1.3b")
    ap.add_argument("--parts", default="decode,batch,prefill")
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    rate = copy_rate()
    emit(a.out, dict(part="copy rate", tb_s=rate / 1e12, device=torch.cuda.get_device_name()))
    for size in a.sizes.split(","):
        if "decode" in a.parts:
            decode(a.out, size, a.quick, rate)
        if "batch" in a.parts:
            batches(a.out, size, a.quick, rate)
        if "prefill" in a.parts and size == "7b":
            prefill(a.out, size, a.quick)
        torch.cuda.empty_cache()
    rows = [json.loads(line) for line in open(os.path.join(a.out, "large_tune.jsonl"))]
    with open(os.path.join(a.out, "large_tune.md"), "w") as f:
        f.write(render(rows, rate))
    print(f"done in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
