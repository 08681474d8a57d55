"""mLSTM Triton kernels on one GPU: correctness against the float64 recurrent reference, then
timing, peak memory and compile time against the peers, all in one process/call.

On the GPU machine (repository root, peer wheels installed into /tmp/site, see benchmarks/NOTES-mlstm.md):
    PYTHONPATH=.:/tmp/site OUT=$OUT python3 benchmarks/gpu_mlstm.py check time peers decode
Parts: check (correctness list of issue 5), summary (one table of every variant and peer,
meant to come last), time (our variants at the four shapes; variants as
JSON in $VARIANTS, name -> config overrides), profile (kernel times of the first variant),
peers (.peers/peers_gpu.py jobs: limits, limit_chunk, SDPA; peak memory recorded alongside),
decode (mlstm_step kernel, the official step kernel and the 125M model's tokens/s).
Writes $OUT/mlstm.jsonl (one JSON per measurement) and $OUT/mlstm.md (tables); prints the tables.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import torch

OUT = os.environ.get("OUT", ".")
T0 = time.time()
BUDGET = float(os.environ.get("BUDGET_S", "480"))
SHAPES = [(8, 2048, 16, 128, 128), (2, 8192, 16, 128, 128), (1, 32768, 8, 128, 128), (8, 2048, 8, 256, 512)]
# DRY=1: a smoke run of this script on CPU under TRITON_INTERPRET=1 (float16 for bfloat16, tiny sizes)
DRY = os.environ.get("DRY") == "1"
DEV = "cpu" if DRY else "cuda"
LOWP = torch.float16 if DRY else torch.bfloat16
if DRY:
    SHAPES = [(1, 40, 2, 16, 32), (1, 20, 1, 32, 64)]
MD: list[str] = []


def sync():
    if not DRY:
        torch.cuda.synchronize()


def emit(**kw):
    with open(os.path.join(OUT, "mlstm.jsonl"), "a") as fh:
        fh.write(json.dumps(kw) + "\n")


def md(line=""):
    MD.append(line)
    print(line, flush=True)
    with open(os.path.join(OUT, "mlstm.md"), "w") as fh:
        fh.write("\n".join(MD) + "\n")


def left() -> float:
    return BUDGET - (time.time() - T0)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------ check

def check_part(variants):
    from xlstm_kit.ops.mlstm.naive import mlstm_recurrent_naive, mlstm_step_naive
    from xlstm_kit.ops.mlstm.triton_chunkwise import mlstm_chunkwise_triton
    from xlstm_kit.ops.mlstm.triton_step import mlstm_step_triton

    dev = DEV
    names = "h C n m dq dk dv di df dC0 dn0 dm0".split()

    def run(fn, xs, st, ups):
        xs = [x.detach().requires_grad_(True) for x in xs]
        st = [s.detach().requires_grad_(True) for s in st]
        h, (C, n, m) = fn(xs, st)
        dh, dC, dn, dm = ups
        loss = (h.double() * dh).sum() + (C.double() * dC).sum() + (n.double() * dn).sum() + (m.double() * dm).sum()
        g = torch.autograd.grad(loss, xs + st)
        return [h, C, n, m] + list(g)

    cases = [(1, "normal", 64, 128), (100, "normal", 64, 128), (2048, "normal", 64, 128), (8192, "normal", 64, 128),
             (100, "extreme", 64, 128), (2048, "extreme", 64, 128), (300, "normal", 128, 128),
             (300, "normal", 256, 512), (300, "normal", 512, 64)]
    if os.environ.get("CHECK_QUICK") == "1":  # fits a 5-minute call next to time + peers
        cases = [c for c in cases if c[0] != 8192 and c[2:] != (512, 64) and c[:2] != (100, "extreme")]
    if os.environ.get("CHECK_CASES"):  # JSON list of [T, gates, K, V]; every variant runs at the first K, V
        cases = [tuple(c) for c in json.loads(os.environ["CHECK_CASES"])]
    if DRY:
        cases = [(1, "normal", 16, 32), (64, "extreme", 16, 32), (37, "extreme", 32, 16)]
    md("## Correctness against the float64 recurrent reference (relative RMS error)")
    md("")
    md("fp32: ours in float32. bf16 rule: ours ≤ 2 × (PyTorch float32-compute reference with bf16 inputs and "
       "bf16 h/gradients) + 1e-5. Columns: " + " ".join(names))
    md("")
    allok = True
    for T, gates, K, V in cases:
        if left() < float(os.environ.get("CHECK_CASE_S", "60")):  # seconds one case may need
            md(f"skipped T={T} {gates} K={K} V={V}: out of time")
            continue
        B, H = 1, 2
        gen = lambda *s, sc=1.0: (torch.randn(*s, device=dev) * sc).to(LOWP).float()
        q, k, v = gen(B, T, H, K), gen(B, T, H, K), gen(B, T, H, V)
        if gates == "normal":
            i, f = gen(B, T, H), gen(B, T, H) + 2.0
        else:
            i, f = gen(B, T, H, sc=8.0), gen(B, T, H, sc=10.0)
        st = [gen(B, H, K, V, sc=0.5), gen(B, H, K, sc=0.5), gen(B, H)]
        ups = [torch.randn(B, T, H, V, device=dev, dtype=torch.float64), torch.randn(B, H, K, V, device=dev, dtype=torch.float64),
               torch.randn(B, H, K, device=dev, dtype=torch.float64), torch.randn(B, H, device=dev, dtype=torch.float64)]
        xs = [q, k, v, i, f]
        t0 = time.time()
        ref = run(lambda a, s: mlstm_recurrent_naive(*a, tuple(s), 1e-6), [x.double() for x in xs], [s.double() for s in st], ups)

        def ref_bf16(a, s):
            h, stt = mlstm_recurrent_naive(*a, tuple(s), 1e-6)
            return h.to(LOWP), stt
        r16 = run(ref_bf16, xs, st, ups)
        r16 = [x.to(LOWP) if j in (4, 5, 6, 7, 8) else x for j, x in enumerate(r16)]
        r32 = run(lambda a, s: mlstm_recurrent_naive(*a, tuple(s), 1e-6), xs, st, ups)
        t_ref = time.time() - t0
        e16 = [rel(a, b) for a, b in zip(r16, ref)]
        e32 = [rel(a, b) for a, b in zip(r32, ref)]
        ours32 = run(lambda a, s: mlstm_chunkwise_triton(*a, initial_state=tuple(s), output_final_state=True), xs, st, ups)
        o32 = [rel(a, b) for a, b in zip(ours32, ref)]
        ok32 = all(e <= 2 * r + 1e-4 for e, r in zip(o32, e32))
        allok &= ok32
        md(f"- T={T} {gates} K={K} V={V} (refs {t_ref:.0f}s)")
        md(f"  - torch fp32 ref: " + " ".join(f"{e:.1e}" for e in e32))
        md(f"  - ours fp32 {'PASS' if ok32 else 'FAIL'}: " + " ".join(f"{e:.1e}" for e in o32))
        md(f"  - torch bf16 ref: " + " ".join(f"{e:.1e}" for e in e16))
        emit(part="check", T=T, gates=gates, K=K, V=V, ref32=e32, ref16=e16, ours32=o32)
        # every variant at the first K, V (the T and gate cases); the first one elsewhere
        for vname, cfg in (variants.items() if (K, V) == cases[0][2:] else list(variants.items())[:1]):
            o = run(lambda a, s: mlstm_chunkwise_triton(*(x.to(LOWP) for x in a[:3]), *a[3:], initial_state=tuple(s),
                                                        output_final_state=True, config=cfg), xs, st, ups)
            e = [rel(a, b) for a, b in zip(o, ref)]
            ratio = [x / max(r, 1e-12) for x, r in zip(e, e16)]
            # A tensor of a few elements (T=1: di, df have B·H values) has an RMS rounding error
            # that is luck; there the bound is also allowed one unit of bf16 rounding (2^-8).
            floor = [2.0 ** -8 if t.numel() < 64 else 0.0 for t in o]
            ok = all(x <= max(2 * r, fl) + 1e-5 for x, r, fl in zip(e, e16, floor))
            ok_out = all(x <= max(2 * r, fl) + 1e-5 for j, (x, r, fl) in enumerate(zip(e, e16, floor)) if j in (0, 4, 5, 6, 7, 8))
            if vname == next(iter(variants)):  # the verdict is the first variant's; others are comparisons
                allok &= ok_out
            md(f"  - ours bf16 [{vname}] {'PASS' if ok else ('PASS(outputs) ' if ok_out else 'FAIL')}: "
               + " ".join(f"{x:.1e}" for x in e) + " | ratio " + " ".join(f"{x:.2f}" for x in ratio))
            emit(part="check", variant=vname, T=T, gates=gates, K=K, V=V, ours16=e, ratio=ratio, ok=ok, ok_outputs=ok_out)
        if not DRY:
            torch.cuda.empty_cache()
    # decode step
    for B, H, K, V in ([(2, 1, 24, 40)] if DRY else [(2, 4, 384, 384), (3, 2, 64, 128)]):
        q, k = torch.randn(B, H, K, device=dev), torch.randn(B, H, K, device=dev)
        v = torch.randn(B, H, V, device=dev)
        i, f = torch.randn(B, H, device=dev) * 3, torch.randn(B, H, device=dev) * 3
        st = (torch.randn(B, H, K, V, device=dev), torch.randn(B, H, K, device=dev), torch.randn(B, H, device=dev))
        h, (C, n, m) = mlstm_step_triton(q.to(LOWP), k.to(LOWP), v.to(LOWP), i, f, st)
        rh, (rC, rn, rm) = mlstm_step_naive(*(x.to(LOWP).double() for x in (q, k, v)), i.double(), f.double(),
                                            *(s.double() for s in st), 1e-6)
        errs = [rel(a, b) for a, b in ((h, rh), (C, rC), (n, rn), (m, rm))]
        ok = errs[0] < 8e-3 and max(errs[1:]) < 1e-5
        allok &= ok
        md(f"- step B={B} H={H} K={K} V={V} bf16 in: h {errs[0]:.1e} C {errs[1]:.1e} n {errs[2]:.1e} m {errs[3]:.1e} {'PASS' if ok else 'FAIL'}")
    md("")
    md(f"correctness overall (fp32, step, and bf16 of the first variant, {next(iter(variants))}): {'PASS' if allok else 'FAIL'}")
    md("")


# ------------------------------------------------------------------------------------ timing

def work(B, T, H, K, V, L=64):
    """FLOPs (matmul work of the chunkwise algorithm, causal halves counted) and the API bytes."""
    tok = B * T * H
    fwd_mac = tok * (L / 2 * (K + V) + 2 * K * V)
    bwd_mac = tok * (L / 2 * (3 * K + 2 * V) + 5 * K * V)
    fwd_bytes = tok * 2 * (2 * K + 2 * V)                    # read q, k, v; write h (bf16)
    bwd_bytes = tok * 2 * (2 * K + 3 * V + 2 * K + V)       # read q, k, v, dh, h; write dq, dk, dv
    return 2 * fwd_mac, 2 * (fwd_mac + bwd_mac), fwd_bytes, fwd_bytes + bwd_bytes


def median_ms(fn, warmup=25, rep=100, **kw):
    if DRY:  # no CUDA events on CPU: one timed call
        t0 = time.time()
        fn()
        return (time.time() - t0) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median", **kw)


def bench(fn, grad_of):
    fwd = median_ms(fn)

    def fb():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad_of)

    fwbw = median_ms(fb, grad_to_none=None)
    return fwd, fwbw


def peak_mem(fn, grad_of, params):
    for p in params:
        p.grad = None
    if DRY:
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_of)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def our_inputs(B, T, H, K, V):
    dev = DEV
    r = lambda *s: torch.randn(*s, device=dev, dtype=LOWP).requires_grad_(True)
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    i = r(B, T, H)
    f = (torch.randn(B, T, H, device=dev) + 3.0).to(LOWP).requires_grad_(True)
    do = torch.randn(B, T, H, V, device=dev, dtype=LOWP)
    return [q, k, v, i, f], do


def time_part(variants):
    from xlstm_kit.ops.mlstm.triton_chunkwise import mlstm_chunkwise_triton

    md("## Timing (bf16, median ms; fwd+bwd includes the forward)")
    md("")
    md("| variant | B,T,H,K,V | fwd ms | fwd+bwd ms | TFLOP/s | GB/s | peak MiB | first call s |")
    md("|---|---|---|---|---|---|---|---|")
    for vname, cfg in variants.items():
        for shape in SHAPES:
            if left() < 25:
                md(f"| {vname} | {shape} | skipped: out of time |")
                continue
            try:
                xs, do = our_inputs(*shape)
                fn = lambda: mlstm_chunkwise_triton(*xs, config=cfg)
                t0 = time.time()
                h, _ = fn()
                h.backward(do)
                sync()
                first = time.time() - t0
                mem = peak_mem(fn, do, xs)
                f, fb = bench(fn, do)
                _, flop, _, nbytes = work(*shape)
                md(f"| {vname} | {','.join(map(str, shape))} | {f:.3f} | {fb:.3f} | {flop / fb / 1e9:.0f} | "
                   f"{nbytes / fb / 1e6:.0f} | {mem:.0f} | {first:.1f} |")
                emit(part="time", variant=vname, shape=shape, fwd_ms=f, fwbw_ms=fb, peak_mib=mem, first_s=first,
                     tflops=flop / fb / 1e9, gbs=nbytes / fb / 1e6, cfg=cfg)
                del xs, do, h
            except Exception as e:  # keep timing the others
                md(f"| {vname} | {shape} | ERROR {type(e).__name__}: {str(e)[:200]} |")
                emit(part="time", variant=vname, shape=shape, error=f"{type(e).__name__}: {str(e)[:2000]}")
            if not DRY:
                torch.cuda.empty_cache()
    md("")


def profile_part(variants):
    from torch.profiler import ProfilerActivity, profile as prof
    from xlstm_kit.ops.mlstm.triton_chunkwise import mlstm_chunkwise_triton

    vname, cfg = next(iter(variants.items()))
    for shape in (SHAPES[0], SHAPES[2], SHAPES[3]):
        if left() < 20:
            break
        xs, do = our_inputs(*shape)
        fn = lambda: mlstm_chunkwise_triton(*xs, config=cfg)
        for _ in range(2):
            fn()[0].backward(do)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(3):
                fn()[0].backward(do)
            torch.cuda.synchronize()
        tab = p.key_averages().table(sort_by="cuda_time_total", row_limit=14)
        kern = sum(e.self_device_time_total for e in p.key_averages()) / 3 / 1e3
        # host side: enqueue time of 20 fwd+bwd (no sync inside) against their wall time
        torch.cuda.synchronize()
        t0 = time.time()
        for _ in range(20):
            fn()[0].backward(do)
        t1 = time.time()
        torch.cuda.synchronize()
        t2 = time.time()
        md(f"- {vname} {shape}: per fwd+bwd: kernels {kern:.3f} ms, host enqueue {(t1 - t0) / 20 * 1e3:.3f} ms, "
           f"wall {(t2 - t0) / 20 * 1e3:.3f} ms")
        emit(part="profile", variant=vname, shape=shape, kernel_ms=kern, enqueue_ms=(t1 - t0) / 20 * 1e3,
             wall_ms=(t2 - t0) / 20 * 1e3)
        md(f"### kernel times, variant {vname}, shape {shape} (3 fwd+bwd)")
        md("```")
        md(tab)
        md("```")
        del xs, do


# ------------------------------------------------------------------------------------ peers

def peer_job(label, shape):
    """Child process: one peers_gpu.py job, its bench wrapped to record the peak memory."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peers_gpu", os.path.join(".peers", "peers_gpu.py"))
    pg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pg)
    orig_bench, orig_emit = pg.bench, pg.emit
    mem = {}

    def bench_mem(fn, grad_of=None):
        r = orig_bench(fn, grad_of)
        if grad_of is not None:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            out.backward(grad_of)
            torch.cuda.synchronize()
            mem["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        return r

    pg.bench = bench_mem
    pg.emit = lambda **kw: orig_emit(**kw, **mem)
    pg.one(label, shape)


def peers_part():
    jobs = [("limits", [])] + [("mlstm_triton_limit_chunk", list(s)) for s in SHAPES] + \
           [("sdpa", list(s)) for s in SHAPES[:3]]
    md("## Peers (.peers/peers_gpu.py jobs, same call)")
    md("")
    for label, shape in jobs:
        if left() < 30:
            md(f"- {label} {shape}: skipped, out of time")
            continue
        t0 = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, "peer-job", label, json.dumps(shape)],
                               timeout=min(120, left() - 10), capture_output=True, text=True)
            if r.returncode:
                md(f"- {label} {shape}: exit {r.returncode} {r.stderr.strip()[-300:]}")
        except subprocess.TimeoutExpired:
            md(f"- {label} {shape}: timeout")
        md(f"- {label} {shape}: {time.time() - t0:.0f}s")
    path = os.path.join(OUT, "anchors.jsonl")
    if os.path.exists(path):
        md("```")
        for line in open(path):
            md(line.strip())
        md("```")
    md("")


