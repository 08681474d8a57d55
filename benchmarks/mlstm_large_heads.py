"""Chunkwise mLSTM Triton kernels at the paper models' head sizes (K = V = 384, 512) on one GPU:
correctness against the float64 torch path, fwd and fwd+bwd time (median, do_bench) and a
per-kernel profile of configuration variants, and mlstm_kernels' `chunkwise--triton_limit_chunk`
at the same shapes (child process, wheel installed under /tmp/site).

    python3 benchmarks/mlstm_large_heads.py sweep    # tile / chunk variants
    python3 benchmarks/mlstm_large_heads.py final    # main's config vs the tuned default

Every variant is first compiled and checked in parallel worker processes (same
specializations as the timed shape: B = 1, same T, H, K, V), then timed one after another in
one process. Writes $OUT/rows.jsonl and prints a table last.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", ".")
SITE = "/tmp/site"
SHAPES = {384: (16, 2048, 4, 384, 384), 512: (8, 2048, 4, 512, 512), 128: (8, 2048, 16, 128, 128),
          256: (8, 2048, 8, 256, 512)}
DRY = os.environ.get("DRY") == "1"  # smoke test on CPU under TRITON_INTERPRET=1 at tiny shapes
DEV = "cpu" if DRY else "cuda"
if DRY:
    SHAPES = {K: (1, 40, 2, 48, 48) for K in SHAPES}


def old_fields(K):
    """main's MLSTMKernelConfig.tuned(K, K, bfloat16, 64) of the earlier, smaller tiles."""
    return dict(chunk=64, states_bk=min(64, K), states_bv=min(64, K), states_warps=4, states_stages=3,
                out_bk=min(128 if K <= 128 else 64, K), out_bv=min(128, K), out_warps=4, out_stages=2,
                dstates_bk=64, dstates_bv=64, dstates_warps=4, dstates_stages=3,
                fused_max_k=128, fused_bv=64 if K <= 128 else 16, fused_warps=8, fused_stages=3,
                dqk_bk=64, dqk_bv=32, dqk_warps=4, dqk_stages=1, dv_bk=64, dv_bv=128, dv_warps=8, dv_stages=2)


def tiles(prefix, bk, bv, w, s):
    return {f"{prefix}_bk": bk, f"{prefix}_bv": bv, f"{prefix}_warps": w, f"{prefix}_stages": s}


def opt(st, out, dqk, dv, chunk=64, **kw):
    d = dict(chunk=chunk, **tiles("states", *st), **tiles("dstates", *st), **tiles("out", *out),
             **tiles("dqk", *dqk), **tiles("dv", *dv))
    d.update(kw)
    return d


# variant name -> fields over old_fields(K) (None: the library's tuned default via the public API)
SWEEP = {
    "old": {},
    "a64": opt((64, 64, 8, 3), (64, 128, 8, 2), (128, 32, 8, 1), (128, 128, 8, 2)),
    "b64": opt((64, 128, 8, 3), (128, 128, 8, 2), (64, 32, 8, 2), (64, 64, 4, 2)),
    "c64": opt((128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2)),
    "d64": opt((64, 128, 4, 3), (128, 64, 4, 2), (128, 32, 8, 2), (64, 128, 8, 2)),
    "a128": opt((64, 128, 8, 3), (64, 128, 8, 2), (64, 32, 8, 2), (64, 128, 8, 2), chunk=128),
    "b128": opt((64, 64, 8, 3), (64, 64, 8, 2), (64, 32, 8, 1), (64, 64, 4, 2), chunk=128),
    "c128": opt((64, 128, 8, 2), (128, 64, 8, 2), (64, 64, 8, 2), (128, 64, 8, 2), chunk=128),
    "a64r": opt((64, 64, 8, 3), (64, 128, 8, 2), (128, 32, 8, 1), (128, 128, 8, 2), recompute_states=True),
}
SWEEP_PLAN = [(384, n) for n in SWEEP] + [(512, n) for n in SWEEP if n != "a64r"] + [(128, "old")]
FINAL = {"old": {}, "new": None, "new_recompute": "recompute"}
FINAL_PLAN = [(K, n) for K in (384, 512, 128, 256) for n in FINAL]


