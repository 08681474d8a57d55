"""The `xlstm-7b` preset on one GPU with random bf16 weights: does forward+backward
of one 1 x 2048 sequence fit with activation checkpointing, and prefill tokens/s at 8 x 2048
against the official `xlstm_large` 7B model in the same call. Run from the repository root:

    python3 benchmarks/large_7b.py --wheels .whl --out $OUT

Jobs, each in its own child process (a crash or out-of-memory costs its row only):
- fit: xlstm_kit `xlstm-7b`, parameters in bf16, `set_activation_checkpointing("all")`,
  cross-entropy forward+backward of 1 x 2048 random tokens: peak memory, step ms;
- prefill: xlstm_kit `xlstm-7b` in bf16, `model(tokens, return_state=True)` under no_grad at
  8 x 2048 (the prompt read chunkwise, the final state handed on): tokens/s;
- prefill_official: `xlstm.xlstm_large.xLSTMLarge` with its 7B defaults (d 4096, 32 blocks,
  8 heads), bf16, mode "inference", return_last_states=True, its default kernels: tokens/s.
Writes DIR/large_7b.jsonl and prints one line per job (DIR = --out, else $OUT, else .).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from xlstm_kit.bench.scripts import child_env, event_ms, run_child

JOBS = ("fit", "prefill", "prefill_official")


def child(job: str) -> dict:
    import torch

    dev = torch.device("cuda")
    torch.manual_seed(0)
    row: dict = dict(job=job, gpu=torch.cuda.get_device_name(dev), torch=torch.__version__)
    if job == "prefill_official":
        from xlstm.xlstm_large.model import xLSTMLarge, xLSTMLargeConfig

        cfg = xLSTMLargeConfig(embedding_dim=4096, num_heads=8, num_blocks=32, vocab_size=50304,
                               mode="inference", return_last_states=True)
        with dev:
            model = xLSTMLarge(cfg).to(torch.bfloat16).eval()
        row["config"] = f"xLSTMLarge 7B defaults, {cfg.chunkwise_kernel}, mode inference"
    else:
        from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

        cfg = XLSTMConfig.from_name("xlstm-7b")
        with dev:
            model = XLSTMLanguageModel(cfg).to(torch.bfloat16)
        row["config"] = "xlstm_kit xlstm-7b preset"
    row["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    g = torch.Generator(device=dev).manual_seed(0)
    if job == "fit":
        model.train()
        model.set_activation_checkpointing("all")
        tokens = torch.randint(0, 50304, (1, 2049), device=dev, generator=g)

        def step():
            logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            for p in model.parameters():
                p.grad = None
            return loss

        torch.cuda.reset_peak_memory_stats(dev)
        ms = event_ms(step, 3)
        row.update(batch=1, seq=2048, step_ms=statistics.median(ms),
                   peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30,
                   total_gib=torch.cuda.get_device_properties(dev).total_memory / 2**30)
        return row
    model.eval()
    tokens = torch.randint(0, 50304, (8, 2048), device=dev, generator=g)
    with torch.no_grad():
        if job == "prefill":
            ms = event_ms(lambda: model(tokens, return_state=True), 3)
        else:
            ms = event_ms(lambda: model(tokens), 3)
    row.update(batch=8, seq=2048, prefill_ms=statistics.median(ms), tok_s=8 * 2048 / statistics.median(ms) * 1e3,
               peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--wheels", help="folder with the xlstm and mlstm-kernels wheels (official row)")
    ap.add_argument("--only", help="comma-separated jobs of " + ",".join(JOBS))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--limit-s", type=float, default=150, help="time limit per job")
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child)), flush=True)
        return 0
    env = child_env(a.wheels)
    rows = []
    for job in (a.only.split(",") if a.only else JOBS):
        res = run_child([sys.executable, os.path.abspath(__file__), "--child", job], a.limit_s, env)
        got = res["results"] or [dict(job=job, status=f"failed (rc {res['rc']}): {res['stderr'][-300:]}")]
        for r in got:
            rows.append(r)
            print(json.dumps(r), flush=True)
    with open(os.path.join(a.out, "large_7b.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