# ------------------------------------------------------------------------------------ decode

def decode_part():
    from xlstm_kit.ops.mlstm.naive import mlstm_step_naive
    from xlstm_kit.ops.mlstm.triton_step import mlstm_step_triton

    md("## Decode step (125M preset head shape: H=4, K=V=384; bf16 q,k,v, float32 state)")
    md("")
    md("| impl | B | µs/step (median) | GB/s of state traffic |")
    md("|---|---|---|---|")
    H, K, V = 4, 384, 384
    for B in (1, 32):
        dev = DEV
        q, k = torch.randn(B, H, K, device=dev, dtype=LOWP), torch.randn(B, H, K, device=dev, dtype=LOWP)
        v = torch.randn(B, H, V, device=dev, dtype=LOWP)
        i, f = torch.randn(B, H, device=dev), torch.randn(B, H, device=dev) + 3
        st = (torch.randn(B, H, K, V, device=dev), torch.randn(B, H, K, device=dev), torch.randn(B, H, device=dev))
        state_bytes = 2 * B * H * K * V * 4
        impls = {"ours (triton)": lambda: mlstm_step_triton(q, k, v, i, f, st),
                 "torch naive step": lambda: mlstm_step_naive(q.float(), k.float(), v.float(), i, f, *st, 1e-6)}
        try:
            from mlstm_kernels.torch import get_mlstm_step_kernel
            step = get_mlstm_step_kernel("triton")
            impls["mlstm_kernels triton step"] = lambda: step(q=q, k=k, v=v, i=i[..., None], f=f[..., None], c=st[0],
                                                              n=st[1], m=st[2][..., None])
        except Exception as e:
            md(f"| mlstm_kernels triton step | {B} | unavailable: {type(e).__name__}: {str(e)[:120]} | |")
        for name, fn in impls.items():
            try:
                ms = median_ms(fn, warmup=20)
                md(f"| {name} | {B} | {ms * 1e3:.1f} | {state_bytes / ms / 1e6:.0f} |")
                emit(part="decode", impl=name, B=B, us=ms * 1e3)
            except Exception as e:
                md(f"| {name} | {B} | ERROR {type(e).__name__}: {str(e)[:150]} | |")
    md("")
    # whole model, if the model routes its mLSTM step to the kernel
    try:
        from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

        model = XLSTMLanguageModel(XLSTMConfig.from_name("125m")).cuda().eval()
        for B in (1, 32):
            if left() < 30:
                break
            tok = torch.randint(0, 50257, (B,), device=DEV)
            with torch.no_grad():
                _, state = model.step(tok, None)
                for _ in range(3):
                    _, state = model.step(tok, state)
                torch.cuda.synchronize()
                n = 30
                t0 = time.time()
                for _ in range(n):
                    _, state = model.step(tok, state)
                torch.cuda.synchronize()
                dt = (time.time() - t0) / n
            md(f"- 125M model.step (float32 weights, eager): B={B}: {dt * 1e3:.2f} ms/step, {B / dt:.0f} tokens/s")
            emit(part="decode_model", B=B, ms=dt * 1e3, tok_s=B / dt)
    except Exception as e:
        md(f"- 125M model decode: ERROR {type(e).__name__}: {str(e)[:300]}")
    md("")


