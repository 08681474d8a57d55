"""sLSTM kernels with split heads on one GPU: correctness against float64, then timings.

    python3 benchmarks/gpu_slstm_split.py PLAN [OLD_PYTHONPATH]

PLAN: `variants` (kernel variants at the 125M shape and D = 128), `stack` (the forward's
gates as one stacked operand against four), `stack32` (the same, float32 R), `partials` (the
backward's exchange by partial sums of δh against δg̃), `compare` (old vs new
default at the issue's shapes). Checks (float64 reference, NaN) come first; each group of
checks and timings runs in a child process under `timeout` (a barrier that never opens must
not eat the call); results go to $OUT/slstm-split.jsonl, one line each on stdout.
OLD_PYTHONPATH: a checkout of the previous kernels (`git archive <commit> xlstm_kit`), timed
as "old". Timings: triton.testing.do_bench medians, bf16 x_gates, r, b requiring grad, zero
initial state; fwd = the training forward (saves for the backward), fwd+bwd adds
h.backward(dh) (δx, δR, δb).
"""
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", ".")
JOB_S = int(os.environ.get("JOB_S", "45"))


def job(spec):
    import torch
    import triton
    from xlstm_kit.ops.slstm import triton as ts
    from xlstm_kit.ops.slstm.naive import slstm_recurrent_naive

    B, T, H, D = spec["shape"]
    cfg = None if spec.get("cfg") is None else ts.SLSTMKernelConfig(**spec["cfg"])
    dt = getattr(torch, spec.get("dtype", "bfloat16"))
    dev = "cuda"
    torch.manual_seed(spec.get("seed", 0))
    x = (torch.randn(B, T, 4, H, D, device=dev)).to(dt)
    # r_dtype float32: a model's float32 weights under bf16 autocast (split hi + lo, MM 2)
    r = (torch.randn(4, H, D, D, device=dev) / D ** 0.5).to(getattr(torch, spec.get("r_dtype", str(dt)[6:])))
    b = (torch.randn(4, H, D, device=dev) * 0.1).to(dt)
    res = dict(spec)

    def fn(x, r, b, init=None):
        return ts.slstm_recurrent_triton(x, r, b, initial_state=init, output_final_state=True,
                                         config=cfg)

    if spec["kind"] == "check":
        init = [torch.rand(B, H, D, device=dev) * 2 - 1, torch.randn(B, H, D, device=dev),
                torch.rand(B, H, D, device=dev) + 0.5, torch.randn(B, H, D, device=dev)]
        ups = [torch.randn(B, T, H, D, device=dev, dtype=torch.float64)]
        ups += [torch.randn(B, H, D, device=dev, dtype=torch.float64) for _ in range(4)]

        def run(f, cast):
            leaves = [cast(t).detach().requires_grad_(True) for t in (x, r, b, *init)]
            h, st = f(leaves[0], leaves[1], leaves[2], tuple(leaves[3:]))
            outs = [h, *st]
            sum((o.double() * u).sum() for o, u in zip(outs, ups)).backward()
            return [o.detach() for o in outs] + [t.grad for t in leaves]

        def naive(x, r, b, init):
            return slstm_recurrent_naive(x, r, b, initial_state=init, output_final_state=True)

        ref = run(naive, lambda t: t.double())
        got = run(fn, lambda t: t)
        loop = run(naive, lambda t: t)  # the PyTorch loop in the same dtype
        names = "h h_T c_T n_T m_T dx dr db dh0 dc0 dn0 dm0".split()

        def rel(a, bb):
            return ((a.double() - bb).norm() / bb.norm().clamp_min(1e-30)).item()

        res["nan"] = any(not torch.isfinite(g).all().item() for g in got)
        res["err"] = {n: rel(g, rr) for n, g, rr in zip(names, got, ref)}
        res["loop_err"] = {n: rel(g, rr) for n, g, rr in zip(names, loop, ref)}
        res["max_err"] = max(res["err"].values())
        res["ok"] = (not res["nan"]) and all(
            res["err"][n] <= 2 * res["loop_err"][n] + 2e-6 for n in names)
        return res

    leaves = [t.detach().requires_grad_(True) for t in (x, r, b)]
    dh = torch.randn(B, T, H, D, device=dev, dtype=dt)

    def fwd():
        return fn(*leaves)[0]

    def fwd_bwd():
        fwd().backward(dh)

    rep = spec.get("rep", 100)
    res["fwd_ms"] = triton.testing.do_bench(fwd, warmup=25, rep=rep, return_mode="median")
    res["fwd_bwd_ms"] = triton.testing.do_bench(fwd_bwd, warmup=25, rep=rep, grad_to_none=leaves,
                                                return_mode="median")
    return res


