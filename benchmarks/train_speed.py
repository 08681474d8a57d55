"""Training throughput and model FLOP utilisation (MFU) of a preset on one GPU (or the CPU), through the
same `xlstm_kit.train.train` function the command line uses (AdamW fused, bf16 autocast,
gradient clipping; one loss sync per step, as in a real run).

    python3 benchmarks/train_speed.py                      # 125M preset, batch 16 x 2048, bf16 autocast
    python3 benchmarks/train_speed.py --batch-size 32 --seq-len 1024 --steps 30
    python3 benchmarks/train_speed.py --device cpu --preset tiny --vocab-size 256 --batch-size 16 \
        --seq-len 128 --steps 25 --threads 2            # the CPU figure (the demo's settings)

Tokens are random ids of the GPT-2 vocabulary size (throughput does not depend on the text, and
the GPU machine needs no tokenizer package then). Tokens/s is measured over the steps after
--warmup, from the per-step wall time that `train` reports (each step ends with a device sync).

FLOPs per token (documented so that MFU can be recomputed):
  dense  = 6 * N_mm, where N_mm is the number of weights used in a multiply-add once per token:
           every parameter with 2+ dimensions except the embedding table (a lookup, no FLOPs) —
           up/down/gate projections, the head-wise block-diagonal q/k/v maps, the depthwise
           conv kernels, the sLSTM recurrent matrices R (one [D, D] product per gate, head and
           token) and the LM head. Forward 2 FLOPs per multiply-add, backward twice that.
  mixing = 3 * (per mLSTM layer and head, forward) [2*L*(K + V) + 4*K*V]: the chunkwise form
           with chunk length L computes the full L x L score block q k^T (2*L*K per token) and
           its product with V (2*L*V), reads the carried state (q C: 2*K*V) and updates it
           (k v^T: 2*K*V). Causal masking is not subtracted (the kernels do the full blocks);
           backward is counted as twice the forward.
  MFU = tokens/s * (dense + mixing) / peak; "MFU (6N)" uses the dense part alone (the usual
  6N rule, comparable to transformer figures that leave attention out).
Peak: H200 SXM dense bf16 tensor-core rate, 989.4 TFLOP/s (NVIDIA's data sheet; --peak-tflops).
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

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from xlstm_kit.data import TokenData  # noqa: E402
from xlstm_kit.model import XLSTMConfig, XLSTMLanguageModel  # noqa: E402
from xlstm_kit.train import StepEvent, TrainConfig, train  # noqa: E402


class _RandomVocab:
    """Stands in for a tokenizer in TokenData: only the vocabulary size and byte lengths matter."""

    name = "random"
    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def token_byte_lengths(self) -> np.ndarray:
        return np.ones(self.vocab_size, dtype=np.int64)


def flops_per_token(model: XLSTMLanguageModel) -> tuple[float, float]:
    """(dense, mixing) training FLOPs per token, see the module docstring."""
    cfg = model.config
    n_mm = sum(p.numel() for n, p in model.named_parameters() if p.ndim >= 2 and not n.startswith("embedding."))
    if cfg.tie_embeddings:  # the head multiplies by the (shared) embedding matrix
        n_mm += model.embedding.weight.numel()
    dense = 6.0 * n_mm
    n_mlstm = cfg.block_types.count("m")
    k = v = cfg.mlstm_inner_dim // cfg.n_heads
    mixing = 3.0 * n_mlstm * cfg.n_heads * (2 * cfg.chunk_size * (k + v) + 4 * k * v)
    return dense, mixing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="125M")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=25, help="steps in total, --warmup of them untimed")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--vocab-size", type=int, default=50304, help="GPT-2's 50257 padded to a multiple of 64")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--backend", default=None, choices=[None, "torch", "triton"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peak-tflops", type=float, default=989.4)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "train_speed.jsonl"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = XLSTMConfig.from_name(args.preset, vocab_size=args.vocab_size, backend=args.backend)
    model = XLSTMLanguageModel(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    rng = np.random.default_rng(0)
    n_tok = max(args.batch_size * (args.seq_len + 1) * 8, 4 * args.seq_len)
    tokens = rng.integers(0, args.vocab_size, n_tok).astype(np.uint16)
    data = TokenData("random", _RandomVocab(args.vocab_size), tokens, tokens[: 2 * args.seq_len + 2])
    config = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        lr=6e-4, min_lr=6e-5, warmup_steps=min(5, args.steps), eval_at_start=False, eval_interval=0,
        eval_batches=1, checkpoint_interval=0, precision=args.precision,
    )
    events: list[StepEvent] = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    train(model, data, config, None, device=device, handle_signals=False,
          callback=lambda e: events.append(e) if isinstance(e, StepEvent) else None)
    wall = time.perf_counter() - t0
    timed = events[args.warmup:] or events[-1:]
    tok_s = [e.tokens_per_s for e in timed]
    tokens_per_s = len(tok_s) / sum(1.0 / t for t in tok_s)  # total tokens / total time
    dense, mixing = flops_per_token(model)
    peak = args.peak_tflops * 1e12
    row = dict(
        preset=args.preset, params_M=round(n_params / 1e6, 1), batch=args.batch_size, seq_len=args.seq_len,
        grad_accum=args.grad_accum, precision=args.precision, device=torch.cuda.get_device_name(device)
        if device.type == "cuda" else f"cpu x{torch.get_num_threads()} threads", torch=torch.__version__, backend=args.backend or "auto",
        timed_steps=len(tok_s), tokens_per_s=round(tokens_per_s), median_tokens_per_s=round(statistics.median(tok_s)),
        step_ms=round(1000 * args.batch_size * args.seq_len / tokens_per_s, 1),
        gflop_per_token_dense=round(dense / 1e9, 3), gflop_per_token_mixing=round(mixing / 1e9, 3),
        mfu=round(tokens_per_s * (dense + mixing) / peak, 4), mfu_6n=round(tokens_per_s * dense / peak, 4),
        peak_tflops=args.peak_tflops, final_loss=round(events[-1].loss, 4), wall_s=round(wall, 1),
        peak_mem_GiB=round(torch.cuda.max_memory_allocated(device) / 2**30, 1) if device.type == "cuda" else None,
        load_avg_1min=round(os.getloadavg()[0], 2),
    )
    assert math.isfinite(events[-1].loss), "training diverged (non-finite loss)"
    print("| preset | params | batch x seq | precision | tokens/s | step ms | MFU | MFU (6N) | peak mem |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {row['preset']} | {row['params_M']}M | {args.batch_size} x {args.seq_len} | {args.precision} | "
          f"{row['tokens_per_s']:,} | {row['step_ms']} | {100 * row['mfu']:.1f}% | {100 * row['mfu_6n']:.1f}% | "
          f"{row['peak_mem_GiB']} GiB |")
    print(json.dumps(row))
    with open(args.json, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