DEFAULT_VARIANTS = {  # most important first: the time part skips the tail when out of budget
    # default (2026-11-30, third session): as "seq_loop" below, but where the sequential state
    # kernels are latency-bound (few programs, many chunks) the state passing runs as parallel
    # per-chunk products + an elementwise scan over chunks (seq_scan="auto"); tiles and warps
    # from the sweeps of 2026-11-30 (NOTES-mlstm.md §7)
    "default": {},
    "scan": {"seq_scan": True},                       # the scan path at every shape
    "scan_w4": {"seq_scan": True, "scan_BE": 512, "scan_warps": 4},
    # the default at the start of the session: sequential state kernels (one product per chunk step), fused
    # backward (δq, δk, δv in one program per chunk; K ≤ fb_maxK=128, else the K-tiled
    # kernels), forward states/gates kept for the backward, per-row δh factors in Triton, P v
    # with P as hi + lo, h's rounding residual kept, δS as hi + lo in δq/δk, gate kernels
    "seq_loop": {"seq_scan": False, "ds_warps": 8, "out_BV": 64, "out_warps": 8, "fb_BV": 32, "fb_stages": 2,
                 "ds_stages": 2, "st_stages": 2, "dqk_warps": 8},
    "scan_G16": {"seq_scan": True, "scan_G": 16},     # 16 chunks per scan step
    "loc64": {"seq_scan": True, "loc_BK": 64, "loc_BV": 64},  # smaller local-term tiles
    "fbs2": {"fb_stages": 2},
    "fbw4": {"fb_warps": 4},
    "dqkw8": {"dqk_warps": 8},
    "scan_G8": {"scan_G": 8},
    # the default after the first two sweeps of 2026-11-30 (NOTES-mlstm.md §7)
    "sweep2_default": {"fb_stages": 2, "ds_stages": 2, "st_stages": 2, "dqk_warps": 8},
    "default_nods": {"ds_split": False},              # without the δS split (2 fewer products)
    # an older best (fused64_all: no splits; the prologue/epilogue kernels are in any case)
    "fused64_prev": {"p_split": False, "h_lo": False, "ds_split": False, "seq_scan": False},
    # the default of the first session: old backward kernels, row factors in PyTorch, no splits
    "prev_default": {"bwd_fused": False, "keep_states": False, "rows_kernel": False, "p_split": False,
                     "h_lo": False, "ds_split": False, "seq_scan": False},
    "old_all": {"bwd_fused": False},                  # old backward + the new glue and splits
    "fused32_all": {"fb_maxK": 256, "L_fwd": 32, "L_bwd": 32},  # fused spill-free at K=128
    # sequential state kernels on 8 warps with 32×32 tiles when the grid is small (few heads)
    "fused64_all_seq": {"st_warps": 8, "seq_min_programs": 264, "seq_scan": False},
    "fused64w16_all": {"fb_warps": 16},
}