def config_of(K, name, table):
    import torch
    from xlstm_kit.ops.mlstm.triton import MLSTMKernelConfig

    fields = table[name]
    if fields is None:
        return None
    if fields == "recompute":
        return MLSTMKernelConfig.tuned(K, SHAPES[K][4], torch.bfloat16).replace(recompute_states=True)
    base = MLSTMKernelConfig(**old_fields(K))
    return base.replace(**fields)


def inputs(B, T, H, K, V, seed, grad=True):
    import torch

    g = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=DEV, generator=g)
    lp = torch.float16 if DRY else torch.bfloat16  # the interpreter computes bfloat16 wrongly
    q, k, v = (r(B, T, H, d).to(lp) for d in (K, K, V))
    i = r(B, T, H)
    f = r(B, T, H) + 3.0
    xs = [x.requires_grad_(grad) for x in (q, k, v, i, f)]
    dh = r(B, T, H, V).to(lp)
    return xs, dh


def call(xs, cfg):
    from xlstm_kit.ops.mlstm import mlstm_chunkwise
    from xlstm_kit.ops.mlstm.triton import mlstm_chunkwise_triton

    if cfg is None:
        return mlstm_chunkwise(*xs, backend="triton")[0]
    return mlstm_chunkwise_triton(*xs, config=cfg)[0]


def worker(K, name, table):
    """Compile this variant at the timed shape's specializations and check it (B = 1) against
    the float64 torch path: rel. errors of h and every input gradient, NaN check."""
    import torch
    from xlstm_kit.ops.mlstm import mlstm_chunkwise

    _, T, H, Kx, V = SHAPES[K]
    cfg = config_of(K, name, table)
    errs = {}
    for seed in (1, 2):
        xs, dh = inputs(1, T, H, Kx, V, seed)
        t0 = time.time()
        h = call(xs, cfg)
        grads = torch.autograd.grad(h, xs, dh)
        if not DRY:
            torch.cuda.synchronize()
        comp = time.time() - t0
        rx = [x.detach().double().requires_grad_(True) for x in xs]
        rh = mlstm_chunkwise(*rx, backend="torch", chunk_size=64)[0]
        rg = torch.autograd.grad(rh, rx, dh.double())
        for nm, a, b in zip(["h", "dq", "dk", "dv", "di", "df"], [h, *grads], [rh, *rg]):
            e = ((a.double() - b).norm() / b.norm()).item() if torch.isfinite(a).all() else float("nan")
            errs[nm] = max(errs.get(nm, 0.0), e)
    return dict(kind="check", K=K, variant=name, compile_s=round(comp, 1), **errs)


