"""Weak scaling of xlstm_kit training over the GPUs of one host: DDP and FSDP2 under torchrun.

Every GPU keeps the same work (--batch sequences of --seq tokens per GPU), so perfect scaling
keeps each GPU's tokens/s constant as GPUs are added. For each model, parallel mode and GPU
count the driver starts

    torchrun --standalone --nproc-per-node N benchmarks/scaling.py worker ...

in a child process with a time limit (killed with its workers when the limit passes: a hung
NCCL collective costs its own row only), and reads back per GPU: tokens/s, step time, peak
memory, MFU, and the weak-scaling efficiency, tokens/s per GPU at N GPUs over that of the 1-GPU
row of the same model and mode (where that row did not run: over the smallest count that did,
named in the table).

The commands, from the repository root of a machine with 8 GPUs, one per model: each stays
within --budget-s (540 s), so that it fits a 10-minute call (not yet run on such a machine):

    python3 benchmarks/scaling.py --models 125M-7:1 --out $OUT
    python3 benchmarks/scaling.py --models large-350M --out $OUT
    python3 benchmarks/scaling.py --models large-1.3B --out $OUT
    python3 benchmarks/scaling.py --models xlstm-7b --parallel fsdp --batch 8 --checkpointing --out $OUT
    python3 benchmarks/scaling.py --quick --out $OUT        (smoke test: tiny model, NCCL, both modes)

The last full command is xLSTM-7B full fine-tuning (every weight trained) with FSDP2 and
activation checkpointing: step time, tokens/s, MFU and peak memory per GPU. A count whose
training state cannot fit (float32 weights, gradients and AdamW moments: 16 bytes a parameter,
112 GB for xLSTM-7B on 1 GPU) is reported as such without building the model. A model and mode
that run out of memory at their smallest GPU count are run again at half the batch, and all
their counts at the batch that fitted. Jobs run in this order: the 1-GPU rows, then the largest
count, then the others, and the whole call ends within --budget-s (default 540 s); a job that
cannot get a minute any more is not started, and its row says so.

What runs is the library's own `xlstm_kit.training.train` (the loop of `xlstm-kit train`:
AdamW, fused on CUDA; bf16 autocast; clipping to 1.0; DDP or `shard_model`'s FSDP2 over the
process group of `init_distributed`) on random token ids instead of a corpus, without
validation or checkpoints. A model spec is a preset name, optionally with an xLSTM[a:b] ratio
(`125M-7:1`); vocabulary 50304. --quick: each model as its block family at the `tiny` preset's
size, 2 x 64 tokens per process, 2 timed steps; with --device cpu it runs over gloo on a CPU
(tests/bench/test_scaling.py), a check of the mechanics, not of speed.

Writes DIR/scaling.jsonl (one row per job, rewritten as each ends) and DIR/scaling.md (the
table, with the date, the GPU and the command), DIR = --out, else $OUT, else the current folder;
the table is printed at the end. Exit status 0 when every job ran (or was refused for memory
before it started), 1 otherwise.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script (and by torchrun) from anywhere: the library beside it
    sys.path.insert(0, str(REPO))

from xlstm_kit.bench.scripts import child_exit, run_child  # noqa: E402
from xlstm_kit.errors import XLSTMKitError  # noqa: E402

SCRIPT = Path(__file__).resolve()
OUT_NAME = "scaling"
VOCAB = 50304
DEFAULT_MODELS = "125M-7:1,large-350M,large-1.3B"
QUICK_MODELS = "tiny"
PARALLEL = ("ddp", "fsdp")
JOB_LIMIT_S = 300.0
BUDGET_S = 540.0  # the whole call, within a 10-minute device command with room to copy results back
MIN_JOB_S = 60.0  # a job that cannot get this long is not started (--quick: 20 s)
GIB = 2**30
# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a part of the device name; the first
# match counts, so the PCIe and NVL variants come before the SXM name they contain.
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("A100", 312.0))


def peak_tflops(device_name: str | None) -> float | None:
    for part, tflops in PEAK_BF16_TFLOPS:
        if device_name and part in device_name:
            return tflops
    return None


# ============================================================================== model specs
_RATIO = re.compile(r"(.+?)-(\d+:\d+)")


def model_config(spec: str, *, seq: int, quick: bool):
    """The XLSTMConfig of a model spec: a preset name, optionally followed by an xLSTM[a:b]
    ratio (`125M-7:1`); under `quick` its block family at the `tiny` preset's size."""
    from xlstm_kit import XLSTMConfig

    m = _RATIO.fullmatch(spec.strip())
    preset, ratio = (m.group(1), m.group(2)) if m else (spec.strip(), None)
    cfg = XLSTMConfig.from_name(preset, **({"slstm_at": ratio} if ratio else {}))
    if quick:
        tiny = XLSTMConfig.from_name("tiny", context_length=max(seq, 256))
        if cfg.family == "large":  # the tiny width with the xLSTM-7B blocks' factors
            return XLSTMConfig(family="large", vocab_size=tiny.vocab_size, d_model=tiny.d_model,
                               n_blocks=tiny.n_blocks, n_heads=tiny.n_heads, qk_dim_factor=cfg.qk_dim_factor,
                               v_dim_factor=cfg.v_dim_factor, ffn_proj_factor=cfg.ffn_proj_factor,
                               round_proj_to=cfg.round_proj_to, context_length=tiny.context_length)
        return tiny
    return XLSTMConfig.from_name(preset, vocab_size=VOCAB, context_length=max(seq, cfg.context_length),
                                 **({"slstm_at": ratio} if ratio else {}))