def spawn(specs, pythonpath, limit):
    """Run specs one after another in one child process (one import, one compile cache) under
    `timeout limit`; every finished spec's line is kept even when the child is killed."""
    env = dict(os.environ, PYTHONPATH=pythonpath)
    p = subprocess.run(["timeout", str(limit), sys.executable, __file__, "job", json.dumps(specs)],
                       env=env, capture_output=True, text=True)
    done = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0:
        done.append(dict(specs[len(done)] if len(done) < len(specs) else {}, failed=p.returncode,
                         stderr=p.stderr[-1500:]))
    for res in done:
        with open(os.path.join(OUT, "slstm-split.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
        brief = {k: res.get(k) for k in ("kind", "code", "shape", "cfg", "dtype", "r_dtype", "fwd_ms",
                                           "fwd_bwd_ms", "max_err", "ok", "nan", "failed", "wall_s")
                 if res.get(k) is not None}
        print(json.dumps(brief), flush=True)
        if "stderr" in res:
            print(res["stderr"][-800:], flush=True)


def cfg(bu, warps=4, prefetch=True, resident=True, stack=False, partials=False):
    return dict(num_warps=warps, r_resident=resident, prefetch=prefetch, block_u=bu, stack_gates=stack,
                bwd_partials=partials)


SHAPES = [(16, 2048, 4, 192), (16, 1024, 4, 128), (16, 2048, 4, 256), (8, 2048, 4, 384),
          (64, 2048, 4, 192)]


def plan(name):
    """(code, specs, time limit) per child process."""
    if name == "variants":  # the first call (block_u 64 / 32 / 16, warps)
        s192, s128 = (16, 2048, 4, 192), (16, 1024, 4, 128)
        specs = [dict(kind="check", shape=(16, 64, 4, 192), cfg=None),
                 dict(kind="check", shape=(16, 64, 4, 192), cfg=None, dtype="float32"),
                 dict(kind="check", shape=(16, 64, 4, 128), cfg=cfg(64))]
        specs += [dict(kind="time", shape=s192, cfg=c) for c in (cfg(64), cfg(64, 8), cfg(32), cfg(16))]
        specs += [dict(kind="time", shape=s128, cfg=c) for c in (None, cfg(64), cfg(32))]
        yield "new", specs, 180
    elif name == "stack":  # the forward's four gates as one stacked operand (M = 4·BU) or four
        specs = [dict(kind="check", shape=(16, 48, 4, 192), cfg=cfg(16, stack=True), seed=1),
                 dict(kind="check", shape=(8, 48, 4, 384), cfg=cfg(32, stack=True), seed=2),
                 dict(kind="check", shape=(16, 48, 4, 128), cfg=cfg(16, stack=True), seed=3),
                 dict(kind="check", shape=(16, 48, 4, 128), cfg=dict(num_warps=8, r_resident=True, prefetch=False,
                                                                     stack_gates=True), seed=4)]
        for shape, bu in (((16, 2048, 4, 192), 16), ((16, 1024, 4, 128), 16), ((64, 2048, 4, 192), 32)):
            specs += [dict(kind="time", shape=shape, cfg=cfg(bu, stack=st)) for st in (False, True)]
        yield "new", specs, 200
    elif name == "stack32":  # the same with float32 R (a model's weights under autocast)
        specs = [dict(kind="check", shape=(16, 48, 4, 192), cfg=cfg(16, stack=True), r_dtype="float32", seed=1),
                 dict(kind="check", shape=(8, 48, 4, 384), cfg=cfg(32, stack=True), r_dtype="float32", seed=2)]
        for shape, bu in (((16, 2048, 4, 192), 16), ((64, 2048, 4, 192), 32)):
            specs += [dict(kind="time", shape=shape, cfg=cfg(bu, stack=st), r_dtype="float32")
                      for st in (False, True)]
        yield "new", specs, 200
    elif name == "partials":  # the backward's exchange by partial sums of δh against δg̃
        specs = [dict(kind="check", shape=(16, 48, 4, 192), cfg=cfg(16, stack=True, partials=True), seed=1),
                 dict(kind="check", shape=(16, 48, 4, 192), cfg=cfg(16, stack=True, partials=True),
                      r_dtype="float32", seed=2),
                 dict(kind="check", shape=(64, 32, 4, 192), cfg=cfg(32, stack=True, partials=True), seed=3),
                 dict(kind="check", shape=(5, 40, 2, 48), cfg=cfg(16, stack=True, partials=True), seed=4),
                 dict(kind="check", shape=(8, 48, 4, 384), cfg=cfg(16, stack=True, partials=True), seed=5)]
        for shape, bu in (((16, 2048, 4, 192), 16), ((16, 1024, 4, 128), 16), ((64, 2048, 4, 192), 32),
                          ((4, 2048, 4, 192), 16)):
            specs += [dict(kind="time", shape=shape, cfg=cfg(bu, stack=True, partials=pa)) for pa in (False, True)]
        specs += [dict(kind="time", shape=(16, 2048, 4, 192), cfg=cfg(16, stack=True, partials=pa),
                       r_dtype="float32") for pa in (False, True)]
        specs += [dict(kind="time", shape=(16, 2048, 4, 192), cfg=cfg(bu, stack=True, partials=True))
                  for bu in (32, 64)]
        yield "new", specs, 240
    elif name == "compare":  # old vs new default at the shapes
        specs = [dict(kind="check", shape=(16, 48, 4, 192), cfg=None, seed=1),
                 dict(kind="check", shape=(8, 48, 4, 384), cfg=None, seed=2),
                 dict(kind="check", shape=(64, 32, 4, 192), cfg=None, seed=3)]
        specs += [dict(kind="time", shape=s, cfg=None) for s in SHAPES]
        specs += [dict(kind="time", shape=(16, 2048, 4, 192), cfg=cfg(16, 1)),
                  dict(kind="time", shape=(16, 2048, 4, 192), cfg=cfg(16, 2)),
                  dict(kind="time", shape=(16, 1024, 4, 128), cfg=cfg(16, 1)),
                  dict(kind="time", shape=(16, 1024, 4, 128), cfg=cfg(32))]
        yield "new", specs, 62
        yield "old", [dict(kind="time", shape=s, cfg=None, rep=40) for s in SHAPES], 36


if __name__ == "__main__":
    if sys.argv[1] == "job":
        for spec in json.loads(sys.argv[2]):
            t0 = time.time()
            res = job(spec)
            res["wall_s"] = round(time.time() - t0, 1)
            print(json.dumps(res), flush=True)
    else:
        here = os.environ.get("PYTHONPATH", ".")
        old = sys.argv[2] if len(sys.argv) > 2 else None
        for code, specs, limit in plan(sys.argv[1]):
            if code == "old" and old is None:
                continue
            spawn([dict(s, code=code) for s in specs], old if code == "old" else here, limit)
