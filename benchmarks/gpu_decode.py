"""Generation speed of the language model on one GPU: tokens/s of `generate` with the decode step
eager and replayed as a CUDA graph, for a preset at batch 1 and 32 (weights in float32 and bf16).

    PYTHONPATH=. OUT=$OUT python3 benchmarks/gpu_decode.py [preset]      # default 125m
Writes $OUT/decode.json and prints a markdown table. Checks first that greedy decoding gives the
same tokens both ways. DRY=1 runs a tiny model on the CPU (eager only) to smoke-test the script.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

DRY = os.environ.get("DRY") == "1"
OUT = os.environ.get("OUT", ".")
DEV = "cpu" if DRY else "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def tokens_per_s(model, B, n_new, cuda_graph):
    prompt = torch.randint(0, model.config.vocab_size, (B, 16), device=DEV)
    model.generate(prompt, 4, temperature=0, cuda_graph=cuda_graph)  # compile, allocate
    sync()
    t0 = time.perf_counter()
    model.generate(prompt, n_new, temperature=0, cuda_graph=cuda_graph)
    sync()
    dt = time.perf_counter() - t0
    return B * n_new / dt, dt


def main():
    preset = sys.argv[1] if len(sys.argv) > 1 else "125m"
    cfg = XLSTMConfig(vocab_size=64, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1]) if DRY else XLSTMConfig.from_name(preset)
    rows = []
    print(f"| weights | B | eager tok/s | CUDA graph tok/s | speed-up | same tokens |")
    print("|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        if DRY and dtype is torch.bfloat16:
            continue
        torch.manual_seed(0)
        model = XLSTMLanguageModel(cfg).to(DEV).to(dtype).eval()
        for B in (1, 32):
            prompt = torch.randint(0, cfg.vocab_size, (B, 16), device=DEV)
            a = model.generate(prompt, 24, temperature=0, cuda_graph=False)
            b = a if DRY else model.generate(prompt, 24, temperature=0, cuda_graph=True)
            same = bool(torch.equal(a, b))
            e, _ = tokens_per_s(model, B, 16 if DRY else 128, False)
            g = e if DRY else tokens_per_s(model, B, 256, True)[0]
            row = dict(preset=preset, dtype=str(dtype).split(".")[-1], B=B, eager_tok_s=e, graph_tok_s=g, same_tokens=same)
            rows.append(row)
            print(f"| {row['dtype']} | {B} | {e:.0f} | {g:.0f} | {g / e:.1f}x | {same} |", flush=True)
        del model
    with open(os.path.join(OUT, "decode.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