# ============================================================================== worker side
def _emit(row: dict) -> None:
    print("RESULT " + json.dumps(row), flush=True)


def _nccl_version() -> str:
    import torch

    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def worker(args: argparse.Namespace) -> None:
    """One job, in each of torchrun's processes: the library's `train` on random tokens, timed
    at the end of every step; rank 0 prints the row."""
    import torch
    import torch.distributed as dist

    from xlstm_kit import XLSTMLanguageModel
    from xlstm_kit.bench.registry import flops_per_token
    from xlstm_kit.models.meta import shapes_only
    from xlstm_kit.training import TrainConfig, Workload, init_distributed, train
    from xlstm_kit.training.distributed import builds_on_meta

    t_start = time.perf_counter()
    _check_sizes(args)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise XLSTMKitError("--device cuda, but torch sees no CUDA GPU here")
    info = init_distributed(args.device, parallel=args.parallel)
    device = torch.device("cuda", info.local_rank) if cuda else torch.device("cpu")
    world, per_gpu, seq = info.world_size, args.batch, args.seq
    cfg = model_config(args.model, seq=seq, quick=args.quick)
    with shapes_only():
        n_params = sum(p.numel() for p in XLSTMLanguageModel(cfg).parameters())
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    row = dict(model=args.model, parallel=args.parallel, gpus=world, device=name, batch_per_gpu=per_gpu, seq=seq,
               global_batch=per_gpu * world, params_m=n_params / 1e6, checkpointing=args.checkpointing,
               compile=args.compile, torch=torch.__version__,
               nccl=_nccl_version() if cuda else None)

    if cuda:
        # A whole-model float32 copy on rank 0 before shard_model shards it (on every rank under
        # DDP, which keeps them), and weights, gradients and two AdamW moments in float32 afterwards, sharded by
        # FSDP only: a count that cannot hold these is reported without building the model.
        total = torch.cuda.get_device_properties(device).total_memory
        state = 16 * n_params / (world if args.parallel == "fsdp" else 1)
        need = max(4 * n_params, state)
        if need > total:
            if info.is_main:
                _emit(dict(row, status=f"does not fit: {need / GIB:.0f} GiB of training state per GPU, "
                                       f"the GPU has {total / GIB:.0f} GiB"))
            if dist.is_initialized():
                dist.destroy_process_group()
            return

    torch.manual_seed(0)
    # initialised where it trains: seconds for xLSTM-7B on a GPU, not minutes; FSDP's other ranks
    # build shapes only and get their shards of rank 0's weights
    with torch.device("meta" if builds_on_meta(info, args.parallel) else device):
        model = XLSTMLanguageModel(cfg)
    gen = torch.Generator().manual_seed(info.rank)  # every rank its own tokens, as with a real corpus
    tokens = torch.randint(0, cfg.vocab_size, (per_gpu, seq + 1), generator=gen).to(device)
    warmup, steps = args.warmup, args.steps

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    class RandomTokens(Workload):
        """The same batch every step; the loop's after-step hook marks the time (after the
        device's queued work) and resets the memory peak once the warm-up steps are done."""

        def __init__(self):
            self.marks: list[float] = []
            self.setup_peak = 0

        def batches(self, step):
            yield tokens[:, :-1], tokens[:, 1:]

        def start(self, run):
            sync()
            self.t0 = time.perf_counter()

        def after_step(self, run):
            sync()
            self.marks.append(time.perf_counter())
            if run.step == warmup and cuda:
                self.setup_peak = torch.cuda.max_memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            return None

    config = TrainConfig(steps=warmup + steps, batch_size=per_gpu * world, seq_len=seq, lr=1e-4, min_lr=1e-5,
                         warmup_steps=1, eval_interval=0, eval_at_start=False, checkpoint_interval=0,
                         log_interval=warmup + steps, activation_checkpointing="all" if args.checkpointing else "none",
                         compile=args.compile, parallel=args.parallel)
    work = RandomTokens()
    try:
        result = train(model, work, config, None, device=device, dist=info, handle_signals=False)
    except torch.cuda.OutOfMemoryError:
        # this rank's row: the others wait in a collective until torchrun ends them
        _emit(dict(row, status="oom", rank=info.rank,
                   peak_gib=torch.cuda.max_memory_allocated(device) / GIB if cuda else None))
        raise
    # the slowest rank sets the pace of a step: the maximum over ranks, step by step
    mine = dict(ms=[1e3 * (b - a) for a, b in zip(work.marks[warmup - 1:], work.marks[warmup:])],
                peak=torch.cuda.max_memory_allocated(device) if cuda else None,
                reserved=torch.cuda.max_memory_reserved(device) if cuda else None,
                setup_peak=work.setup_peak if cuda else None, first_step_s=work.marks[0] - work.t0,
                setup_s=work.t0 - t_start)
    every = [mine]
    if dist.is_initialized():
        every = [None] * world
        dist.all_gather_object(every, mine)
    if info.is_main:
        ms = [max(r["ms"][i] for r in every) for i in range(len(mine["ms"]))]
        step_ms = statistics.median(ms)
        tok_gpu = per_gpu * seq / step_ms * 1e3
        losses = [v for _, v in result.losses]
        fpt = flops_per_token(cfg)
        peak = peak_tflops(name)
        row.update(steps=len(ms), warmup=warmup, step_ms=step_ms, step_ms_min=min(ms), step_ms_mean=statistics.mean(ms),
                   tok_s_per_gpu=tok_gpu, tok_s=tok_gpu * world, flops_per_token=fpt,
                   mfu=tok_gpu * fpt / (peak * 1e12) if (cuda and peak) else None,
                   first_step_s=max(r["first_step_s"] for r in every), setup_s=max(r["setup_s"] for r in every),
                   loss_first=losses[0], loss_last=losses[-1], loss_finite=all(math.isfinite(v) for v in losses))
        if cuda:
            row.update(peak_gib=max(r["peak"] for r in every) / GIB,
                       peak_gib_per_rank=[r["peak"] / GIB for r in every],
                       reserved_gib=max(r["reserved"] for r in every) / GIB,
                       setup_peak_gib=max(r["setup_peak"] for r in every) / GIB)
        _emit(dict(row, status="ok"))
    if dist.is_initialized():
        dist.destroy_process_group()


