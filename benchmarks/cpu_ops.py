"""CPU benchmark of the operators against the installed peers, measured in one process.

    .venv/bin/python -m benchmarks.cpu_ops

Prints a markdown table: median milliseconds of forward+backward, the work rate from the
registry's FLOP and byte counts, and each peer's time divided by ours (> 1: ours is faster).
The implementations are timed round-robin, one call each per round, so that load from other
processes on a shared machine hits all of them alike. The table is made with 2 threads (the
figure that counts) and again with 1: two threads stall whenever another process takes a
core, one thread much less, so the second table tells whether the first was disturbed.
"""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

THREADS = (2, 1)
WARMUP = 3
ROUNDS = 30


@dataclass
class Case:
    """One implementation of an op at one shape: `setup()` returns a no-argument callable
    that runs forward and backward once."""

    op: str
    impl: str
    setup: Callable[[], Callable[[], None]]
    flop: float
    bytes: float
    is_ours: bool


def _mlstm_inputs(B, T, H, K, V, layout_bhtd: bool):
    g = torch.Generator().manual_seed(0)
    shape_qk = (B, H, T, K) if layout_bhtd else (B, T, H, K)
    shape_v = (B, H, T, V) if layout_bhtd else (B, T, H, V)
    shape_g = (B, H, T) if layout_bhtd else (B, T, H)
    q = torch.randn(shape_qk, generator=g)
    k = torch.randn(shape_qk, generator=g)
    v = torch.randn(shape_v, generator=g)
    i = torch.randn(shape_g, generator=g)
    f = torch.randn(shape_g, generator=g) + 3.0  # forget gates mostly open, as in trained models
    dh = torch.randn(shape_v, generator=g)
    return [x.requires_grad_() for x in (q, k, v, i, f)], dh


def mlstm_cases(B=4, T=1024, H=4, K=64, V=64) -> list[Case]:
    """mLSTM chunkwise forward+backward, float32."""
    L = 64
    # matmul work of the chunkwise algorithm at chunk 64 (intra-chunk QKᵀ and PV, inter-chunk
    # q̂C and the kᵀv state update), backward counted as twice the forward
    fwd = B * H * (2 * T * L * (K + V) + 4 * T * K * V)
    flop = 3.0 * fwd
    per_step = B * T * H * 4
    # API traffic: forward reads q,k,v,i,f and writes h; backward reads them and dh, writes grads
    bytes_ = per_step * ((2 * K + V + 2) * 2 + V + (2 * K + V + 2) + V)
    name = f"mlstm_chunkwise fwd+bwd B={B} T={T} H={H} K={K} V={V} fp32"
    cases = []

    def ours(chunk):
        def setup():
            from xlstm_kit.ops.mlstm import mlstm_chunkwise

            args, dh = _mlstm_inputs(B, T, H, K, V, layout_bhtd=False)

            def run():
                h, _ = mlstm_chunkwise(*args, chunk_size=chunk)
                h.backward(dh)
                for a in args:
                    a.grad = None

            return run

        return setup

    for chunk in (32, 64, 128):
        cases.append(Case(name, f"xlstm_kit chunkwise (chunk {chunk}{', default' if chunk == 64 else ''})", ours(chunk), flop, bytes_, chunk == 64))

    def peer(kernel):
        def setup():
            from mlstm_kernels.torch.chunkwise.native import fwbw

            fn = getattr(fwbw, f"mlstm_chunkwise__{kernel}")
            args, dh = _mlstm_inputs(B, T, H, K, V, layout_bhtd=True)  # its layout: [B, H, T, D]

            def run():
                h = fn(*args, chunk_size=64)
                h.backward(dh)
                for a in args:
                    a.grad = None

            return run

        return setup

    for kernel in ("native_custbw", "native_autograd"):
        cases.append(Case(name, f"mlstm_kernels chunkwise--{kernel} (chunk 64)", peer(kernel), flop, bytes_, False))
    return cases


REGISTRY: dict[str, Callable[[], list[Case]]] = {"mlstm_chunkwise": mlstm_cases}


def measure(cases: list[Case], warmup: int = WARMUP, rounds: int = ROUNDS) -> dict[str, list[float]]:
    runs = {}
    for c in cases:
        try:
            runs[c.impl] = c.setup()
        except ImportError as e:  # a peer that is not installed is reported, not fatal
            runs[c.impl] = e
    times: dict[str, list[float]] = {name: [] for name, r in runs.items() if callable(r)}
    for _ in range(warmup):
        for name in times:
            runs[name]()
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def table(op: str, cases: list[Case], times: dict[str, list[float]]) -> str:
    ours = next(c for c in cases if c.is_ours)
    ours_ms = statistics.median(times[ours.impl]) * 1e3
    ours_min = min(times[ours.impl]) * 1e3
    rows = [
        f"### {op}",
        "",
        "| implementation | median ms | min ms | GFLOP/s | GB/s | median / ours | min / ours min |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in cases:
        if c.impl not in times:
            rows.append(f"| {c.impl} | not installed | | | | | |")
            continue
        med = statistics.median(times[c.impl])
        rows.append(
            f"| {c.impl} | {med * 1e3:.1f} | {min(times[c.impl]) * 1e3:.1f} | {c.flop / med / 1e9:.0f} "
            f"| {c.bytes / med / 1e9:.2f} | {med * 1e3 / ours_ms:.2f} | {min(times[c.impl]) * 1e3 / ours_min:.2f} |"
        )
    return "\n".join(rows)


def main() -> None:
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"median of {ROUNDS} round-robin rounds after {WARMUP} warm-up rounds\n")
    for threads in THREADS:
        torch.set_num_threads(threads)
        for op, make in REGISTRY.items():
            cases = make()
            print(table(f"{cases[0].op}, {threads} thread{'s' if threads > 1 else ''}", cases, measure(cases)))
            print()


if __name__ == "__main__":
    main()
