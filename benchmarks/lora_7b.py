"""LoRA fine-tuning of xLSTM-7B on one GPU: xlstm_kit's LoRA against transformers'
xLSTMForCausalLM with PEFT, on the very same weights (issue 40's one-GPU benchmark).

    python3 benchmarks/lora_7b.py --out $OUT                   (a GPU: 3-4 minutes)
    python3 benchmarks/lora_7b.py --quick --out DIR            (a tiny model on the CPU: the test)

Jobs, each in its own child process with its own time limit (an out-of-memory, a crash or a hang
costs its own row only); by default ours_b4, hf_b4, ours_b1, hf_b1, in that order:
- ours_b4, ours_b1: the `xlstm-7b` preset (NX-AI/xLSTM-7b's shapes, vocabulary 50304) with
  random weights (seed 0) in bf16, `xlstm_kit.lora.apply_lora` (rank --rank, alpha 2 x rank, the
  default targets: q, k, v, ogate_preact, out_proj, proj_up_gate, proj_up, proj_down), activation
  checkpointing of every block (`set_activation_checkpointing("all")`), eager, at 4 x 2048 and
  1 x 2048;
- hf_b4, hf_b1: transformers' `xLSTMForCausalLM` holding the very same tensors (ours built as
  above, its state dict handed over under the HuggingFace names), PEFT's `get_peft_model` with a
  LoraConfig of the same rank, alpha and target maps, `gradient_checkpointing_enable()`
  (non-reentrant), config mode "train", use_cache off. transformers' own PyTorch mLSTM: the
  `xlstm` package is hidden from it, as in a plain transformers install;
- hf_triton_b4, hf_triton_b1 (only when named in --only): the same with the official Triton
  kernels that NX-AI/xLSTM-7b's config names (transformers then runs the `xlstm` package's
  blocks with mlstm_kernels' `chunkwise--triton_xl_chunk`; needs xlstm, mlstm_kernels, einops).
The whole run stays within --budget-s: a job gets the smaller of its own limit and what is left,
and one that cannot get 40 s is skipped with a note.

The adapters are float32 in both (PEFT's `get_peft_model` upcasts them; ours are cast after
`apply_lora`); B starts at zero, so both models' first losses must agree (bf16 rounding apart).
A step is the library's `train_step` for both: bf16 autocast, float32 cross-entropy, backward,
gradient clipping to norm 1, fused AdamW on the adapters; one batch of random token ids (seed 0).
Per job: tokens/s from the median step time (CUDA events) over the timed steps after the first
step and one warm-up step (as many as fit in the job's time, at most --steps; where none fits,
the warm-up step's wall time, steps = 0), the first step's time, the peak memory allocated and
reserved from the first step on (the model's float32 initialisation, freed before, is not
counted), trainable parameters, first and last loss. A job that runs out of memory or time is
reported as such, with the peak and the phase it had reached.

Writes DIR/lora_7b.jsonl (one row per job), DIR/lora_7b.md (the table, tokens/s ratios, the
80 GiB check) and DIR/lora_7b.log (the children's error output); DIR = --out, else $OUT, else
the current directory. --quick: a two-block model (d 128) in float32 on the CPU, 1 x 64 and
2 x 64; exits 1 unless every job ran with finite losses and ours and transformers' first losses
agree to 1e-4.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: the library beside it
    sys.path.insert(0, str(REPO))

from xlstm_kit.bench.scripts import run_child  # noqa: E402
from xlstm_kit.bench.timing import timed_call  # noqa: E402

SEQ = 2048
# name -> (model, kernels, batch, time limit in seconds)
JOBS: dict[str, tuple[str, str, int, float]] = {
    "ours_b4": ("ours", "xlstm_kit", 4, 120),
    "hf_b4": ("hf", "native", 4, 130),
    "ours_b1": ("ours", "xlstm_kit", 1, 90),
    "hf_b1": ("hf", "native", 1, 100),
    "hf_triton_b4": ("hf", "triton", 4, 130),
    "hf_triton_b1": ("hf", "triton", 1, 100),
}
DEFAULT_JOBS = ("ours_b4", "hf_b4", "ours_b1", "hf_b1")
MIN_JOB_S = 40.0  # a job that cannot get this long is skipped (--quick: 5 s)
QUICK_BATCH = {1: 1, 4: 2}


# ------------------------------------------------------------------------------ the child
def _emit(row: dict) -> None:
    print("RESULT " + json.dumps(row), flush=True)


def _config(quick: bool):
    from xlstm_kit import XLSTMConfig

    if quick:
        return XLSTMConfig(family="large", vocab_size=512, d_model=128, n_blocks=2, n_heads=2, qk_dim_factor=0.5,
                           v_dim_factor=1.0, ffn_proj_factor=2.667, round_proj_to=64)
    return XLSTMConfig.from_name("xlstm-7b")


class _LogitsOnly:
    """transformers' model as train_step wants it: tokens -> logits (built lazily: torch.nn)."""

    @staticmethod
    def wrap(model):
        import torch

        class LogitsOnly(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, tokens):
                return self.inner(input_ids=tokens, use_cache=False).logits

        return LogitsOnly(model)


