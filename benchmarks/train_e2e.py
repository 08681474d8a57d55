"""Whole-model training throughput on one GPU, side by side, in one call.

The command on the H200, from the repository root (a folder `.whl` with the peers' wheels, e.g.
`pip download --no-deps xlstm==2.0.6 mlstm-kernels==2.0.6 -d .whl` where there is network: only
those two are needed; the git-ignored `.whl` travels as a carried path; give the call a limit at
least a minute above --budget-s, default 480 s):

    python3 benchmarks/train_e2e.py --wheels .whl --out $OUT

Options: --compile-mode block|model (how xlstm_kit models are compiled: `model.compile_blocks()`,
the library's regional compile and the default, or `torch.compile(model)`), --ckpt off|on|both (activation
checkpointing of every xLSTM block), --only JOB,... (which jobs, in that order), --budget-s S
(the whole call ends within S seconds; jobs that no longer fit are skipped with a note),
--no-profile, --steps N, --quick (a tiny CPU run, used by tests/bench/test_train_e2e.py; its
"kernels" are the ATen ops of the CPU profile).

Jobs (each in its own child process with its own time limit, so that a crash, an out-of-memory
or a hang costs its own row only):
- x10_eager, x10_compile, x71_eager, x71_compile: the xlstm_kit `125M` preset (vocab 50304) as
  xLSTM[1:0] and xLSTM[7:1];
- tf_compile, tf_eager: the Llama-style Transformer of `xlstm_kit.experiments.baselines`
  (TransformerLM(50304, 768, 12 blocks, 12 heads): SwiGLU 2048, RoPE, SDPA), whole-model
  `torch.compile` and eager; the compiled one is the reference of the ratio columns;
- large_compile, large_8k: the xlstm_kit `large-125M` preset (the xLSTM-7B block family at d 768,
  12 blocks, 4 heads: qk head 96, v head 192; vocab 50304), `compile_blocks`, at 16 x 2048 and at
  4 x 8192; tf_compile_8k: the compiled Transformer at 4 x 8192 (the reference of large_8k);
- official: the official `xlstm.xlstm_large` (xlstm 2.0.6, mlstm_kernels 2.0.6) at d 768, 12
  blocks, with xLSTM-7B's defaults otherwise (8 heads, qk_dim_factor 0.5, v_dim_factor 1.0: qk
  head dim 48, v head dim 96; SwiGLU factor 2.667), `chunkwise--triton_limit_chunk`,
  `mode="train"`, `return_last_states=True` (its train mode crashes with False), eager;
- slstm_ops: the sLSTM op (backend triton) forward and forward+backward at (B, T, H, D) =
  (16, 2048, 4, 192) and (16, 1024, 4, 128), bf16;
- mlstm_ops: `mlstm_chunkwise` (backend triton) against mlstm_kernels
  `chunkwise--triton_limit_chunk` at (B, T, H, K, V) = (16, 2048, 4, 384, 384) and
  (8, 2048, 16, 128, 128), bf16.

Every model trains with the library's `train_step`: bf16 autocast, float32 cross-entropy,
backward, gradient clipping to norm 1, fused AdamW, batch 16 x 2048 of random token ids. Per
model: tokens/s and step time (CUDA events per step, median over the timed steps after the first
step and two warm-up steps), first-step time (compilation included), peak memory allocated
during the timed steps, finite losses, parameter count, MFU, and a torch.profiler summary of 2
steps (kernel launches per step, time shares by kernel category, top kernels).

Writes DIR/train_e2e.md (the tables), DIR/train_e2e.jsonl (one raw row per job or kernel
measurement) and DIR/train_e2e.log (the children's error output), DIR = --out, else $OUT, else
the current directory; the tables are printed at the end.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from xlstm_kit.bench.scripts import child_exit, install_wheels, run_child

REPO = Path(__file__).resolve().parent.parent
PEAK_TFLOPS = 989.0  # H200 SXM dense bf16 (no sparsity)
VOCAB, BATCH, SEQ = 50304, 16, 2048
OUT_NAME = "train_e2e"

MFU_FORMULA = (
    "MFU = tokens/s x FLOPs per token / 989 TFLOP/s (H200 dense bf16). FLOPs per token = 6 N + mixing, "
    "N = parameters of 2+ dimensions outside the embedding lookup (the LM head counts); mixing, "
    "forward + backward = 3 x forward: attention 3 x L x 2 d T (causal QK^T and PV, T/2 keys on "
    "average); mLSTM 3 x L_m x H x (2 c (K + V) + 4 K V) (full c x c chunk blocks, c = 64, state "
    "read and update); the sLSTM recurrent matrices R are in N (used once per token)"
)

# ------------------------------------------------------------------------------ jobs
# name -> (kind, settings, time limit in seconds); the order is the default run order: the
# reference first, the ops last but before the least needed rows
JOBS: dict[str, tuple[str, dict, float]] = {
    "tf_compile": ("model", dict(arch="tf", compile=True), 200),
    "x10_eager": ("model", dict(arch="x10", compile=False), 150),
    "x10_compile": ("model", dict(arch="x10", compile=True), 240),
    "x71_eager": ("model", dict(arch="x71", compile=False), 150),
    "x71_compile": ("model", dict(arch="x71", compile=True), 240),
    "slstm_ops": ("slstm_ops", {}, 120),
    "mlstm_ops": ("mlstm_ops", {}, 150),
    "official": ("model", dict(arch="official", compile=False), 150),
    "tf_eager": ("model", dict(arch="tf", compile=False), 120),
    "large_compile": ("model", dict(arch="large", compile=True), 200),
    "tf_compile_8k": ("model", dict(arch="tf", compile=True, batch=4, seq=8192), 200),
    "large_8k": ("model", dict(arch="large", compile=True, batch=4, seq=8192), 200),
    # the faster Transformer reference: no rotary embedding (ratios are against the faster of the two)
    "tf_norope": ("model", dict(arch="tf", compile=True, rope=False), 200),
    "tf_norope_8k": ("model", dict(arch="tf", compile=True, rope=False, batch=4, seq=8192), 200),
    # the paper's blocks over batch sizes, and at 4 x 8192
    **{f"x10_b{b}": ("model", dict(arch="x10", compile=True, batch=b), 200) for b in (1, 4, 8)},
    **{f"x71_b{b}": ("model", dict(arch="x71", compile=True, batch=b), 200) for b in (1, 4, 8)},
    "x10_8k": ("model", dict(arch="x10", compile=True, batch=4, seq=8192), 200),
    # the host's share at small batch: per-block compile with CUDA graphs, and whole-model compile
    **{f"x10_b{b}_graphs": ("model", dict(arch="x10", compile=True, batch=b, compile_mode="block-graphs"), 240)
       for b in (1, 4, 8, 16)},
    "x10_b4_model": ("model", dict(arch="x10", compile=True, batch=4, compile_mode="model"), 240),
    # the official NeurIPS stack: xlstm.xLSTMLMModel, 24 mLSTM blocks, compiled and eager
    **{f"neurips_b{b}": ("model", dict(arch="neurips", compile=True, batch=b), 240) for b in (1, 4, 8, 16)},
    **{f"neurips_eager_b{b}": ("model", dict(arch="neurips", compile=False, batch=b), 150) for b in (1, 4, 8, 16)},
}
XLSTM_ARCHS = ("x10", "x71", "large")
MIN_JOB_S = 25.0  # a job that cannot get this long is skipped rather than started (--quick: 3 s)


def job_list(only: str | None, ckpt: str) -> list[tuple[str, str, dict, float]]:
    """(name, kind, settings, limit) of the jobs to run, in order. With --ckpt both, every xLSTM
    job is followed by its checkpointed twin (NAME_ckpt); with on, the xLSTM jobs checkpoint."""
    names = list(JOBS)
    extra: dict[str, tuple[str, dict, float]] = {}
    if ckpt == "both":
        expanded = []
        for n in names:
            expanded.append(n)
            kind, st, lim = JOBS[n]
            if st.get("arch") in XLSTM_ARCHS:
                extra[n + "_ckpt"] = (kind, dict(st, ckpt=True), lim)
                expanded.append(n + "_ckpt")
        names = expanded
    table = dict(JOBS, **extra)
    if only:
        picked = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in picked if n not in table and n.removesuffix("_ckpt") not in JOBS]
        if unknown:
            raise SystemExit(f"unknown job(s) {', '.join(unknown)}; choose from {', '.join(table)} "
                             f"(xLSTM jobs also as NAME_ckpt)")
        names = picked
    out = []
    for n in names:
        if n in table:
            kind, st, lim = table[n]
        else:  # NAME_ckpt asked for explicitly
            kind, st, lim = JOBS[n.removesuffix("_ckpt")]
            st = dict(st, ckpt=True)
        if ckpt == "on" and st.get("arch") in XLSTM_ARCHS:
            st = dict(st, ckpt=True)
        out.append((n, kind, st, lim))
    return out


# ------------------------------------------------------------------------------ FLOP counts
def matmul_params(model) -> int:
    """Parameters used in one multiply-add per token: every parameter of 2+ dimensions except
    embedding tables (a lookup), each tensor once (a tied head counts once, as the head)."""
    import torch

    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = getattr(model, "lm_head", None)
    head_w = id(head.weight) if head is not None else None
    seen, n = set(), 0
    for p in model.parameters():
        if id(p) in seen or p.ndim < 2 or (id(p) in emb and id(p) != head_w):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def attention_flops(n_layers: int, d_model: int, seq: int) -> float:
    """Causal softmax attention per token, forward + backward: QK^T and PV over T/2 keys on
    average (2 d T forward per layer), backward twice the forward."""
    return 3.0 * n_layers * 2.0 * d_model * seq


def mlstm_flops(n_layers: int, heads: int, k: int, v: int, chunk: int = 64) -> float:
    """Chunkwise mLSTM per token, forward + backward (as `xlstm_kit.bench.registry.flops_per_token`)."""
    return 3.0 * n_layers * heads * (2 * chunk * (k + v) + 4 * k * v)


# ------------------------------------------------------------------------------ profile summary
CATEGORIES = ("slstm", "mlstm", "gemm", "attention", "elementwise", "other")
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "triton_tem_", "splitk", "gemv", "wgmma", "bmm")
_ELEMENTWISE = ("elementwise", "copy", "norm", "reduce", "triton_poi", "triton_per", "triton_red", "fill",
                "memset", "memcpy", "cat", "index", "softmax", "cross_entropy", "nll", "scatter", "gather",
                "multi_tensor", "adam", "vectorized", "unrolled", "where", "pointwise")


def kernel_category(name: str) -> str:
    """The category of a GPU kernel by its name: sLSTM kernels (`_slstm*`), mLSTM kernels (ours
    `_fwd_*`/`_bwd_*`/`_chunk_gates`, mlstm_kernels' `*mlstm*`), GEMMs (cuBLAS/cuBLASLt, CUTLASS,
    Inductor matmul templates), attention (FlashAttention, cuDNN, memory-efficient SDPA),
    elementwise/copy/norm/reduction (ATen, Inductor's fused pointwise/reduction kernels, the
    optimizer's multi-tensor kernels), other."""
    n = name.lower()
    if n.startswith("triton_tem"):  # Inductor's matmul templates
        return "gemm"
    if n.startswith(("triton_poi", "triton_per", "triton_red")):  # Inductor's fused kernels
        return "elementwise"
    if "slstm" in n:
        return "slstm"
    if "mlstm" in n or n.startswith(("_fwd_", "_bwd_", "_chunk_gates")):
        return "mlstm"
    if "flash" in n or "fmha" in n or "sdpa" in n or "attention" in n:
        return "attention"
    if any(g in n for g in _GEMM):
        return "gemm"
    if any(e in n for e in _ELEMENTWISE):
        return "elementwise"
    return "other"


def summarize_kernels(events: list[tuple[str, float, float]], n_steps: int, top: int = 10) -> dict:
    """events: (kernel name, total device ms, launches) over `n_steps` steps -> per-step launches,
    kernel ms, ms and share by category, the `top` kernels by time."""
    total = sum(ms for _, ms, _ in events)
    by_cat = {c: 0.0 for c in CATEGORIES}
    for name, ms, _ in events:
        by_cat[kernel_category(name)] += ms
    ranked = sorted(events, key=lambda e: -e[1])[:top]
    return dict(
        launches_per_step=sum(c for _, _, c in events) / n_steps,
        kernel_ms_per_step=total / n_steps,
        category_ms={c: v / n_steps for c, v in by_cat.items()},
        category_share={c: (v / total if total else 0.0) for c, v in by_cat.items()},
        top=[dict(name=n[:100], ms=ms / n_steps, launches=c / n_steps, category=kernel_category(n))
             for n, ms, c in ranked],
    )


# ============================================================================== child side
def _emit(row: dict) -> None:
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    print("RESULT " + json.dumps(clean(row)), flush=True)


def _env_facts(device) -> dict:
    import torch

    facts = dict(torch=torch.__version__, python=sys.version.split()[0], device=str(device))
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(device)
    return facts


def _logits_only(model):
    """The official model returns (logits, state) with return_last_states=True; train_step wants logits."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens):
            out = self.inner(tokens)
            return out[0] if isinstance(out, tuple) else out

    return LogitsOnly(model)


def _build_model(st: dict, quick: bool, device):
    """-> (model to train, module whose parameters count, facts dict with flops_per_token)."""
    import torch

    arch = st["arch"]
    V, T = (128, 64) if quick else (VOCAB, st.get("seq", SEQ))
    facts: dict = {}
    if arch in XLSTM_ARCHS:
        from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
        from xlstm_kit.bench.registry import flops_per_token

        ratio = "7:1" if arch == "x71" else "1:0"
        over = {}
        if arch == "large":
            cfg = XLSTMConfig.from_name("large-125M", vocab_size=V, context_length=T, **(
                dict(d_model=32, n_blocks=2, n_heads=2) if quick else {}))
        elif quick:
            cfg = XLSTMConfig(vocab_size=V, d_model=32, n_blocks=2, n_heads=2,
                              slstm_at=[1] if arch == "x71" else [], context_length=T, **over)
        else:
            cfg = XLSTMConfig.from_name("125M", vocab_size=V, slstm_at=ratio, **over)
        model = XLSTMLanguageModel(cfg).to(device)
        name = "large-125M preset" if arch == "large" else f"125M preset, slstm_at {ratio!r}"
        facts.update(flops_per_token=flops_per_token(cfg), config=name
                     if not quick else f"tiny d 32, 2 blocks, family {cfg.family}, slstm_at {cfg.slstm_at}",
                     block_types="".join(cfg.block_types))
        if st.get("ckpt"):
            model.set_activation_checkpointing("all")  # the library's own, kept by compile_blocks
        facts["ckpt"] = bool(st.get("ckpt")) and "model.set_activation_checkpointing('all')"
        counted = model
    elif arch == "tf":
        from xlstm_kit.experiments.baselines import TransformerLM

        d, L, H = (32, 2, 2) if quick else (768, 12, 12)
        model = TransformerLM(V, d, L, H, rope=st.get("rope", True)).to(device)
        counted = model
        facts.update(flops_per_token=6.0 * matmul_params(model) + attention_flops(L, d, T),
                     config=f"TransformerLM d {d}, {L} blocks, {H} heads, SwiGLU {model.blocks[0].ffn.down.in_features}"
                            + ("" if model.rope else ", no RoPE"))
    elif arch == "neurips":
        import xlstm
        from xlstm import mLSTMBlockConfig, mLSTMLayerConfig, xLSTMLMModel, xLSTMLMModelConfig

        d, L, H = (32, 2, 2) if quick else (768, 24, 4)
        cfg = xLSTMLMModelConfig(
            vocab_size=V, embedding_dim=d, num_blocks=L, context_length=T, tie_weights=False,
            mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=4, qkv_proj_blocksize=4,
                                                                num_heads=H)),
            slstm_block=None, slstm_at=[])
        torch.manual_seed(0)
        counted = xLSTMLMModel(cfg).to(device)
        counted.reset_parameters()
        model = counted
        inner = 2 * d
        facts.update(flops_per_token=6.0 * matmul_params(counted) + mlstm_flops(L, H, inner // H, inner // H),
                     packages=f"xlstm {xlstm.__version__}",
                     config=f"xlstm.xLSTMLMModel d {d}, {L} mLSTM blocks, {H} heads, conv 4, head-wise blocks 4 "
                            "(its parallel stabilized mLSTM)")
    elif arch == "official":
        import mlstm_kernels
        import xlstm
        from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

        facts["packages"] = f"xlstm {xlstm.__version__} ({os.path.dirname(xlstm.__file__)}), " \
                            f"mlstm_kernels {getattr(mlstm_kernels, '__version__', '?')}"

        kernels = dict(chunkwise_kernel="chunkwise--triton_limit_chunk", sequence_kernel="native_sequence__triton",
                       step_kernel="triton") if device.type == "cuda" else \
            dict(chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
                 step_kernel="native")
        d, L, H = (32, 2, 2) if quick else (768, 12, 8)
        cfg = xLSTMLargeConfig(embedding_dim=d, num_heads=H, num_blocks=L, vocab_size=V, mode="train",
                               return_last_states=True, autocast_kernel_dtype="bfloat16", **kernels)
        torch.manual_seed(0)
        counted = xLSTMLarge(cfg).to(device)
        model = _logits_only(counted)
        k, v = int(d * cfg.qk_dim_factor) // H, int(d * cfg.v_dim_factor) // H
        facts.update(flops_per_token=6.0 * matmul_params(counted) + mlstm_flops(L, H, k, v, cfg.chunk_size),
                     config=f"xlstm_large d {d}, {L} blocks, {H} heads, qk head {k}, v head {v}, "
                            f"ffn factor {cfg.ffn_proj_factor}, {cfg.chunkwise_kernel}, mode train")
    else:
        raise ValueError(arch)
    facts.update(params=sum(p.numel() for p in counted.parameters()), matmul_params=matmul_params(counted))
    return model, facts


def _compile(model, st: dict, mode: str, quick: bool):
    """The model to call: xlstm_kit models per block (`block.compile()`) or whole
    (`torch.compile(model)`) as --compile-mode says; the Transformer whole. --quick compiles
    with the "eager" backend (Dynamo's capture without code generation: no C++ compiler on a CPU)."""
    import torch

    kw = dict(backend="eager") if quick else {}
    mode = st.get("compile_mode", mode)
    if st["arch"] in XLSTM_ARCHS and mode == "block":
        model.compile_blocks(**kw)  # the library's regional compile (what `train --compile` does)
        return model, "per block (model.compile_blocks)"
    if st["arch"] in XLSTM_ARCHS and mode == "block-graphs":
        model.compile_blocks(**(kw or dict(mode="reduce-overhead")))
        return model, "per block with CUDA graphs (model.compile_blocks(mode='reduce-overhead'))"
    return torch.compile(model, **kw), "whole model"


def child_model(name: str, st: dict, opts: dict) -> None:
    import torch

    quick = opts["quick"]
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    if not quick and device.type != "cuda":
        raise RuntimeError("no CUDA device (run with --quick on a CPU)")
    row: dict = dict(job=name, kind="model", arch=st["arch"], compiled=bool(st.get("compile")), **_env_facts(device))
    torch.manual_seed(0)
    model, facts = _build_model(st, quick, device)
    row.update(facts)
    run = model
    if st.get("compile"):
        run, how = _compile(model, st, opts["compile_mode"], quick)
        row["compile_mode"] = how + (" (backend eager)" if quick else "")
    from xlstm_kit.training import lm_loss, train_step

    V, B, T = (128, 2, 64) if quick else (VOCAB, st.get("batch", BATCH), st.get("seq", SEQ))
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, V, (B, T + 1), generator=g).to(device)
    x, y = batch[:, :-1], batch[:, 1:]
    cuda = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    precision = "bf16" if cuda else "fp32"
    model.train()

    def step():
        return train_step(run, opt, [(x, y)], lm_loss, lr=1e-4, precision=precision, grad_clip=1.0).loss

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    row.update(batch=B, seq=T)
    t0 = time.perf_counter()
    losses = [step()]
    sync()
    row["first_step_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_warm = 0 if quick else 2
    for _ in range(n_warm):
        losses.append(step())
    sync()
    est = (time.perf_counter() - t0) / n_warm if n_warm else row["first_step_s"]
    n = opts["steps"] or (2 if quick else max(5, min(20, math.ceil(3.0 / max(est, 1e-3)))))
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            s.record()
            losses.append(step())
            e.record()
        sync()
        ms = [s.elapsed_time(e) for s, e in ev]
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        ms = []
        for _ in range(n):
            t = time.perf_counter()
            losses.append(step())
            ms.append((time.perf_counter() - t) * 1e3)
    vals = [float(l) for l in losses]
    row.update(steps=n, step_ms=statistics.median(ms), step_ms_mean=statistics.fmean(ms), step_ms_min=min(ms),
               loss_first=vals[0], loss_last=vals[-1], loss_finite=all(math.isfinite(v) for v in vals))
    row["tok_s"] = B * T / row["step_ms"] * 1e3
    if st.get("compile"):
        from torch._dynamo.utils import counters

        # graph breaks and graphs: a per-block compile that recompiles per block, or breaks
        # inside blocks, shows here rather than only in a slow step
        row["dynamo_graphs"] = counters["stats"].get("unique_graphs", 0)
        row["dynamo_graph_breaks"] = sum(counters["graph_break"].values())
    row["mfu"] = row["tok_s"] * row["flops_per_token"] / (PEAK_TFLOPS * 1e12) if cuda else None
    _emit(row)  # the timing survives a failing profile

    if opts["profile"]:
        from torch.profiler import ProfilerActivity, profile

        # GPU kernels on CUDA; on a CPU (--quick) the ATen ops stand in for kernels
        n_prof = 2
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            for _ in range(n_prof):
                step()
            sync()
        events = []
        for e in prof.key_averages():
            if cuda:
                d = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            else:
                d = e.self_cpu_time_total
            if d > 0:
                events.append((e.key, d / 1e3, float(e.count)))
        _emit(dict(job=name, profile=summarize_kernels(events, n_prof)))


def _ops_budget(quick: bool):
    from xlstm_kit.bench import timing

    return timing.QUICK if quick else timing.Budget()


def _time_op(name: str, label: str, impl: str, shape: dict, build, work, quick: bool, device) -> None:
    """Time one op (forward, forward+backward) and emit its row; an exception costs this row only."""
    import torch

    from xlstm_kit.bench import timing

    row = dict(job=name, kind="op", op=label, impl=impl, shape=shape)
    try:
        timed = build()
        res = timing.measure_case(timed.fwd, timed.fwbw, device, _ops_budget(quick), flush_cache=device.type == "cuda")
        row.update(res)
        if work.flop and res.get("fwbw_ms"):
            row["fwbw_tflops"] = work.flop / res["fwbw_ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - reported in the row
        row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    _emit(row)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def child_ops(name: str, kind: str, opts: dict) -> None:
    import importlib.util

    import torch

    from xlstm_kit.bench import peers, registry

    quick = opts["quick"]
    device = torch.device("cuda" if torch.cuda.is_available() and not quick else "cpu")
    if not quick and device.type != "cuda":
        raise RuntimeError("no CUDA device (run with --quick on a CPU)")
    _emit(dict(job=name, kind="env", **_env_facts(device)))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ours = registry.Env(device, dtype, backend="triton" if device.type == "cuda" else None)
    if kind == "slstm_ops":
        case = registry.get("slstm_recurrent")
        shapes = [dict(B=2, T=8, H=2, D=8)] if quick else [dict(B=16, T=2048, H=4, D=192), dict(B=16, T=1024, H=4, D=128)]
        for sh in shapes:
            _time_op(name, "slstm_recurrent", "xlstm_kit " + (ours.backend or "torch"), sh,
                     lambda: case.build(sh, ours), case.work(sh, ours), quick, device)
        return
    case = registry.get("mlstm_chunkwise")
    shapes = [dict(B=1, T=64, H=2, K=16, V=16)] if quick else \
        [dict(B=16, T=2048, H=4, K=384, V=384), dict(B=8, T=2048, H=16, K=128, V=128)]
    if not quick:
        shapes.insert(1, dict(B=4, T=2048, H=4, K=384, V=384))
    # limit_chunk: the official kernels' default; xl_chunk: Tiled Flash Linear Attention
    mlstm_peers = [peers.PEERS["mlstm_kernels_limit_chunk"], peers.PEERS["mlstm_kernels_xl_chunk"]]
    for sh in shapes:
        _time_op(name, "mlstm_chunkwise", "xlstm_kit " + (ours.backend or "torch"), sh,
                 lambda: case.build(sh, ours), case.work(sh, ours), quick, device)
        if device.type != "cuda":
            continue  # the peers' kernels are Triton only
        for peer in mlstm_peers:
            if importlib.util.find_spec(peer.package) is None:
                _emit(dict(job=name, kind="op", op="mlstm_chunkwise", impl=peer.label, shape=sh,
                           status=f"not installed (pass --wheels; pip install {peer.pip})"))
                continue
            _time_op(name, "mlstm_chunkwise", peer.label, sh,
                     lambda: peer.build(case.name, sh, registry.Env(device, dtype)), case.work(sh, ours), quick, device)


def child_main(name: str, opts: dict) -> None:
    if opts["quick"]:
        import torch

        # a CPU smoke run, often beside other busy processes (the test suite's): a second thread
        # made the tiny models' small ops wait for it at barriers (on 2 cores with the other one
        # busy: tests/bench/test_train_e2e.py's jobs took 25 s CPU, 10 s with one thread)
        torch.set_num_threads(1)
    kind, st, _ = dict((n, (k, s, lim)) for n, k, s, lim in job_list(name, "off"))[name]
    st = dict(st, **opts.get("settings", {}))
    if kind == "model":
        if st["arch"] in ("official", "neurips"):
            import importlib.util

            if importlib.util.find_spec("xlstm") is None or importlib.util.find_spec("mlstm_kernels") is None:
                _emit(dict(job=name, kind="model", arch=st["arch"],
                           status="not installed (pass --wheels DIR with the xlstm and mlstm-kernels wheels)"))
                return
        child_model(name, st, opts)
    else:
        child_ops(name, kind, opts)


# ============================================================================== parent side
def _fmt(v, spec: str = ",.0f", none: str = "—") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def _fmt_params(n) -> str:
    if not n:
        return "—"
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def _shape_label(shape: dict) -> str:
    return "(" + ", ".join(str(v) for v in shape.values()) + ")"


def render(rows: list[dict], notes: list[str], header: dict, tables_last: bool = False) -> str:
    """The markdown report: the model table (ratios against the compiled Transformer), the op
    table, the top kernels per model, notes. tables_last: the top kernels and notes first (the
    device reply keeps only the end of the output)."""
    models = [r for r in rows if r.get("kind") == "model"]
    ops = [r for r in rows if r.get("kind") == "op"]
    # the faster compiled Transformer (with or without RoPE) at 16 x 2048, and at each other shape
    tf16 = [r for r in models if r.get("job") in ("tf_compile", "tf_norope") and r.get("tok_s")]
    ref = max(tf16, key=lambda r: r["tok_s"]) if tf16 else None
    ref_note = (f"{ref['job']}, the faster compiled Transformer (rows at another batch x length: the faster "
                "compiled Transformer at theirs, else this one)") if ref else ""
    same_shape: dict = {}
    for r in models:
        if r.get("arch") == "tf" and r.get("compiled") and r.get("tok_s"):
            key = (r.get("batch"), r.get("seq"))
            if key not in same_shape or r["tok_s"] > same_shape[key]["tok_s"]:
                same_shape[key] = r
    if ref is None:
        ref = next((r for r in models if r.get("arch") == "tf" and r.get("tok_s")), None)
        ref_note = "tf_eager (no compiled Transformer in this call)" if ref else "none"
    lines = [f"# train_e2e — {header['date']}", ""]
    for k in ("machine", "software", "command", "settings", "wheels"):
        if header.get(k):
            lines.append(f"- {k.capitalize()}: {header[k]}")
    lines += [f"- Reference of the × columns: {ref_note}",
              f"- {MFU_FORMULA}.",
              "- Step ms: median over the timed steps (CUDA events per step) after the first step and 2 warm-up "
              "steps; peak: memory allocated during the timed steps; first step: includes compilation and "
              "autotuning; loss ok: every step's loss finite.",
              "- Kernel shares: torch.profiler over 2 steps, device time by kernel category (sLSTM `*slstm*`; "
              "mLSTM `_fwd_*`/`_bwd_*`/`*mlstm*`; GEMM cuBLAS/CUTLASS/Inductor mm; attention SDPA kernels; "
              "elementwise/copy/norm/reduction incl. Inductor fused and optimizer kernels; other), "
              "as a share of all kernel time.", ""]
    cats = ("slstm", "mlstm", "gemm", "attention", "elementwise", "other")
    head = ["job", "model", "params", "tokens/s", "× TF", "step ms", "MFU", "peak GiB", "× TF mem",
            "first step s", "loss ok", "launches/step", "kernel ms/step"] + [f"{c} %" for c in cats]
    lines += ["## Models", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    default_ref = ref
    for r in models:
        ref = same_shape.get((r.get("batch"), r.get("seq")), default_ref)
        p = r.get("profile") or {}
        share = p.get("category_share") or {}
        if r.get("status") and not r.get("tok_s"):
            cells = [r["job"], r.get("config", r.get("arch", "")), "", r["status"][:160]] + [""] * (len(head) - 4)
        else:
            mode = "compiled " + r.get("compile_mode", "") if r.get("compiled") else "eager"
            if r.get("ckpt"):
                mode += ", ckpt"
            if "dynamo_graphs" in r:
                mode += f", {r['dynamo_graphs']} graphs, {r['dynamo_graph_breaks']} breaks"
            cells = [r["job"], f"{r.get('config', r.get('arch'))} ({mode})", _fmt_params(r.get("params")),
                     _fmt(r.get("tok_s")),
                     _fmt(r["tok_s"] / ref["tok_s"], ".2f") if ref and r.get("tok_s") else "—",
                     _fmt(r.get("step_ms"), ".1f"),
                     _fmt(100 * r["mfu"], ".1f") + " %" if r.get("mfu") is not None else "—",
                     _fmt(r.get("peak_gib"), ".1f"),
                     _fmt(r["peak_gib"] / ref["peak_gib"], ".2f") if ref and r.get("peak_gib") and ref.get("peak_gib") else "—",
                     _fmt(r.get("first_step_s"), ".1f"),
                     "yes" if r.get("loss_finite") else ("NO" if "loss_finite" in r else "—"),
                     _fmt(p.get("launches_per_step")), _fmt(p.get("kernel_ms_per_step"), ".1f")]
            cells += [_fmt(100 * share[c], ".1f") if c in share else "—" for c in cats]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if ops:
        lines += ["", "## Ops (bf16, forward and forward+backward, median ms, L2 flushed)", "",
                  "| op | implementation | shape | fwd ms | fwd+bwd ms | TFLOP/s fwd+bwd | ours ÷ this (fwd+bwd) |",
                  "|---|---|---|---|---|---|---|"]
        for r in ops:
            ours = next((o for o in ops if o["op"] == r["op"] and o["shape"] == r["shape"]
                         and o["impl"].startswith("xlstm_kit")), None)
            ratio = "—"
            if ours is not r and ours and ours.get("fwbw_ms") and r.get("fwbw_ms"):
                ratio = _fmt(ours["fwbw_ms"] / r["fwbw_ms"], ".2f")
            if r.get("status"):
                lines.append(f"| {r['op']} | {r['impl']} | {_shape_label(r['shape'])} | {r['status'][:160]} | | | |")
            else:
                lines.append(f"| {r['op']} | {r['impl']} | {_shape_label(r['shape'])} | {_fmt(r.get('fwd_ms'), '.2f')} | "
                             f"{_fmt(r.get('fwbw_ms'), '.2f')} | {_fmt(r.get('fwbw_tflops'), '.1f')} | {ratio} |")
    tables, lines = lines, []
    profiled = [r for r in models if (r.get("profile") or {}).get("top")]
    if profiled:
        lines += ["## Top kernels per step (ms, launches, category)", ""]
        for r in profiled:
            top = r["profile"]["top"][:6]
            lines.append(f"- {r['job']}: " + "; ".join(
                f"`{t['name'][:60]}` {t['ms']:.1f} ms ×{t['launches']:.0f} ({t['category']})" for t in top))
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    parts = [lines, tables] if tables_last else [tables, lines]
    return "\n\n".join("\n".join(p) for p in parts if p) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder (default: $OUT, else the current folder)")
    ap.add_argument("--wheels", help="folder of wheels (mlstm-kernels, xlstm) to install for the official model")
    ap.add_argument("--only", help="comma-separated jobs, run in that order: " + ",".join(JOBS))
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole call's time budget (default 480)")
    ap.add_argument("--compile-mode", choices=("block", "model"), default="block",
                    help="xlstm_kit models: block.compile() per block (default) or torch.compile(model)")
    ap.add_argument("--ckpt", choices=("off", "on", "both"), default="off",
                    help="activation checkpointing of the xLSTM blocks (both: each xLSTM job twice)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps per model (default: about 3 s worth, 5 to 20)")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler summary")
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU (a test of the mechanics)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-opts", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child_exit(lambda: child_main(args.child, json.loads(args.child_opts)))
    t_start = time.time()
    jobs = job_list(args.only, args.ckpt)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, jsonl_path, log_path = (out_dir / f"{OUT_NAME}{ext}" for ext in (".md", ".jsonl", ".log"))
    jsonl_path.write_text("")
    log = open(log_path, "w")
    notes: list[str] = []
    header = dict(date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  command="python3 benchmarks/train_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  settings=f"batch {2 if args.quick else BATCH} x {64 if args.quick else SEQ}, vocab "
                           f"{128 if args.quick else VOCAB}, bf16 autocast, fused AdamW, clip 1.0; xlstm_kit "
                           f"compile mode {args.compile_mode}; activation checkpointing {args.ckpt}"
                           + ("; --quick: CPU, tiny shapes, compile with backend eager" if args.quick else ""))
    pypath, site = [str(REPO)], None
    if args.wheels:
        site, note = install_wheels(args.wheels, log)
        header["wheels"] = note
        if site:
            pypath.append(site)
    try:
        _run_jobs(args, jobs, header, notes, log, pypath, (md_path, jsonl_path, log_path), t_start)
    finally:
        log.close()
        if site:
            shutil.rmtree(site, ignore_errors=True)
    return 0


def _run_jobs(args, jobs, header, notes, log, pypath, paths, t_start) -> None:
    md_path, jsonl_path, log_path = paths
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(pypath + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    opts = dict(quick=args.quick, compile_mode=args.compile_mode, steps=args.steps,
                profile=not args.no_profile)
    rows: list[dict] = []
    min_job = 3.0 if args.quick else MIN_JOB_S

    def save() -> None:
        md_path.write_text(render(rows, notes, header))

    for name, kind, st, limit in jobs:
        left = args.budget_s - (time.time() - t_start)
        if left < min_job:
            notes.append(f"{name}: skipped, {max(left, 0):.0f} s of the {args.budget_s:.0f} s budget left")
            if kind == "model":
                rows.append(dict(job=name, kind="model", arch=st["arch"], status="skipped (budget)"))
            print(f"# {name}: skipped (budget)", flush=True)
            continue
        timeout = min(limit, left)
        child_opts = dict(opts, settings={k: v for k, v in st.items() if k in ("ckpt", "batch", "seq", "rope", "compile_mode")})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--child-opts", json.dumps(child_opts)]
        res = run_child(cmd, timeout, env)
        merged: dict = {}
        job_rows = []
        for r in res["results"]:
            r["job"] = name
            if r.get("kind") == "env":
                header.setdefault("machine", r.get("gpu") or r.get("device"))
                header.setdefault("software", f"torch {r.get('torch')}, triton {r.get('triton')}, Python {r.get('python')}")
            elif r.get("kind") == "op":
                job_rows.append(r)
            elif "profile" in r and "kind" not in r:
                merged["profile"] = r["profile"]
            else:
                merged.update(r)
        failure = None
        if res["timed_out"]:
            failure = f"timeout after {timeout:.0f} s"
        elif res["rc"] != 0:
            tail = [l for l in res["stderr"].strip().splitlines() if l.strip()]
            failure = f"exit {res['rc']}: {tail[-1][:200] if tail else ''}"
        if kind == "model":
            if not merged:
                merged = dict(job=name, kind="model", arch=st["arch"])
            if failure:
                merged["status"] = failure + (" (after the timing)" if merged.get("tok_s") else "")
            if merged.get("gpu") or merged.get("device"):
                header.setdefault("machine", merged.get("gpu") or merged.get("device"))
                header.setdefault("software", f"torch {merged.get('torch')}, triton {merged.get('triton')}, "
                                              f"Python {merged.get('python')}")
            job_rows.insert(0, merged)
        if failure:
            notes.append(f"{name}: {failure} (stderr tail in {log_path.name})")
            log.write(f"## {name} ({failure})\n{res['stderr']}\n")
            log.flush()
        for r in job_rows:
            r["wall_s"] = res["wall_s"]
            rows.append(r)
            with open(jsonl_path, "a") as fh:
                fh.write(json.dumps(r) + "\n")
        m = job_rows[0] if job_rows else {}
        print(f"# {name}: {res['wall_s']:.0f} s" + (f", {m['tok_s']:,.0f} tok/s, {m['step_ms']:.1f} ms, "
              f"{_fmt(m.get('peak_gib'), '.1f')} GiB" if m.get("tok_s") else "") + (f" — {failure}" if failure else ""),
              flush=True)
        save()
    notes.append(f"total wall time {time.time() - t_start:.0f} s")
    save()
    print(render(rows, notes, header, tables_last=True), flush=True)


if __name__ == "__main__":
    sys.exit(main())