def pick_variants(env: str | None, fallback: dict) -> dict:
    """$VARIANTS / $CHECK_VARIANTS: a JSON object (name -> config overrides) or a comma list of
    names from DEFAULT_VARIANTS."""
    if not env:
        return fallback
    if env.lstrip().startswith("{"):
        return json.loads(env)
    return {n: DEFAULT_VARIANTS[n] for n in env.split(",")}


def summary_part():
    """One table: fwd+bwd ms of every variant at every shape against limit_chunk and SDPA."""
    rows = [json.loads(x) for x in open(os.path.join(OUT, "mlstm.jsonl"))] if os.path.exists(os.path.join(OUT, "mlstm.jsonl")) else []
    peers = [json.loads(x) for x in open(os.path.join(OUT, "anchors.jsonl"))] if os.path.exists(os.path.join(OUT, "anchors.jsonl")) else []

    def peer(name, shape):
        for p in peers:
            if p.get("name") == name and [p.get(k) for k in "B T H K V".split()] == list(shape):
                return p.get("fwbw_ms")
        return None

    times = {}
    for r in rows:
        if r.get("part") == "time" and "fwbw_ms" in r:
            times[(r["variant"], tuple(r["shape"]))] = (r["fwd_ms"], r["fwbw_ms"], r.get("peak_mib"))
    variants = list(dict.fromkeys(v for v, _ in times))
    md("## Summary: fwd+bwd ms (fwd ms) [× limit_chunk]")
    md("")
    md("| variant | " + " | ".join(",".join(map(str, s)) for s in SHAPES) + " |")
    md("|---|" + "---|" * len(SHAPES))
    for name in ("mlstm_triton_limit_chunk", "sdpa_causal"):
        md(f"| {name} | " + " | ".join(f"{peer(name, s):.3f}" if peer(name, s) else "-" for s in SHAPES) + " |")
    for v in variants:
        cells = []
        for s in SHAPES:
            t = times.get((v, tuple(s)))
            lc = peer("mlstm_triton_limit_chunk", s)
            cells.append("-" if t is None else f"{t[1]:.3f} ({t[0]:.3f})" + (f" [{t[1] / lc:.2f}×]" if lc else ""))
        md(f"| {v} | " + " | ".join(cells) + " |")
    md("")

