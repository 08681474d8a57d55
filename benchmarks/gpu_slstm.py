"""Fused Triton sLSTM on one GPU: correctness against the float64 reference loop, then timing
against the peers (flashrnn's `vanilla` PyTorch loop and `triton_fused` kernel, and the mLSTM
kernels at the same width), all in one call so the ratios come from one machine state.

On the GPU machine (repository root, peer wheels installed into /tmp/site):
    PYTHONPATH=.:/tmp/site OUT=$OUT python3 benchmarks/gpu_slstm.py check warm time peers
Parts: check (error table, bf16 against the PyTorch loops), warm (compiles the timed variants
on tiny T, so that it can run beside `check` before anything is timed), time (our variants at
the issue's shapes), peers (each in a child process with a time limit).
$VARIANTS (JSON, name -> KernelConfig fields) replaces the default variant list.
Writes $OUT/slstm.jsonl (one JSON per measurement) and appends the tables to $OUT/slstm.md.
DRY=1: a smoke run on CPU under TRITON_INTERPRET=1 (float16 for bf16, tiny sizes, no peers).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

OUT = os.environ.get("OUT", ".")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "240"))
DRY = os.environ.get("DRY") == "1"
DEV = "cpu" if DRY else "cuda"
LOWP = torch.float16 if DRY else torch.bfloat16
# (B, T, heads, D): the two shapes (model widths 512 and 768)
SHAPES = [(16, 1024, 4, 128), (16, 1024, 12, 64)] if not DRY else [(16, 8, 2, 16)]


def emit(**kw):
    with open(os.path.join(OUT, "slstm.jsonl"), "a") as fh:
        fh.write(json.dumps(kw) + "\n")


def md(line=""):
    print(line, flush=True)
    with open(os.path.join(OUT, "slstm.md"), "a") as fh:
        fh.write(line + "\n")


def left() -> float:
    return BUDGET - (time.time() - T0)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def median_ms(fn, **kw):
    if DRY:
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median", **kw)


# ------------------------------------------------------------------------------------ check

def bf16_loop(x, r, b, forget_gate="sigmoid"):
    """The sLSTM loop computed entirely in the input dtype (as a plain PyTorch bf16 run does:
    flashrnn's `vanilla` backend with dtype bfloat16). x [B,T,4,H,D] -> h [B,T,H,D]."""
    import torch.nn.functional as F

    B, T, _, H, D = x.shape
    h = c = n = m = torch.zeros(B, H, D, dtype=x.dtype, device=x.device)
    outs = []
    for t in range(T):
        pre = x[:, t] + torch.einsum("bhd,ghde->bghe", h, r) + b
        i, f, z, o = pre.unbind(1)
        lf = F.logsigmoid(f) if forget_gate == "sigmoid" else f
        m_new = torch.maximum(lf + m, i)
        ig, fg = torch.exp(i - m_new), torch.exp(lf + m - m_new)
        c = fg * c + ig * torch.tanh(z)
        n = fg * n + ig
        m = m_new
        h = torch.sigmoid(o) * c / n
        outs.append(h)
    return torch.stack(outs, 1)


def inputs(B, T, H, D, dtype, scale=1.0, forget_gate="sigmoid", init=True):
    x = torch.randn(B, T, 4, H, D, device=DEV) * scale
    if forget_gate == "exp":
        x[:, :, 1] = -x[:, :, 1].abs() - 0.1
    ts = [x, torch.randn(4, H, D, D, device=DEV) / D ** 0.5, torch.randn(4, H, D, device=DEV) * 0.1]
    if init:
        ts += [torch.rand(B, H, D, device=DEV) * 2 - 1, torch.randn(B, H, D, device=DEV),
               torch.rand(B, H, D, device=DEV) + 0.5, torch.randn(B, H, D, device=DEV)]
    return [t.to(dtype) for t in ts]


def run(fn, ts, ups, **kw):
    leaves = [t.detach().clone().requires_grad_(True) for t in ts]
    init = tuple(leaves[3:]) if len(leaves) > 3 else None
    h, st = fn(*leaves[:3], initial_state=init, output_final_state=True, **kw)
    outs = [h, *st]
    loss = sum((o.double() * u).sum() for o, u in zip(outs, ups))
    grads = torch.autograd.grad(loss, leaves)
    return outs, list(grads)


def check_part():
    from xlstm_kit.ops.slstm.naive import slstm_recurrent_naive
    from xlstm_kit.ops.slstm.triton_kernel import slstm_recurrent_triton

    md("## Correctness against the float64 loop (max relative RMS error over h, final state, all grads)")
    md("")
    md("| inputs | B,T,H,D | forget | kernel | PyTorch loop, same dtype | bf16 loop (all bf16) | kernel / loop |")
    md("|---|---|---|---|---|---|---|")
    cases = [(torch.float32, (5, 1, 2, 64), "sigmoid", 1.0), (torch.float32, (5, 100, 2, 64), "exp", 1.0),
             (torch.float32, (4, 1024, 2, 128), "sigmoid", 1.0), (torch.float32, (5, 100, 2, 256), "sigmoid", 1.0),
             (torch.float32, (16, 100, 2, 64), "sigmoid", 8.0), (torch.float32, (16, 100, 2, 64), "exp", 8.0),
             (LOWP, (16, 100, 2, 64), "sigmoid", 1.0), (LOWP, (16, 1024, 2, 128), "sigmoid", 1.0),
             (LOWP, (16, 1024, 2, 64), "exp", 1.0)]
    if DRY:
        cases = [(torch.float32, (3, 5, 1, 16), "sigmoid", 1.0), (LOWP, (16, 5, 1, 16), "exp", 1.0)]
    for dtype, (B, T, H, D), fg, scale in cases:
        if left() < 20:
            md(f"| {dtype} | {B},{T},{H},{D} | {fg} | skipped: out of time |")
            continue
        try:
            ts = inputs(B, T, H, D, dtype, scale=scale, forget_gate=fg)
            t64 = [t.double() for t in ts]
            ups = [torch.randn(B, T, H, D, dtype=torch.float64, device=DEV)]
            ups += [torch.randn(B, H, D, dtype=torch.float64, device=DEV) for _ in range(4)]
            ref_o, ref_g = run(slstm_recurrent_naive, t64, ups, forget_gate=fg)
            k_o, k_g = run(slstm_recurrent_triton, ts, ups, forget_gate=fg)
            l_o, l_g = run(slstm_recurrent_naive, ts, ups, forget_gate=fg)
            ke = [rel(a, b) for a, b in zip(k_o + k_g, ref_o + ref_g)]
            le = [rel(a, b) for a, b in zip(l_o + l_g, ref_o + ref_g)]
            worst = max(range(len(ke)), key=lambda j: ke[j] / max(le[j], 1e-30))
            pure = ""
            if dtype != torch.float32:  # h from a zero state: the all-bf16 loop against the kernel
                with torch.no_grad():
                    h64 = slstm_recurrent_naive(*t64[:3], forget_gate=fg)[0]
                    hk = slstm_recurrent_triton(*ts[:3], forget_gate=fg)[0]
                    pure = f"h: {rel(bf16_loop(*ts[:3], forget_gate=fg), h64):.2e} (kernel h: {rel(hk, h64):.2e})"
            md(f"| {str(dtype)[6:]} ×{scale:g} | {B},{T},{H},{D} | {fg} | {max(ke):.2e} | {max(le):.2e} | {pure} | "
               f"{max(ke) / max(max(le), 1e-30):.2f} (worst single ratio {ke[worst] / max(le[worst], 1e-30):.2f}) |")
            emit(part="check", dtype=str(dtype), shape=[B, T, H, D], forget=fg, scale=scale, kernel=ke, loop=le)
        except Exception as e:
            md(f"| {dtype} | {B},{T},{H},{D} | {fg} | ERROR {type(e).__name__}: {str(e)[:300]} |")
            emit(part="check", shape=[B, T, H, D], error=f"{type(e).__name__}: {str(e)[:2000]}")
    md("")


# ------------------------------------------------------------------------------------ timing

def variants():
    from xlstm_kit.ops.slstm.triton_kernel import KernelConfig

    if os.environ.get("VARIANTS"):
        return {k: KernelConfig(**v) for k, v in json.loads(os.environ["VARIANTS"]).items()}
    return {
        "default": None,
        "w4": KernelConfig(4, True),
        "w16": KernelConfig(16, True),
        "reload-R": KernelConfig(8, False),
        "kchunk64": KernelConfig(8, False, 64),
        "no-prefetch": KernelConfig(8, True, None, False),
    }


def bench_inputs(B, T, H, D):
    x = torch.randn(B, T, 4, H, D, device=DEV, dtype=LOWP).requires_grad_(True)
    r = (torch.randn(4, H, D, D, device=DEV) / D ** 0.5).to(LOWP).requires_grad_(True)
    b = (torch.randn(4, H, D, device=DEV) * 0.1).to(LOWP).requires_grad_(True)
    do = torch.randn(B, T, H, D, device=DEV, dtype=LOWP)
    return [x, r, b], do


def warm_part():
    """Compile every timed variant (T is a runtime argument: T=8 builds the same kernels)."""
    from xlstm_kit.ops.slstm.triton_kernel import slstm_recurrent_triton

    for name, cfg in variants().items():
        for (B, T, H, D) in SHAPES:
            try:
                xs, do = bench_inputs(B, 8, H, D)
                h, _ = slstm_recurrent_triton(*xs, config=cfg)
                h.backward(do[:, :8])
            except Exception as e:
                print(f"warm {name} {D}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    try:  # our mLSTM at the same widths
        from xlstm_kit.ops import mlstm_chunkwise

        for (B, T, H, D) in SHAPES:
            q = torch.randn(B, 64, H, D, device=DEV, dtype=LOWP, requires_grad=True)
            h, _ = mlstm_chunkwise(q, q, q, q[..., 0], q[..., 1] + 3, backend="triton")
            h.sum().backward()
    except Exception as e:
        print(f"warm mlstm: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if not DRY:
        torch.cuda.synchronize()


def time_part():
    from xlstm_kit.ops.slstm.triton_kernel import slstm_recurrent_triton

    md("## Timing: ours (bf16, median ms of triton.testing.do_bench; fwd+bwd includes the forward)")
    md("")
    md("| variant | B,T,H,D | fwd ms | fwd+bwd ms | µs per step (fwd, bwd) | peak MiB |")
    md("|---|---|---|---|---|---|")
    for name, cfg in variants().items():
        for (B, T, H, D) in SHAPES:
            if left() < 15:
                md(f"| {name} | {B},{T},{H},{D} | skipped: out of time |")
                continue
            try:
                xs, do = bench_inputs(B, T, H, D)
                fn = lambda: slstm_recurrent_triton(*xs, config=cfg)[0]

                def fb():
                    fn().backward(do)

                fb()
                if not DRY:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    fb()
                    torch.cuda.synchronize()
                    mem = (torch.cuda.max_memory_allocated() - base) / 2**20
                else:
                    mem = 0.0
                f = median_ms(fn)
                t_fb = median_ms(fb)
                md(f"| {name} | {B},{T},{H},{D} | {f:.3f} | {t_fb:.3f} | {f / T * 1e3:.2f}, {(t_fb - f) / T * 1e3:.2f} | "
                   f"{mem:.0f} |")
                emit(part="time", variant=name, cfg=None if cfg is None else cfg._asdict(), shape=[B, T, H, D],
                     fwd_ms=f, fwbw_ms=t_fb, peak_mib=mem)
                del xs, do
            except Exception as e:
                md(f"| {name} | {B},{T},{H},{D} | ERROR {type(e).__name__}: {str(e)[:300]} |")
                emit(part="time", variant=name, shape=[B, T, H, D], error=f"{type(e).__name__}: {str(e)[:2000]}")
    md("")


# ------------------------------------------------------------------------------------ peers

def peer_job(label, shape):
    """Child process: one measurement of a peer (flashrnn sLSTM, our mLSTM, mlstm_kernels)."""
    B, T, H, D = shape
    if label.startswith("flashrnn_"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("peers_gpu", os.path.join(".peers", "peers_gpu.py"))
        peers = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(peers)
        peers.OUT = OUT
        peers.run_slstm(label[len("flashrnn_"):], B, T, H, D)  # writes anchors.jsonl
        row = json.loads(open(os.path.join(OUT, "anchors.jsonl")).read().splitlines()[-1])
        emit(part="peers", label=label, shape=shape, fwd_ms=row["fwd_ms"], fwbw_ms=row["fwbw_ms"])
        return
    # mLSTM with the same B, T, heads and head size (q, k, v of size D): the same model width
    ours = label == "mlstm_ours_triton"
    seq = (B, T, H) if ours else (B, H, T)  # mlstm_kernels' layout is [B, H, T, ·]
    q, k, v = (torch.randn(*seq, D, device=DEV, dtype=LOWP, requires_grad=True) for _ in range(3))
    i = torch.randn(*seq, device=DEV, dtype=LOWP, requires_grad=True)
    f = (torch.randn(*seq, device=DEV) + 3.0).to(LOWP).requires_grad_(True)
    do = torch.randn(*seq, D, device=DEV, dtype=LOWP)
    if ours:
        from xlstm_kit.ops import mlstm_chunkwise

        fn = lambda: mlstm_chunkwise(q, k, v, i, f, backend="triton")[0]
    elif label == "mlstm_kernels_limit_chunk":
        from mlstm_kernels.torch import get_mlstm_kernel

        kern = get_mlstm_kernel("chunkwise--triton_limit_chunk")
        fn = lambda: kern(q=q, k=k, v=v, i=i, f=f)
    else:
        raise ValueError(label)

    def fb():
        fn().backward(do)

    fb()
    emit(part="peers", label=label, shape=shape, fwd_ms=median_ms(fn), fwbw_ms=median_ms(fb))


def peers_part():
    jobs = [("flashrnn_vanilla", s) for s in SHAPES] + [("flashrnn_triton_fused", s) for s in SHAPES]
    jobs += [("mlstm_ours_triton", s) for s in SHAPES] + [("mlstm_kernels_limit_chunk", s) for s in SHAPES]
    for label, shape in jobs:
        budget = min(float(os.environ.get("JOB_S", "75")), left() - 5)
        if budget < 10:
            emit(part="peers", label=label, shape=shape, error="skipped: out of time")
            continue
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, "peer-job", label, json.dumps(shape)], timeout=budget,
                               capture_output=True, text=True)
            if r.returncode != 0:
                emit(part="peers", label=label, shape=shape, error=f"exit {r.returncode}: {r.stderr.strip()[-600:]}")
        except subprocess.TimeoutExpired:
            emit(part="peers", label=label, shape=shape, error=f"timeout after {budget:.0f}s")
        print(f"# {label} {shape} {time.time() - t0:.1f}s", file=sys.stderr, flush=True)


def summary_part():
    """Ratios of the best variant of ours to each peer, per shape, from slstm.jsonl."""
    path = os.path.join(OUT, "slstm.jsonl")
    rows = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    md("## Ratios (peer time / our time; > 1 means ours is faster)")
    md("")
    md("| B,T,H,D | ours (variant) fwd / fwd+bwd ms | peer | peer fwd / fwd+bwd ms | ratio fwd | ratio fwd+bwd |")
    md("|---|---|---|---|---|---|")
    for shape in SHAPES:
        ours = [r for r in rows if r.get("part") == "time" and r.get("shape") == list(shape) and "fwbw_ms" in r]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["fwbw_ms"])
        for p in [r for r in rows if r.get("part") == "peers" and r.get("shape") == list(shape)]:
            s = ",".join(map(str, shape))
            if "error" in p:
                md(f"| {s} | {best['variant']} | {p['label']} | {p['error'][:160]} | | |")
                continue
            md(f"| {s} | {best['fwd_ms']:.3f} / {best['fwbw_ms']:.3f} ({best['variant']}) | {p['label']} | "
               f"{p['fwd_ms']:.3f} / {p['fwbw_ms']:.3f} | {p['fwd_ms'] / best['fwd_ms']:.1f} | "
               f"{p['fwbw_ms'] / best['fwbw_ms']:.1f} |")
    md("")


if __name__ == "__main__":
    if sys.argv[1:2] == ["peer-job"]:
        peer_job(sys.argv[2], json.loads(sys.argv[3]))
        sys.exit(0)
    torch.manual_seed(0)
    if not DRY:
        md(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
           f"triton {__import__('triton').__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    for part in sys.argv[1:]:
        {"check": check_part, "warm": warm_part, "time": time_part, "peers": peers_part,
         "summary": summary_part}[part]()