def _reporting(job, args: argparse.Namespace) -> None:
    """`job(args)`, its failure also reported as a RESULT row: torchrun's summary of eight failed
    ranks can push the workers' error lines out of the stderr tail that the driver keeps."""
    try:
        job(args)
    except BaseException as e:
        if type(e).__name__ != "OutOfMemoryError":  # the worker reported it, with its peak
            _emit(dict(model=args.model, parallel=args.parallel, rank=int(os.environ.get("RANK", "0")),
                       status=f"error: {type(e).__name__}: {' '.join(str(e).split())}"[:300]))
        raise


# ============================================================================== driver side
def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _ran(row: dict) -> bool:
    return row.get("status") == "ok" and bool(row.get("tok_s_per_gpu"))


def add_efficiency(rows: list[dict]) -> None:
    """Each finished row's tokens/s per GPU over that of its model and mode's 1-GPU row at the same
    batch per GPU (where that did not run: the smallest GPU count that did, recorded in
    efficiency_base_gpus)."""
    for r in rows:
        same = [b for b in rows if _ran(b) and (b["model"], b["parallel"], b.get("batch_per_gpu"))
                == (r["model"], r["parallel"], r.get("batch_per_gpu"))]
        base = min(same, key=lambda b: b["gpus"], default=None)
        if _ran(r) and base is not None:
            r["efficiency"] = r["tok_s_per_gpu"] / base["tok_s_per_gpu"]
            r["efficiency_base_gpus"] = base["gpus"]
        else:
            r.pop("efficiency", None)
            r.pop("efficiency_base_gpus", None)


