"""DPLR / KDA kernels on the GPU: where the forward + backward time goes, and a
one-field-at-a-time sweep of `DPLRKernelConfig` around its defaults, in one device call.

    PYTHONPATH=. python benchmarks/dplr_tune.py --out $OUT [--quick] [--limit-s 540]
    (no GPU: TRITON_INTERPRET=1 ... --quick, a smoke run in float32)

For dplr_chunkwise and kda_chunkwise at (8, 2048, 16, 128, 128), bf16 activations with bf16 and
with float32 gates (the inputs of `xlstm-kit bench`, `xlstm_kit.bench.registry`):
1. the kernels of one forward + backward with the default config (torch.profiler), each one's
   share of the GPU time;
2. fwd+bwd ms of the default and of each variant that changes one field (each checked against
   the default's o and input gradients: a variant with another result is reported, not timed).
3. (KDA, float32 and bf16 gates) the error budget: relative errors of o, every input gradient
   and the final state against the float64 PyTorch path for ours, the PyTorch path in bf16 (the 2x rule's yardstick)
   and, with --fla (fla importable), fla's chunk_kda on the same inputs: how much precision the
   products of a faster design may give up ("bf16 products where the budget allows").
4. (--probe-prec, instead of 1-3) how far the precision lever goes, KDA with bf16 gates: fwd+bwd ms and
   the error table of the default, of every float32-accurate product (the state path: pairs,
   WY, both state kernels) as single-pass TF32 instead of 3-pass, and of that with the "bf16"
   low-precision groups; a probe (the launch tuple patched), not a configuration.
Rows are written to $OUT/dplr_tune.jsonl as they are measured (a run cut short keeps them);
$OUT/dplr_tune.md has the tables. With --fla, each case also profiles and times fla's
counterpart (chunk_kda, chunk_dplr_delta_rule) on the same inputs, right after our default;
its first compile takes minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import triton.testing

import xlstm_kit.ops as ops
from xlstm_kit.bench.registry import Env, dplr_inputs, kda_inputs
from xlstm_kit.ops.dplr.triton.config import DPLRKernelConfig

SHAPE = dict(B=8, T=2048, H=16, K=128, V=128)
QUICK = dict(B=1, T=256, H=2, K=64, V=64)
# without a GPU: a smoke run of the script under TRITON_INTERPRET=1 (float32, wall-clock times)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = [  # ptxas spills in docs/kernels.md ("DPLR and KDA"); one field away from the defaults
    # (an earlier sweep made state_block_v 32, wy_warps, dv_warps and dk_warps 4 the defaults)
    dict(state_block_v=64), dict(state_block_v=16), dict(state_warps=8),
    dict(dk_block_k=16), dict(dk_block_k=64), dict(dk_warps=8), dict(bwd_block_v=64),
    dict(dv_block_k=32), dict(dv_warps=8), dict(wy_warps=8), dict(wy_block_k=64), dict(wy_block_v=64),
    dict(pairs_block_k=64), dict(pairs_warps=8),
]


def run(op: str, f32_gates: bool, shape: dict, config: DPLRKernelConfig | None):
    """-> (fwd+bwd callable, outputs of one call: o and every input gradient)."""
    env = Env(device=torch.device(DEV), dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, backend="triton")
    xs, do = (dplr_inputs if op == "dplr_chunkwise" else kda_inputs)(shape, env, f32_gates)
    fn = getattr(ops, op)

    def step():
        for x in xs:
            x.grad = None
        o, _ = fn(*xs, backend="triton", config=config)
        o.backward(do)
        return o

    o = step()
    return step, [o.detach().float()] + [x.grad.float() for x in xs]


def bench(fn) -> float:
    if DEV == "cuda":
        return triton.testing.do_bench(fn, rep=200)
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def profile(step) -> list:
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    cuda = DEV == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    step()
    sync()
    with prof_ctx(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as p:
        step()
        sync()
    attr = "device_time_total" if cuda else "cpu_time_total"
    rows = [(e.key, e.count, getattr(e, attr) / 1e3) for e in p.key_averages() if getattr(e, attr) > 0]
    total = sum(r[2] for r in rows) or 1.0
    return [[k[:80], n, round(ms, 3), round(100 * ms / total, 1)] for k, n, ms in sorted(rows, key=lambda r: -r[2])]


def accuracy(shape: dict, f32_gates: bool, use_fla: bool) -> dict:
    """{name: [rel err of o, dq, dk, dv, dg, dbeta, final state]} against the float64 PyTorch
    path (KDA); the final state's yardstick is float32 (design study, docs/kernels.md)."""
    env = Env(device=torch.device(DEV), dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, backend="triton")
    xs, do = kda_inputs(shape, env, f32_gates)
    x64 = [x.detach().double().requires_grad_() for x in xs]
    o64, s64 = ops.kda_chunkwise(*x64, backend="torch", output_final_state=True)
    o64.backward(do.double())
    want = [o64.detach()] + [x.grad for x in x64] + [s64.detach()]
    fns = {"ours": lambda *a: ops.kda_chunkwise(*a, backend="triton", output_final_state=True),
           "torch (bf16 inputs)": lambda *a: ops.kda_chunkwise(*a, backend="torch", output_final_state=True)}
    if use_fla:
        from fla.ops.kda import chunk_kda

        fns["fla chunk_kda"] = lambda *a: chunk_kda(*a, output_final_state=True)
    out = {}
    for name, fn in fns.items():
        for x in xs:
            x.grad = None
        o, sT = fn(*xs)
        o.backward(do)
        got = [o.detach()] + [x.grad for x in xs] + [sT.detach()]
        out[name] = [rel(g.double(), w) for g, w in zip(got, want)]
    return out