def timing(plan, table):
    import torch
    import triton
    from torch.profiler import ProfilerActivity, profile

    rows = []
    cache = {}
    for K, name in plan:
        B, T, H, Kx, V = SHAPES[K]
        if K not in cache:
            cache.clear()
            if not DRY:
                torch.cuda.empty_cache()
            cache[K] = inputs(B, T, H, Kx, V, 0)
        xs, dh = cache[K]
        cfg = config_of(K, name, table)
        fwd = lambda: call(xs, cfg)

        def fb():
            call(xs, cfg).backward(dh)

        try:
            fb()
        except Exception as e:  # e.g. a tile set over the shared-memory limit: the next variant
            rows.append(dict(kind="error", K=K, variant=name, error=str(e)[:300]))
            print(json.dumps(rows[-1]), flush=True)
            continue
        if DRY:
            rows.append(dict(kind="time", K=K, shape=[B, T, H, Kx, V], variant=name, fwd_ms=0, fwbw_ms=0))
            continue
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        h = call(xs, cfg)  # memory kept for the backward by one forward
        kept = torch.cuda.memory_allocated() - base
        del h
        f_ms = triton.testing.do_bench(fwd, warmup=25, rep=150, return_mode="median")
        fb_ms = triton.testing.do_bench(fb, warmup=25, rep=200, return_mode="median", grad_to_none=xs)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fb()
            torch.cuda.synchronize()
        per = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0 and (e.key.startswith("_") or "triton" in e.key):
                per[e.key[:24]] = round(t / 3 / 1e3, 3)
        row = dict(kind="time", K=K, shape=[B, T, H, K, V], variant=name,
                   chunk=cfg.chunk if cfg is not None else None,
                   fwd_ms=round(f_ms, 3), fwbw_ms=round(fb_ms, 3), saved_gib=round(kept / 2**30, 2),
                   kernels=dict(sorted(per.items(), key=lambda kv: -kv[1])))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def official(shapes, time_it):
    """mlstm_kernels chunkwise--triton_limit_chunk (bf16, [B,H,T,D] layout), as peers_gpu.py."""
    import torch
    import triton

    if DRY:
        return []
    sys.path.insert(0, SITE)
    from mlstm_kernels.torch import get_mlstm_kernel

    fn_k = get_mlstm_kernel("chunkwise--triton_limit_chunk")
    rows = []
    for B, T, H, K, V in shapes:
        torch.manual_seed(0)
        r = lambda *s, sc=1.0: (torch.randn(*s, device=DEV) * sc).to(torch.bfloat16).requires_grad_(True)
        q, k, v = r(B, H, T, K), r(B, H, T, K), r(B, H, T, V)
        i = r(B, H, T)
        f_ = (torch.randn(B, H, T, device=DEV) + 3.0).to(torch.bfloat16).requires_grad_(True)
        do = torch.randn(B, H, T, V, device=DEV, dtype=torch.bfloat16)
        fn = lambda: fn_k(q=q, k=k, v=v, i=i, f=f_)

        def fb():
            fn().backward(do)

        if not time_it:
            fb()
            torch.cuda.synchronize()
            continue
        fwd = triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
        fwbw = triton.testing.do_bench(fb, warmup=25, rep=200, return_mode="median", grad_to_none=[q, k, v, i, f_])
        row = dict(kind="time", K=K, shape=[B, T, H, K, V], variant="limit_chunk", fwd_ms=round(fwd, 3),
                   fwbw_ms=round(fwbw, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def child(args, timeout):
    """Run this script with args in a child process; its last stdout line is JSON."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s", "args": args}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{") or ln.startswith("[")]
    if p.returncode or not lines:
        return {"error": (p.stderr or p.stdout)[-800:], "args": args}
    return json.loads(lines[-1])


def main(which, budget_s):
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    plan = SWEEP_PLAN if which == "sweep" else FINAL_PLAN
    shapes = [SHAPES[K] for K in (384, 512, 128)]
    jobs = [["work", which, str(K), n] for K, n in plan] + [["official", "warm"]]
    with ThreadPoolExecutor(max_workers=14) as ex:
        checks = list(ex.map(lambda a: child(a, max(30, budget_s * 0.45)), jobs))
    print(f"# compile+check phase {time.time() - t0:.0f}s", flush=True)
    rows = [c for c in checks if c]
    left = budget_s - (time.time() - t0)
    for args, share, need in ((["time", which], 0.7, 20), (["official", "time"], 1.0, 15)):
        left = budget_s - (time.time() - t0)
        got = child(args, max(10, left * share - 5)) if left > need else {"error": f"no time for {args}"}
        rows += got if isinstance(got, list) else [got]
    with open(os.path.join(OUT, f"rows-{which}.jsonl"), "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    print(f"# total {time.time() - t0:.0f}s")
    for r in rows:
        if isinstance(r, dict) and r.get("kind") == "check":
            print("check", r["K"], r["variant"], r.get("compile_s"),
                  " ".join(f"{k}={r[k]:.2e}" for k in ("h", "dq", "dk", "dv", "di", "df")))
        elif isinstance(r, dict) and r.get("kind") == "time":
            top = " ".join(f"{k.strip('_')[:12]}={v}" for k, v in list(r.get("kernels", {}).items())[:7])
            print("time", r["shape"], r["variant"], r["fwd_ms"], r["fwbw_ms"], r.get("saved_gib"), top)
        else:
            print("other", json.dumps(r)[:600])


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "work":
        table = SWEEP if sys.argv[2] == "sweep" else FINAL
        print(json.dumps(worker(int(sys.argv[3]), sys.argv[4], table)))
    elif cmd == "time":
        table, plan = (SWEEP, SWEEP_PLAN) if sys.argv[2] == "sweep" else (FINAL, FINAL_PLAN)
        print(json.dumps(timing(plan, table)))
    elif cmd == "official":
        print(json.dumps(official([SHAPES[K] for K in (384, 512, 128, 256)], sys.argv[2] == "time")))
    else:
        main(cmd, float(os.environ.get("BUDGET_S", "160")))
