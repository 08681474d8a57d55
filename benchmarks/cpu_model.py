"""CPU training throughput of XLSTMLanguageModel against the official `xlstm` package.

Both models have the same configuration and the same weights (ours is converted from the
official one) and train in the same process, one step of each in turn, so that load from other
processes hits both alike. A step is forward + cross-entropy + backward + AdamW update on a
batch of 16 x 256 byte tokens; the table reports the median tokens/s over the timed steps.

    .venv/bin/python -m benchmarks.cpu_model [--steps N] [--profile]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from xlstm_kit import XLSTMConfig
from xlstm_kit.compat import config_to_official, from_official_xlstm

BATCH, SEQ = 16, 256
VARIANTS = {
    "xLSTM[1:0] (mLSTM only)": [],
    "one sLSTM block (position 1)": [1],
}


def make_models(slstm_at: list[int]):
    import xlstm

    cfg = XLSTMConfig(vocab_size=256, d_model=256, n_blocks=4, n_heads=4, slstm_at=slstm_at, context_length=SEQ)
    official = xlstm.xLSTMLMModel(config_to_official(cfg, slstm_backend="vanilla"))
    official.reset_parameters()
    return official, from_official_xlstm(official)


def train_step(model, opt, batch: torch.Tensor) -> tuple[float, float]:
    """One training step; returns (wall seconds, process CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(slstm_at: list[int], steps: int) -> dict:
    torch.manual_seed(0)
    official, ours = make_models(slstm_at)
    batch = torch.randint(0, 256, (BATCH, SEQ + 1))
    runs = {}
    for name, model in (("official", official), ("ours", ours)):
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), [])
        train_step(model, runs[name][1], batch)  # warm-up (allocator, lazy init)
    for _ in range(steps):  # alternate so that background load hits both alike
        for model, opt, times in runs.values():
            times.append(train_step(model, opt, batch))
    tok = BATCH * SEQ
    res = {name: tok / statistics.median(w for w, _ in times) for name, (_, _, times) in runs.items()}
    # tokens per CPU-second: less sensitive to other processes than wall time (one thread only:
    # with more, OpenMP threads spinning at barriers count as CPU time)
    res.update({name + "_cpu": tok / statistics.median(c for _, c in times) for name, (_, _, times) in runs.items()})
    res["params"] = sum(p.numel() for p in ours.parameters())
    return res


def profile(slstm_at: list[int]) -> str:
    from torch.profiler import profile as torch_profile

    torch.manual_seed(0)
    _, ours = make_models(slstm_at)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    batch = torch.randint(0, 256, (BATCH, SEQ + 1))
    train_step(ours, opt, batch)
    with torch_profile() as prof:
        train_step(ours, opt, batch)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and variant")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table of our step")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_col = torch.get_num_threads() == 1

    print(f"CPU training step (forward, backward, AdamW), batch {BATCH} x {SEQ} bytes, d_model 256, 4 blocks")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}), load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    extra = " official tok/CPU-s | xlstm_kit tok/CPU-s | speed-up (CPU time) |" if cpu_col else ""
    print("| model | params | official tok/s | xlstm_kit tok/s | speed-up |" + extra)
    print("|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if cpu_col else ""))
    for label, slstm_at in VARIANTS.items():
        r = measure(slstm_at, args.steps)
        row = (f"| {label} | {r['params'] / 1e6:.2f}M | {r['official']:,.0f} | {r['ours']:,.0f} | "
               f"{r['ours'] / r['official']:.2f}x |")
        if cpu_col:
            row += f" {r['official_cpu']:,.0f} | {r['ours_cpu']:,.0f} | {r['ours_cpu'] / r['official_cpu']:.2f}x |"
        print(row, flush=True)
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.profile:
        for label, slstm_at in VARIANTS.items():
            print(f"\n### profile of xlstm_kit, {label}\n```\n{profile(slstm_at)}\n```")


if __name__ == "__main__":
    main()