if __name__ == "__main__":
    if sys.argv[1:2] == ["peer-job"]:
        peer_job(sys.argv[2], json.loads(sys.argv[3]))
        sys.exit(0)
    import triton

    parts = sys.argv[1:] or ["check", "time", "peers", "decode"]
    variants = pick_variants(os.environ.get("VARIANTS"), DEFAULT_VARIANTS)
    check_variants = pick_variants(os.environ.get("CHECK_VARIANTS"), variants)
    gpu = "CPU (dry run)" if DRY else torch.cuda.get_device_name()
    md(f"# mLSTM kernels on {gpu} — torch {torch.__version__}, triton {triton.__version__}, "
       f"{time.strftime('%Y-%m-%d')}")
    md("")
    emit(part="env", gpu=gpu, torch=torch.__version__, triton=triton.__version__)
    for part in parts:
        t0 = time.time()
        try:
            if part == "check":
                check_part(check_variants)
            elif part == "time":
                time_part(variants)
            elif part == "profile":
                profile_part(variants)
            elif part == "peers":
                peers_part()
            elif part == "decode":
                decode_part()
            elif part == "summary":
                summary_part()
        except Exception as e:
            import traceback

            md(f"PART {part} FAILED: {type(e).__name__}: {e}")
            md("```")
            md(traceback.format_exc()[-3000:])
            md("```")
        md(f"_part {part}: {time.time() - t0:.0f}s, total {time.time() - T0:.0f}s_")