def render(rows: list[dict], header: dict) -> str:
    rows = sorted(rows, key=lambda r: (header["models"].index(r["model"]), PARALLEL.index(r["parallel"]), r["gpus"]))
    lines = [f"# Weak scaling of xlstm_kit training ({header['date']})", "",
             f"Command: `{header['command']}`", "",
             f"Machine: {_machine(rows, header)}; torch {header.get('torch') or '?'}"
             + (f", NCCL {header['nccl']}" if header.get("nccl") else "") + f". {header['settings']}", "",
             "| model | parallel | GPUs | parameters | batch per GPU | step ms | tokens/s per GPU | tokens/s | "
             "efficiency | MFU | peak GiB per GPU | reserved GiB | loss first → last | status |",
             "|" + "---|" * 14]
    for r in rows:
        eff = r.get("efficiency")
        if eff is not None and r.get("efficiency_base_gpus", 1) != 1:
            eff_cell = f"{eff:.2f} (vs {r['efficiency_base_gpus']} GPUs)"
        else:
            eff_cell = _fmt(eff, ".2f")
        losses = f"{r['loss_first']:.3f} → {r['loss_last']:.3f}" if r.get("loss_first") is not None else "—"
        lines.append(
            f"| {r['model']} | {r['parallel']} | {r['gpus']} | {_fmt(r.get('params_m'), ',.1f')}M | "
            f"{r.get('batch_per_gpu')} × {r.get('seq')} | {_fmt(r.get('step_ms'), ',.1f')} | "
            f"{_fmt(r.get('tok_s_per_gpu'), ',.0f')} | {_fmt(r.get('tok_s'), ',.0f')} | {eff_cell} | "
            f"{_fmt(100 * r['mfu'] if r.get('mfu') is not None else None, '.1f')}{' %' if r.get('mfu') else ''} | "
            f"{_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('reserved_gib'), '.2f')} | {losses} | "
            f"{r.get('status', '?')} |")
    lines += ["", "Weak scaling: every GPU trains on the same number of sequences a step, so the global batch "
              "grows with the GPUs. Step ms: median over the timed steps of the slowest rank's time from the end "
              "of one step to the end of the next (the device synchronised at each end). Tokens/s per GPU: batch "
              "per GPU × tokens per sequence / step time. Efficiency: tokens/s per GPU over the 1-GPU row's of "
              "the same model, mode and batch (1 GPU: plain training for ddp, FSDP2 over a group of one for fsdp). "
              "A model and mode whose smallest count ran out of memory ran all its counts at half the batch "
              "(halved until it fit). "
              "MFU: tokens/s per GPU × FLOPs per token (6 per weight of a multiply-add plus the chunkwise mLSTM "
              "mixing, `xlstm_kit.bench.registry.flops_per_token`; recomputation not counted) over the GPU's "
              "dense bf16 peak. Peak GiB: torch.cuda.max_memory_allocated over the timed steps, the largest "
              "rank's."]
    return "\n".join(lines) + "\n"