PROBES = {"default": {}, "state path 1-pass TF32": dict(prec="tf32"),
          "state path 1-pass TF32, low groups bf16": dict(prec="tf32", lo_o=2, lo_qk=2, lo_dv=2, lo_gc=2, lo_dk=2)}


def probe_prec(out: str, shape: dict, f32_gates: bool) -> list[dict]:
    """Section 4 of the docstring: [{probe, ms, errors: {o, dq, ...}, torch_errors}], the Launch
    tuple that kda_op resolves patched per probe."""
    import xlstm_kit.ops.dplr.triton.kda_op as kda_op

    names = ["o", "dq", "dk", "dv", "dg", "dbeta"]
    orig = kda_op.resolve
    rows = []
    try:
        for name, patch in PROBES.items():
            kda_op.resolve = (lambda *a, p=patch: orig(*a)._replace(**p)) if patch else orig
            row = dict(op="kda_chunkwise", f32_gates=f32_gates, kind="probe", probe=name)
            try:
                step, _ = run("kda_chunkwise", f32_gates, shape, None)
                row["ms"] = bench(step)
                errs = accuracy(dict(shape, B=min(shape["B"], 2)), f32_gates, False)
                row["errors"] = dict(zip(names, errs["ours"]))
                row["torch_errors"] = dict(zip(names, errs["torch (bf16 inputs)"]))
            except Exception as e:  # noqa: BLE001 - reported in the row
                row["why"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            with open(os.path.join(out, "dplr_tune.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row)[:300], flush=True)
    finally:
        kda_op.resolve = orig
    return rows


def render_probe(rows: list[dict]) -> str:
    out = []
    for f32 in (False, True):
        mine = [r for r in rows if r["f32_gates"] == f32]
        if not mine:
            continue
        out += [f"## KDA, {'float32' if f32 else 'bf16'} gates: precision probe", "",
                "| probe | ms | o | dq | dk | dv | dg | dbeta | worst ÷ torch bf16 |", "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            if "errors" not in r:
                out.append(f"| {r['probe']} | {r.get('ms', '—')} | {r.get('why', '')} | | | | | | |")
                continue
            e, t = r["errors"], r["torch_errors"]
            worst = max(e[k] / max(t[k], 1e-30) for k in e)
            out.append(f"| {r['probe']} | {r['ms']:.3f} | " + " | ".join(f"{e[k]:.2e}" for k in e) + f" | {worst:.2f} |")
        t = mine[0].get("torch_errors")
        if t:
            out.append("| torch, bf16 inputs (the 2x rule's yardstick) | | " + " | ".join(f"{t[k]:.2e}" for k in t) + " | 1.00 |")
        out.append("")
    return "\n".join(out) + "\n"


FAULT = 3   # a child's exit code after a CUDA fault: the context is lost, the parent starts a new child


def _faulted(e: Exception) -> bool:
    return "illegal memory access" in str(e) or "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError"


def fla_rows(op: str, f32: bool, shape: dict) -> list[dict]:
    """fla's counterpart of `op` on the same inputs (`xlstm_kit.bench.peers`): its kernels of one
    forward + backward (torch.profiler, as `profile`) and its fwd+bwd ms, so that every kernel
    of ours has a target measured in the same call. The first call compiles (minutes)."""
    from xlstm_kit.bench import peers, registry

    env = Env(device=torch.device(DEV), dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, backend="triton")
    build = peers._fla_kda if op == "kda_chunkwise" else peers._fla_dplr
    timed = build(op + (registry.F32_GATES if f32 else ""), shape, env)
    t1 = time.time()
    timed.fwbw()
    if DEV == "cuda":
        torch.cuda.synchronize()
    first_s = round(time.time() - t1, 1)
    return [dict(kind="profile", who="fla", kernels=profile(timed.fwbw)),
            dict(kind="time", config="fla", ms=bench(timed.fwbw), compile_s=first_s)]


def warm_fla(out: str, cases: str, shape: dict) -> int:
    """fla's first forward + backward of each case, one process per case (compilation is
    CPU-bound; the autotuner benchmarks again in the timed process); seconds per case printed."""
    if "," in cases:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--out", out, "--warm-fla",
                                   "--cases", c, "--shape", ",".join(str(shape[x]) for x in "BTHKV")])
                 for c in cases.split(",")]
        return max(p.wait() for p in procs)
    from xlstm_kit.bench import peers, registry

    op = cases.split("-")[0] + "_chunkwise"
    env = Env(device=torch.device(DEV), dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, backend="triton")
    build = peers._fla_kda if op == "kda_chunkwise" else peers._fla_dplr
    t1 = time.time()
    build(op + (registry.F32_GATES if cases.endswith("f32") else ""), shape, env).fwbw()
    if DEV == "cuda":
        torch.cuda.synchronize()
    print(f"fla {cases}: first fwd+bwd {time.time() - t1:.1f} s", flush=True)
    return 0


def child(out: str, op: str, f32: bool, shape: dict, start: int, limit_s: float, t0: float,
          use_fla: bool = False) -> int:
    """One (op, gate dtype) case from VARIANTS[start] on (the profile and the default first when
    start is 0, and with `use_fla` fla's profile and time), rows appended to dplr_tune.jsonl;
    exits FAULT after a CUDA fault."""
    log = open(os.path.join(out, "dplr_tune.jsonl"), "a")

    def emit(row):
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row)[:300], flush=True)

    case = dict(op=op, f32_gates=f32, shape=shape)
    step, ref = run(op, f32, shape, None)
    if start == 0:
        emit(dict(case, kind="profile", kernels=profile(step)))
        emit(dict(case, kind="time", config="default", ms=bench(step)))
        if use_fla:
            try:
                for row in fla_rows(op, f32, shape):
                    emit(dict(case, **row))
            except Exception as e:  # noqa: BLE001 - reported in the row (not installed, say)
                emit(dict(case, kind="error", config="fla", why=f"{type(e).__name__}: {str(e)[:200]}"))
    for v in VARIANTS[start:]:
        if time.time() - t0 > limit_s:
            emit(dict(case, kind="skipped", config=v, why="--limit-s"))
            continue
        try:
            cfg = DPLRKernelConfig().replace(**v)
            t1 = time.time()
            step_v, outs = run(op, f32, shape, cfg)
            compile_s = time.time() - t1
            errs = [rel(x, r) for x, r in zip(outs, ref)]
            row = dict(case, kind="time", config=v, compile_s=round(compile_s, 1), max_rel_vs_default=max(errs))
            if max(errs) > 2e-2:
                row["why"] = "result differs from the default's"
            else:
                row["ms"] = bench(step_v)
        except Exception as e:  # noqa: BLE001 - reported in the row
            emit(dict(case, kind="error", config=v, why=f"{type(e).__name__}: {str(e)[:200]}"))
            if _faulted(e):
                return FAULT
            continue
        emit(row)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="a small shape (a smoke run)")
    ap.add_argument("--shape", help="B,T,H,K,V instead of the default 8,2048,16,128,128")
    ap.add_argument("--limit-s", type=float, default=540, help="start no new measurement after this many seconds")
    ap.add_argument("--fla", action="store_true", help="fla in the same call: its kernels' profile and fwd+bwd ms per "
                    "case, and chunk_kda in the error table (its first compile: minutes)")
    ap.add_argument("--probe-prec", action="store_true", help="only section 4: the precision probe (KDA)")
    ap.add_argument("--cases", default="kda-bf16,kda-f32,dplr-bf16,dplr-f32",
                    help="which (op, gate dtype) cases, comma-separated (default: all four)")
    ap.add_argument("--variants", default=":", help="a slice of VARIANTS to sweep, e.g. 0:8 (default: all)")
    ap.add_argument("--warm-fla", action="store_true", help="only compile fla's kernels for --cases (each case "
                    "in its own process, in parallel), so that a later --fla run times them without minutes of compile")
    ap.add_argument("--child", help=argparse.SUPPRESS)   # "op,f32,start,t0": one case in a child process
    a = ap.parse_args()
    shape = QUICK if a.quick else dict(zip("BTHKV", map(int, a.shape.split(",")))) if a.shape else SHAPE
    lo, hi = (int(x) if x else None for x in a.variants.split(":"))
    VARIANTS[:] = VARIANTS[lo:hi]
    if a.child:
        op, f32, start, t0 = a.child.split(",")
        return child(a.out, op, f32 == "1", shape, int(start), a.limit_s, float(t0), a.fla)
    os.makedirs(a.out, exist_ok=True)
    if a.warm_fla:
        return warm_fla(a.out, a.cases, shape)
    if a.probe_prec:
        rows = probe_prec(a.out, shape, False)   # bf16 gates: the float32-gate case differs in the dk group only
        with open(os.path.join(a.out, "dplr_prec.md"), "w") as f:
            f.write(render_probe(rows))
        return 0
    t0 = time.time()
    path = os.path.join(a.out, "dplr_tune.jsonl")
    open(path, "w").close()
    # each case in a child process: a variant that faults (illegal memory access) loses the
    # CUDA context, so the next child goes on from the variant after it
    cases = [(c.split("-")[0] + "_chunkwise", c.endswith("f32")) for c in a.cases.split(",")]
    for op, f32 in cases:
        start = 0
        while start <= len(VARIANTS):
            cmd = [sys.executable, os.path.abspath(__file__), "--out", a.out, "--limit-s", str(a.limit_s),
                   "--variants", a.variants] + (["--shape", a.shape] if a.shape else []) + [
                   "--child", f"{op},{int(f32)},{start},{t0}"] + (["--quick"] if a.quick else []) \
                + (["--fla"] if a.fla and start == 0 else [])
            rc = subprocess.run(cmd).returncode
            if rc != FAULT:
                break
            done = [r for r in map(json.loads, open(path)) if r.get("op") == op and r.get("f32_gates") == f32
                    and r["kind"] in ("time", "error", "skipped") and r.get("config") not in ("default", "fla")]
            start = len(done)
    rows = [json.loads(line) for line in open(path)]
    log = open(path, "a")

    def emit(row):
        rows.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row)[:300], flush=True)

    acc_shape = dict(shape, B=min(shape["B"], 2))
    for f32 in sorted({f32 for op, f32 in cases if op == "kda_chunkwise"}):
        if time.time() - t0 > a.limit_s:
            break
        try:
            emit(dict(op="kda_chunkwise", f32_gates=f32, shape=acc_shape, kind="accuracy",
                      errors=accuracy(acc_shape, f32, a.fla)))
        except Exception as e:  # noqa: BLE001 - reported in the row
            emit(dict(op="kda_chunkwise", f32_gates=f32, shape=acc_shape, kind="error", config="accuracy",
                      why=f"{type(e).__name__}: {str(e)[:200]}"))
    log.close()
    with open(os.path.join(a.out, "dplr_tune.md"), "w") as f:
        for op, f32 in cases:
            mine = [r for r in rows if r["op"] == op and r["f32_gates"] == f32]
            f.write(f"## {op}, {'float32' if f32 else 'bf16'} gates, {shape}\n\n| config | ms | note |\n|---|---|---|\n")
            for r in mine:
                if r["kind"] in ("time", "error", "skipped"):
                    ms = f"{r['ms']:.3f}" if "ms" in r else "—"
                    f.write(f"| {r['config']} | {ms} | {r.get('why', '')} |\n")
            acc = next((r for r in mine if r["kind"] == "accuracy"), None)
            if acc:
                f.write(f"\nErrors vs the float64 PyTorch path at {acc['shape']}:\n\n"
                        "| implementation | o | dq | dk | dv | dg | dbeta | final state |\n"
                        "|---|---|---|---|---|---|---|---|\n")
                f.writelines(f"| {n} | " + " | ".join(f"{e:.2e}" for e in errs) + " |\n"
                             for n, errs in acc["errors"].items())
            for prof in (r for r in mine if r["kind"] == "profile"):
                who = "fla" if prof.get("who") == "fla" else "ours, default config"
                f.write(f"\n| kernel ({who}) | launches | ms | % |\n|---|---|---|---|\n")
                f.writelines(f"| `{k}` | {n} | {ms} | {pc} |\n" for k, n, ms, pc in prof["kernels"][:20])
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
