"""FSDP2 on one GPU against plain training: tokens/s and peak memory of the training step.

What `train(parallel="fsdp")` runs, at world size 1: the model sharded by the library's
`shard_model` (FSDP2 `fully_shard` per block and on the root, bf16 parameters for compute with
float32 master weights and gradient reduction) in a single-process NCCL group, against the same
model unsharded (float32 weights under bf16 autocast). Both train with the library's
`train_step` and `make_optimizer` (fused AdamW on CUDA): bf16 autocast, float32 cross-entropy,
clipping to norm 1, random token ids, batch 16 x 2048 (halved until it fits when a job runs out
of memory). At one GPU FSDP shards nothing: the numbers are its overhead (the per-block
all-gather and reduce-scatter calls, the bf16 parameter copies) and the memory that its
bf16 gathered weights save. Presets `125M` (the paper's xLSTM[7:1]) and `large-350M` (the
xLSTM-7B blocks), vocabulary 50304.

The command, from the repository root on a machine with one CUDA GPU (about 3 minutes):

    python3 benchmarks/fsdp_one_gpu.py --out $OUT

Options: --presets A,B (default 125M,large-350M), --batch B, --seq T, --steps N (timed steps,
default 10), --compile (the library's `compile_blocks` in both modes), --quick (tiny models
on the CPU over gloo: a check of the mechanics, no meaningful numbers).

Each (preset, mode) runs in its own child process with a time limit
(`xlstm_kit.bench.scripts.run_child`), so an out-of-memory or a crash costs its own row. Writes
DIR/fsdp_one_gpu.json (every row) and DIR/fsdp_one_gpu.md (the table), DIR = --out, else $OUT,
else the current folder; the table is printed at the end.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from xlstm_kit.bench.scripts import child_exit, run_child
from xlstm_kit.bench.timing import timed_call

REPO = Path(__file__).resolve().parent.parent
VOCAB, BATCH, SEQ = 50304, 16, 2048
OUT_NAME = "fsdp_one_gpu"
CHILD_LIMIT_S = 300.0


# ============================================================================== child side
def _emit(row: dict) -> None:
    print("RESULT " + json.dumps(row), flush=True)


def child(opts: dict) -> None:
    import torch
    import torch.distributed as dist

    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.training import DistInfo, TrainConfig, lm_loss, train_step
    from xlstm_kit.training.distributed import shard_model
    from xlstm_kit.training.optim import make_optimizer

    quick, mode = opts["quick"], opts["mode"]
    cuda = torch.cuda.is_available() and not quick
    if not quick and not cuda:
        raise RuntimeError("no CUDA device (run with --quick on a CPU)")
    device = torch.device("cuda:0" if cuda else "cpu")
    B, T = opts["batch"], opts["seq"]
    V = 128 if quick else VOCAB
    row = dict(preset=opts["preset"], mode=mode, batch=B, seq=T, torch=torch.__version__,
               device=torch.cuda.get_device_name(device) if cuda else "cpu")
    if quick:  # the preset's block family at a toy size
        family = "large" if opts["preset"].startswith("large") else "neurips"
        cfg = XLSTMConfig(family=family, vocab_size=V, d_model=32, n_blocks=2, n_heads=2, context_length=T,
                          **({} if family == "large" else dict(slstm_at=[1])))
    else:
        cfg = XLSTMConfig.from_name(opts["preset"], vocab_size=V, context_length=T)
    torch.manual_seed(0)
    model = XLSTMLanguageModel(cfg).to(device)
    row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    if opts["compile"]:
        model.compile_blocks(**({"backend": "eager"} if quick else {}))
    if mode == "fsdp":
        # a process group of this one process: what torchrun --nproc-per-node 1 would give
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device if cuda else None)
        shard_model(model, DistInfo(), device, "bf16" if cuda else "fp32")
    precision = "bf16" if cuda else "fp32"
    opt = make_optimizer(model, TrainConfig(lr=1e-4, min_lr=1e-5, batch_size=B, seq_len=T))
    row["optimizer"] = "fused AdamW" if opt.defaults.get("fused") else "AdamW"
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, V, (B, T + 1), generator=g).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    model.train()

    def step():
        return train_step(model, opt, [(x, y)], lm_loss, lr=1e-4, precision=precision, grad_clip=1.0).loss

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    try:
        t0 = time.perf_counter()
        losses = [step()]
        sync()
        row["first_step_s"] = time.perf_counter() - t0
        for _ in range(0 if quick else 2):  # warm-up: the allocator's first requests, autotuning
            losses.append(step())
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        ms = []
        for _ in range(opts["steps"]):
            loss, t = timed_call(step, device)
            losses.append(loss)
            ms.append(t)
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
        _emit(row)
        return
    vals = [float(v) for v in losses]
    row.update(steps=len(ms), step_ms=statistics.median(ms), step_ms_min=min(ms),
               tok_s=B * T / statistics.median(ms) * 1e3, loss_first=vals[0], loss_last=vals[-1],
               loss_finite=all(math.isfinite(v) for v in vals), status="ok")
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        row["reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    _emit(row)
    if dist.is_initialized():
        dist.destroy_process_group()


# ============================================================================== parent side
def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def render(rows: list[dict], header: dict) -> str:
    lines = [f"# FSDP2 on one GPU against plain training ({header['date']})", "",
             f"Command: `{header['command']}`", "", f"Machine: {header.get('machine', '?')}; "
             f"torch {header.get('torch', '?')}. {header['settings']}", "",
             "| preset | mode | parameters | batch | step ms | tokens/s | vs plain | peak GiB | reserved GiB | "
             "first step s | loss first → last | status |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    plain = {r["preset"]: r for r in rows if r.get("mode") == "plain" and r.get("tok_s")}
    for r in rows:
        ref = plain.get(r["preset"])
        ratio = r["tok_s"] / ref["tok_s"] if r.get("tok_s") and ref and ref["batch"] == r["batch"] else None
        losses = (f"{r['loss_first']:.3f} → {r['loss_last']:.3f}" if r.get("loss_first") is not None else "—")
        lines.append(f"| {r['preset']} | {r['mode']} | {_fmt(r.get('params_m'), '.3g')}M | {r.get('batch')} x "
                     f"{r.get('seq')} | {_fmt(r.get('step_ms'), '.1f')} | {_fmt(r.get('tok_s'), ',.0f')} | "
                     f"{_fmt(ratio, '.2f')} | {_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('reserved_gib'), '.2f')} | "
                     f"{_fmt(r.get('first_step_s'), '.1f')} | {losses} | {r.get('status', '?')} |")
    lines += ["", "vs plain: tokens/s over the plain run's at the same batch. Peak: "
              "torch.cuda.max_memory_allocated over the timed steps (after two warm-up steps)."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder (default: $OUT, else the current folder)")
    ap.add_argument("--presets", default="125M,large-350M", help="comma-separated presets (default: 125M,large-350M)")
    ap.add_argument("--batch", type=int, default=None, help=f"sequences per step (default {BATCH}; --quick 2)")
    ap.add_argument("--seq", type=int, default=None, help=f"tokens per sequence (default {SEQ}; --quick 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick 2)")
    ap.add_argument("--compile", action="store_true", help="compile_blocks() in both modes")
    ap.add_argument("--quick", action="store_true", help="tiny models on the CPU (a check of the mechanics)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_exit(lambda: child(json.loads(args.child)))
    batch = args.batch or (2 if args.quick else BATCH)
    seq = args.seq or (64 if args.quick else SEQ)
    steps = args.steps or (2 if args.quick else 10)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    header = dict(date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  command="python3 benchmarks/fsdp_one_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  settings=f"Random tokens, vocabulary {128 if args.quick else VOCAB}, {steps} timed steps, "
                           f"{'bf16 autocast' if not args.quick else 'float32 (CPU)'}, the library's optimizer "
                           f"(fused AdamW on CUDA), clipping to 1.0"
                           + (", compile_blocks()" if args.compile else ", eager")
                           + ("; --quick: tiny models on the CPU over gloo" if args.quick else ""))
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    rows: list[dict] = []
    for preset in [p.strip() for p in args.presets.split(",") if p.strip()]:
        for mode in ("plain", "fsdp"):
            b = batch
            while True:  # halve the batch until the job fits
                opts = dict(quick=args.quick, preset=preset, mode=mode, batch=b, seq=seq, steps=steps,
                            compile=args.compile)
                res = run_child([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(opts)],
                                CHILD_LIMIT_S, env)
                row = res["results"][-1] if res["results"] else dict(preset=preset, mode=mode, batch=b, seq=seq)
                if res["timed_out"]:
                    row["status"] = f"timeout after {CHILD_LIMIT_S:.0f} s"
                elif res["rc"] != 0:
                    tail = [line for line in res["stderr"].strip().splitlines() if line.strip()]
                    row["status"] = f"exit {res['rc']}: {tail[-1][:200] if tail else ''}"
                oom = row.get("status") == "oom" or "OutOfMemoryError" in res["stderr"]
                if oom and b > 1:
                    print(f"# {preset} {mode}: out of memory at batch {b}; halving", flush=True)
                    b //= 2
                    continue
                break
            row["wall_s"] = res["wall_s"]
            rows.append(row)
            header.setdefault("machine", row.get("device"))
            header.setdefault("torch", row.get("torch"))
            print(f"# {preset} {mode}: " + (f"{row['tok_s']:,.0f} tok/s, {row['step_ms']:.1f} ms, "
                  f"{_fmt(row.get('peak_gib'), '.2f')} GiB" if row.get("tok_s") else row.get("status", "?")), flush=True)
            (out_dir / f"{OUT_NAME}.json").write_text(json.dumps(dict(header=header, rows=rows), indent=2) + "\n")
            (out_dir / f"{OUT_NAME}.md").write_text(render(rows, header))
    print(render(rows, header), flush=True)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