def _machine(rows: list[dict], header: dict) -> str:
    if header.get("gpus_here") is None:
        return f"CPU ({os.cpu_count()} cores), processes over gloo"
    names = sorted({r["device"] for r in rows if r.get("device")})
    return f"{header['gpus_here']} × {' / '.join(names) or 'GPU'}"


def _failure(stderr: str) -> str:
    """The line that names a failed job's error: the last exception line of its workers'
    tracebacks (torchrun's own summary follows them), else the last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)(:|$)", line)
              and "ChildFailedError" not in line]
    return (errors or lines or [""])[-1][:200]


def job_order(models: list[str], parallels: list[str], gpus: list[int]) -> list[tuple[str, str, int]]:
    """The jobs in the order they run: per model the 1-GPU rows (the efficiency's base) first, then
    the largest count, then the others from large to small, so that a run cut short by its budget
    still has the widest comparison."""
    counts = [g for g in gpus if g == min(gpus)] + sorted((g for g in gpus if g != min(gpus)), reverse=True)
    return [(m, p, g) for m in models for g in counts for p in parallels]


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise XLSTMKitError(f"{flag} takes positive integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise XLSTMKitError(f"{flag} takes positive integers separated by commas, got {text!r}")
    return sorted(set(values))


def _names(text: str, flag: str) -> list[str]:
    names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not names:
        raise XLSTMKitError(f"{flag} names nothing")
    return names


def _check_sizes(args: argparse.Namespace) -> None:
    for flag, value in (("--batch", args.batch), ("--seq", args.seq), ("--steps", args.steps),
                        ("--warmup", args.warmup)):
        if value < 1:
            raise XLSTMKitError(f"{flag} must be at least 1, got {value}")


def check(args: argparse.Namespace) -> tuple[list[int], list[str], list[str]]:
    """The run's GPU counts, models and modes; XLSTMKitError in one line for what cannot run."""
    gpus = _int_list(args.gpus, "--gpus")
    models = _names(args.models, "--models")
    parallels = _names(args.parallel, "--parallel")
    bad = [p for p in parallels if p not in PARALLEL]
    if bad:
        raise XLSTMKitError(f"--parallel {','.join(bad)}: choose from {', '.join(PARALLEL)}")
    _check_sizes(args)
    if args.job_limit_s <= 0 or args.budget_s <= 0:
        raise XLSTMKitError("--job-limit-s and --budget-s must be positive")
    for spec in models:
        try:
            model_config(spec, seq=args.seq, quick=args.quick)
        except XLSTMKitError as e:
            raise XLSTMKitError(f"--models {spec}: {e}") from None
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()  # no CUDA context: the workers need all of GPU 0
        if have == 0:
            raise XLSTMKitError("no CUDA GPU here; --device cpu runs the processes over gloo on the CPU "
                                "(with --quick: a check of the mechanics)")
        if max(gpus) > have:
            raise XLSTMKitError(f"--gpus {max(gpus)} asks for more GPUs than the {have} here")
    return gpus, models, parallels


def worker_args(args: argparse.Namespace, model: str, parallel: str, batch: int) -> list[str]:
    flags = ["worker", "--model", model, "--parallel", parallel, "--batch", str(batch), "--seq", str(args.seq),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device]
    return flags + [f for f, on in (("--checkpointing", args.checkpointing), ("--compile", args.compile),
                                    ("--quick", args.quick)) if on]


def run_job(args: argparse.Namespace, model: str, parallel: str, n: int, batch: int, limit: float,
            env: dict) -> dict:
    """One torchrun job -> its row: the measured row, or what stopped it (a rank's out-of-memory or
    error, the time limit, torchrun's exit)."""
    wargs = worker_args(args, model, parallel, batch)
    row = dict(model=model, parallel=parallel, gpus=n, batch_per_gpu=batch, seq=args.seq,
               command=f"torchrun --standalone --nproc-per-node {n} benchmarks/scaling.py " + " ".join(wargs))
    # torchrun as a module of this interpreter: a `torchrun` on PATH may be another Python's
    res = run_child([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                     str(SCRIPT)] + wargs, limit, env)
    # a rank's out-of-memory makes the others fail in their collectives, whose rows may come first
    found = ([r for r in res["results"] if r.get("status") == "ok"] or
             [r for r in res["results"] if r.get("status") == "oom"] or res["results"])
    row.update(found[0] if found else {})
    if res["timed_out"] and not _ran(row):
        row["status"] = f"timeout after {limit:.0f} s"
    elif res["rc"] != 0 and not found:
        row["status"] = f"exit {res['rc']}: {_failure(res['stderr'])}"
    if res["rc"] != 0 and _ran(row):  # measured, then failed in its teardown
        row["exit"] = "timeout" if res["timed_out"] else res["rc"]
    row.setdefault("status", "no result")
    row["wall_s"] = res["wall_s"]
    return row


def drive(args: argparse.Namespace, argv: list[str]) -> int:
    t0 = time.monotonic()
    gpus, models, parallels = check(args)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    gpus_here = None
    if args.device == "cuda":
        import torch

        gpus_here = torch.cuda.device_count()
    header = dict(date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  command="python3 benchmarks/scaling.py " + " ".join(argv), models=models, gpus_here=gpus_here,
                  settings=f"Per {'GPU' if args.device == 'cuda' else 'process'} {args.batch} × {args.seq} random "
                           f"tokens a step; the library's train(): "
                           f"{'fused AdamW, bf16 autocast' if args.device == 'cuda' else 'AdamW, float32'}, clipping "
                           f"to 1.0; {args.warmup} warm-up step{'s' * (args.warmup > 1)}, then {args.steps} timed"
                           + ("; compile_blocks()" if args.compile else "; eager")
                           + ("; activation checkpointing of every block" if args.checkpointing else "")
                           + ("; --quick: tiny models" if args.quick else ""))
    # torchrun pins workers to one OpenMP thread at N > 1 only; the same at N = 1 keeps the rows alike
    # the rest of the environment as it is: NCCL's settings of the machine reach the workers
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join(path))
    min_job_s = 20.0 if args.quick else MIN_JOB_S
    batch = {(m, p): args.batch for m in models for p in parallels}
    rows: list[dict] = []
    for model, parallel, n in job_order(models, parallels, gpus):
        while True:
            left = args.budget_s - (time.monotonic() - t0)
            if left < min_job_s:
                row = dict(model=model, parallel=parallel, gpus=n, batch_per_gpu=batch[model, parallel], seq=args.seq,
                           status=f"not run: --budget-s {args.budget_s:.0f} spent")
                break
            row = run_job(args, model, parallel, n, batch[model, parallel], min(args.job_limit_s, left), env)
            # A batch that does not fit the smallest count fits no other (the same memory under DDP,
            # less under FSDP): halved there, it stays halved for the model's larger counts, so that
            # its rows compare equal work per GPU.
            if row["status"] == "oom" and n == gpus[0] and batch[model, parallel] > 1:
                batch[model, parallel] //= 2
                print(f"# {model} {parallel} {n}: out of memory at batch {row['batch_per_gpu']} per GPU; "
                      f"halving", flush=True)
                continue
            break
        rows.append(row)
        for key in ("torch", "nccl"):
            header[key] = header.get(key) or row.get(key)
        add_efficiency(rows)
        done = (f"{row['tok_s_per_gpu']:,.0f} tokens/s per GPU, {row['step_ms']:.1f} ms, efficiency "
                f"{row['efficiency']:.2f}") if _ran(row) else row["status"]
        print(f"# {model} {parallel} {n}: {done}", flush=True)
        for r in rows:
            r.update(date=header["date"])
        (out_dir / f"{OUT_NAME}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out_dir / f"{OUT_NAME}.md").write_text(render(rows, header))
    print(render(rows, header), flush=True)
    return 0 if all(_ran(r) or r["status"].startswith("does not fit") for r in rows) else 1


# ============================================================================== options
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per GPU (per process) and step; the global batch is this times the GPUs "
                        "(default 16; --quick 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; --quick 64)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick 2)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps before them, the first one's kernel compilation included (default 3; --quick 1)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of every block (recomputed in the backward)")
    p.add_argument("--compile", action="store_true", help="the library's compile_blocks() (default: eager)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: one GPU per process, NCCL (default); cpu: processes over gloo")
    p.add_argument("--quick", action="store_true",
                   help="tiny models (each spec's block family at the tiny preset's size), few short steps: a "
                        "check that every job runs, no meaningful numbers")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="benchmarks/scaling.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Weak scaling of xlstm_kit training (DDP, FSDP2) over 1..N GPUs of one host: one torchrun "
                    "job per model, mode and GPU count, each with a time limit; writes scaling.jsonl and "
                    "scaling.md.",
        epilog="examples:\n"
               "  python3 benchmarks/scaling.py --models 125M-7:1 --out $OUT\n"
               "  python3 benchmarks/scaling.py --models xlstm-7b --parallel fsdp --batch 8 --checkpointing\n"
               "  python3 benchmarks/scaling.py --quick --device cpu --gpus 1,2   (gloo on a CPU)\n"
               "  torchrun --standalone --nproc-per-node 8 benchmarks/scaling.py worker --model large-350M "
               "--parallel fsdp\n"
               "                                      (one job by hand: prints its RESULT row)")
    ap.add_argument("--gpus", default="1,2,4,8", help="GPU counts (processes), comma-separated (default 1,2,4,8)")
    ap.add_argument("--models", default=None,
                    help=f"model specs: a preset, optionally -a:b for the xLSTM[a:b] ratio (default {DEFAULT_MODELS}; "
                         f"--quick {QUICK_MODELS}); xlstm-7b is the 7B full fine-tuning job")
    ap.add_argument("--parallel", default="ddp,fsdp", help="modes, comma-separated: ddp, fsdp (default both)")
    _common(ap)
    ap.add_argument("--out", default=None, metavar="DIR",
                    help="folder for scaling.jsonl and scaling.md (default: $OUT, else the current folder)")
    ap.add_argument("--job-limit-s", type=float, default=JOB_LIMIT_S, metavar="S",
                    help=f"time limit of one torchrun job, start-up included (default {JOB_LIMIT_S:.0f})")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, metavar="S",
                    help=f"the whole run ends within S seconds: a job that cannot get {MIN_JOB_S:.0f} s is not "
                         f"started and its row says so (default {BUDGET_S:.0f})")
    return ap


def build_worker_parser() -> argparse.ArgumentParser:
    wp = argparse.ArgumentParser(
        prog="benchmarks/scaling.py worker",
        description="One job in each process that torchrun starts: the library's train() on random tokens; "
                    "rank 0 prints a line 'RESULT {json}'.")
    wp.add_argument("--model", required=True, help="a model spec, e.g. 125M-7:1, large-350M, xlstm-7b")
    wp.add_argument("--parallel", choices=PARALLEL, required=True, help="ddp or fsdp")
    _common(wp)
    return wp


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    q = args.quick
    for name, full, quick in (("batch", 16, 2), ("seq", 2048, 64), ("steps", 10, 2), ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if getattr(args, "models", "") is None:
        args.models = QUICK_MODELS if q else DEFAULT_MODELS
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        args = _defaults(build_worker_parser().parse_args(argv[1:]))
        child_exit(lambda: _reporting(worker, args))
    args = _defaults(build_parser().parse_args(argv))
    try:
        return drive(args, argv)
    except XLSTMKitError as e:
        print(f"benchmarks/scaling.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