def _build(job: str, opts: dict, device, row: dict):
    """(model to train, the trainable parameters) for `job`, with `row` filled in."""
    import torch

    model_kind, kernels, _, _ = JOBS[job]
    quick, rank = opts["quick"], opts["rank"]
    dtype = torch.float32 if quick else torch.bfloat16
    if model_kind == "hf" and kernels == "native":
        # transformers runs the `xlstm` package's blocks whenever it can import it; hidden, it
        # runs its own PyTorch code, as a plain transformers install does
        sys.modules["xlstm"] = None
    from xlstm_kit import XLSTMLanguageModel
    from xlstm_kit.models.lora import DEFAULT_TARGETS, block_linear_names

    cfg = _config(quick)
    torch.manual_seed(0)
    with torch.device(device):  # a 7B model initialises in seconds on the GPU
        ours = XLSTMLanguageModel(cfg)
    ours = ours.to(dtype)
    targets = sorted(t for t in DEFAULT_TARGETS if t in block_linear_names(ours))
    row.update(params_b=sum(p.numel() for p in ours.parameters()) / 1e9, targets=targets, rank=rank,
               alpha=2.0 * rank, dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(1)  # the adapters' A
    if model_kind == "ours":
        from xlstm_kit.lora import apply_lora

        model = apply_lora(ours, rank, 2.0 * rank, targets)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # as PEFT's get_peft_model keeps adapters
        model.set_activation_checkpointing("all")
        row["setup"] = "xlstm_kit apply_lora, set_activation_checkpointing('all'), eager"
        run = model
    else:
        import peft
        import transformers

        from xlstm_kit.io.hf import config_to_hf, our_key_to_hf
        from xlstm_kit.io.tokenizers import HFSpecialTokens

        hf_cfg = config_to_hf(cfg, HFSpecialTokens(0, 0, None), dtype)
        hf_cfg.update(mode="train", use_cache=False)
        if kernels == "triton":
            hf_cfg.update(chunkwise_kernel="chunkwise--triton_xl_chunk", sequence_kernel="native_sequence__triton",
                          step_kernel="triton", return_last_states=True)
        with torch.device("meta"):
            hf = transformers.xLSTMForCausalLM(transformers.xLSTMConfig(**hf_cfg))
        state = {our_key_to_hf(k): v for k, v in ours.state_dict().items()}
        hf.load_state_dict(state, strict=True, assign=True)  # the same tensors: no second copy
        del ours, state
        from transformers.models.xlstm import modeling_xlstm

        row["hf_blocks"] = "xlstm package" if getattr(modeling_xlstm, "external_xlstm", False) else "transformers"
        config = peft.LoraConfig(r=rank, lora_alpha=2.0 * rank, target_modules=targets, lora_dropout=0.0,
                                 bias="none")
        model = peft.get_peft_model(hf, config)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        row["setup"] = (f"transformers {transformers.__version__} xLSTMForCausalLM ({hf_cfg['chunkwise_kernel']}), "
                        f"peft {peft.__version__} get_peft_model, gradient_checkpointing_enable(use_reentrant=False)")
        run = _LogitsOnly.wrap(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    row.update(trainable=sum(p.numel() for p in trainable),
               adapter_dtype=sorted({str(p.dtype).removeprefix("torch.") for p in trainable}))
    return run, trainable


def child(job: str, opts: dict) -> None:
    import torch

    from xlstm_kit.training import lm_loss, train_step

    t_start = time.monotonic()
    deadline = t_start + opts["limit_s"] - 8.0  # leave time to report
    quick = opts["quick"]
    device = torch.device("cpu" if quick else "cuda")
    if not quick and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (run with --quick on a CPU)")
    if quick:
        # a CPU smoke run, often beside other busy processes (the test suite's): a second thread
        # made the small ops wait for it at barriers (on 2 cores with the other one busy:
        # tests/bench/test_lora_7b.py took 29 s CPU, 17 s with one thread)
        torch.set_num_threads(1)
    cuda = device.type == "cuda"
    _, kernels, batch, _ = JOBS[job]
    B, T = (QUICK_BATCH[batch], 64) if quick else (batch, SEQ)
    row: dict = dict(job=job, kernels=kernels, batch=B, seq=T, torch=torch.__version__, device=str(device),
                     gpu=torch.cuda.get_device_name(device) if cuda else None, status="building")
    run, trainable = _build(job, opts, device, row)
    run.train()
    vocab = _config(quick).vocab_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, T + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    opt = torch.optim.AdamW(trainable, lr=1e-4, fused=cuda)
    precision = "bf16" if cuda else "fp32"

    def step():
        return train_step(run, opt, [(x, y)], lm_loss, lr=1e-4, precision=precision, grad_clip=1.0).loss

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def memory():
        if cuda:
            row.update(peak_gib=torch.cuda.max_memory_allocated(device) / 2**30,
                       reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30)

    if cuda:
        torch.cuda.empty_cache()  # the float32 initialisation's memory
        torch.cuda.reset_peak_memory_stats(device)
    row.update(build_s=time.monotonic() - t_start, status="first step")
    _emit(row)
    losses = []
    try:
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        row["first_step_s"] = time.perf_counter() - t0
        memory()
        row["status"] = "warm-up"
        _emit(row)  # what a timeout leaves
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        est = time.perf_counter() - t0
        row.update(warmup_step_s=est, status="timed steps")
        memory()
        _emit(row)
        # as many timed steps as fit before the deadline, at most --steps; none fitting, the
        # warm-up step (wall clock) is the timing
        n = 2 if quick else min(opts["steps"], int((deadline - time.monotonic()) / max(est, 1e-3)))
        ms = [] if n > 0 else [1e3 * est]
        for _ in range(n):
            loss, t = timed_call(step, device)
            losses.append(loss)
            ms.append(t)
    except torch.cuda.OutOfMemoryError as e:
        memory()
        row.update(status="out of memory", error=str(e).splitlines()[0][:300])
        _emit(row)
        return
    memory()
    vals = [float(v) for v in losses]
    row.update(status="ok", steps=n, step_ms=statistics.median(ms), step_ms_min=min(ms),
               tok_s=B * T / statistics.median(ms) * 1e3, loss_first=vals[0], loss_last=vals[-1],
               loss_finite=all(math.isfinite(v) for v in vals),
               total_gib=torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else None,
               job_s=time.monotonic() - t_start)
    _emit(row)


# ------------------------------------------------------------------------------ the parent
def _fmt(v, spec=",.0f") -> str:
    return "—" if v is None else format(v, spec)


def render(rows: list[dict], header: dict) -> str:
    lines = [f"# LoRA fine-tuning, {header['model']}: xlstm_kit against transformers + PEFT", "",
             f"{header['gpu'] or 'CPU'}; torch {header.get('torch')}; {header['date']}; rank {header['rank']}, "
             f"alpha {2 * header['rank']}; activation/gradient checkpointing on; "
             f"{'float32 (CPU timings mean nothing)' if header.get('quick') else 'bf16 autocast'}, AdamW on the "
             "adapters (float32); tokens/s from the median step (fwd + bwd + update) after a warm-up step; peak: "
             "memory allocated from the first step on.", "",
             "| job | model | batch × seq | tokens/s | step ms | first step s | peak GiB | reserved GiB | "
             "trainable | loss first → last | status |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        what = "xlstm_kit" if r.get("kernels") == "xlstm_kit" else f"transformers+PEFT ({r.get('kernels', '?')})"
        loss = f"{r['loss_first']:.4f} → {r['loss_last']:.4f}" if "loss_first" in r else "—"
        lines.append(f"| {r['job']} | {what} | {r.get('batch', '?')} × {r.get('seq', '?')} | {_fmt(r.get('tok_s'))} | "
                     f"{_fmt(r.get('step_ms'), ',.1f')} | {_fmt(r.get('first_step_s'), '.1f')} | "
                     f"{_fmt(r.get('peak_gib'), '.1f')} | {_fmt(r.get('reserved_gib'), '.1f')} | "
                     f"{_fmt(r.get('trainable'))} | {loss} | {r.get('status', '?')} |")
    by = {r["job"]: r for r in rows}
    notes = []
    for b in (1, 4):
        ours = by.get(f"ours_b{b}", {})
        for k in ("native", "triton"):
            hf = by.get(f"hf_b{b}" if k == "native" else f"hf_triton_b{b}")
            if hf is None or not ours.get("tok_s"):
                continue
            if hf.get("tok_s"):
                ratio = ours["tok_s"] / hf["tok_s"]
                verdict = "" if header.get("quick") else f" (target ≥ 3×: {'met' if ratio >= 3 else 'missed'})"
                notes.append(f"- batch {b}: xlstm_kit {ratio:.2f}× transformers+PEFT ({k}) tokens/s{verdict}; "
                             "first losses "
                             f"{ours['loss_first']:.4f} and {hf['loss_first']:.4f}")
            else:
                notes.append(f"- batch {b}: transformers+PEFT ({k}) has no timing: {hf.get('status')}")
    b4 = by.get("ours_b4", {})
    if b4.get("peak_gib") is not None and b4.get("status") == "ok":
        notes.append(f"- xlstm_kit at {b4['batch']} × {b4['seq']}: peak {b4['peak_gib']:.1f} GiB allocated, "
                     f"{b4['reserved_gib']:.1f} GiB reserved (target: fits in 80 GiB: "
                     f"{'met' if b4['reserved_gib'] < 80 else 'missed'})")
    if notes:
        lines += [""] + notes
    if header.get("notes"):
        lines += [""] + [f"- {n}" for n in header["notes"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated jobs, in that order (default: " + ",".join(DEFAULT_JOBS)
                    + "; also " + ",".join(j for j in JOBS if j not in DEFAULT_JOBS) + ")")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--steps", type=int, default=6, help="most timed steps per job (fewer where the job's time "
                    "allows fewer)")
    ap.add_argument("--budget-s", type=float, default=480, help="the whole run ends within this many seconds; "
                    "jobs that no longer fit are skipped with a note")
    ap.add_argument("--limit-s", type=float, default=None, help="time limit of every job (default: per job)")
    ap.add_argument("--quick", action="store_true", help="a tiny model on the CPU (the test)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-opts", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, json.loads(args.child_opts))
        return 0
    t_start = time.monotonic()
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    jobs = [j.strip() for j in args.only.split(",") if j.strip()] if args.only else list(DEFAULT_JOBS)
    unknown = [j for j in jobs if j not in JOBS]
    if unknown:
        ap.error(f"unknown job(s) {', '.join(unknown)}; choose from {', '.join(JOBS)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if args.quick:
        env["CUDA_VISIBLE_DEVICES"] = ""
    rows, notes = [], []
    header = dict(model="quick (d 128, 2 blocks, float32, CPU)" if args.quick else "xlstm-7b (random weights, bf16)",
                  rank=args.rank, date=time.strftime("%Y-%m-%d"), gpu=None, notes=notes, quick=args.quick)
    min_s = 5.0 if args.quick else MIN_JOB_S
    with open(out / "lora_7b.log", "w") as log:
        for job in jobs:
            left = args.budget_s - (time.monotonic() - t_start) - 5.0
            limit = min(args.limit_s or JOBS[job][3], left)
            if limit < min_s:
                notes.append(f"{job} skipped: {left:.0f} s of the budget left")
                print(notes[-1], flush=True)
                continue
            opts = dict(quick=args.quick, rank=args.rank, steps=args.steps, limit_s=limit)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", job, "--child-opts", json.dumps(opts)]
            res = run_child(cmd, limit, env)
            batch = JOBS[job][2]
            row = dict(job=job, kernels=JOBS[job][1], batch=QUICK_BATCH[batch] if args.quick else batch,
                       seq=64 if args.quick else SEQ)
            row.update(res["results"][-1] if res["results"] else {})
            if res["timed_out"] and row.get("status") == "ok":
                row["note"] = f"reported, then killed at the {limit:.0f} s limit while exiting"
            elif res["timed_out"]:
                row["status"] = f"timed out after {limit:.0f} s (during: {row.get('status', 'start')})"
                if row.get("warmup_step_s"):  # the one step time it had
                    row["status"] += f"; its warm-up step took {row['warmup_step_s']:.1f} s"
            elif res["rc"] != 0:
                last = (res["stderr"].strip().splitlines() or ["?"])[-1]
                row["status"] = f"failed (rc {res['rc']}, during: {row.get('status', 'start')}): {last[:200]}"
            row["wall_s"] = round(res["wall_s"], 1)
            rows.append(row)
            header["gpu"] = header["gpu"] or row.get("gpu")
            header["torch"] = header.get("torch") or row.get("torch")
            log.write(f"## {job}: rc {res['rc']}, {res['wall_s']:.0f} s\n{res['stderr']}\n")
            log.flush()
            print(json.dumps(row), flush=True)
            (out / "lora_7b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (out / "lora_7b.md").write_text(render(rows, header))
    (out / "lora_7b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = render(rows, header)
    (out / "lora_7b.md").write_text(md)
    print(md)
    if args.quick:
        by = {r["job"]: r for r in rows}
        ok = all(r.get("status") == "ok" and r.get("loss_finite") for r in rows) and len(rows) == len(jobs)
        for b in (1, 4):
            o, h = by.get(f"ours_b{b}"), by.get(f"hf_b{b}")
            if o and h and o.get("status") == h.get("status") == "ok":
                ok = ok and abs(o["loss_first"] - h["loss_first"]) < 1e-4 and o["trainable"] == h["trainable"]
        if not ok:
            print("quick check failed: a job did not run, or ours and transformers' first losses differ",
                  file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
