"""Where torch.compile breaks the graph in a preset's training step: builds the model, calls
`compile_blocks()`, runs two library `train_step`s (bf16 autocast on CUDA, float32 elsewhere)
and prints Dynamo's graph count and every graph-break reason with its count. A development
tool: a break inside a block splits every block's graph (the blocks share their compiled code).

    python3 benchmarks/graph_breaks.py [--preset 125M] [--slstm-at 1:0] [--blocks 2] [--batch 2] [--seq 256]
                                       [--precision bf16|fp16|fp32]

On the CPU set TRITON_INTERPRET=1 to trace the Triton paths (float32, slow: keep it small).
"""
from __future__ import annotations

import argparse
import json

import torch
from torch._dynamo.utils import counters

from xlstm_kit.models import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.training import lm_loss, train_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="125M")
    ap.add_argument("--slstm-at", default="1:0")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None,
                    help="autocast of the step (default: bf16 on CUDA, fp32 elsewhere)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    over = dict(slstm_at=args.slstm_at) if args.slstm_at else {}
    cfg = XLSTMConfig.from_name(args.preset, vocab_size=256, n_blocks=args.blocks, backend="triton", **over)
    model = XLSTMLanguageModel(cfg).to(dev)
    model.compile_blocks(**({} if cuda else dict(backend="eager")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 256, (args.batch, args.seq + 1), device=dev)
    for _ in range(2):
        train_step(model, opt, [(batch[:, :-1], batch[:, 1:])], lm_loss, lr=1e-4,
                   precision=args.precision or ("bf16" if cuda else "fp32"), grad_clip=1.0)
    print(json.dumps(dict(device=str(dev), stats=dict(counters["stats"]),
                          breaks=sum(counters["graph_break"].values()))))
    for reason, n in counters["graph_break"].most_common():
        print(f"{n} x {reason}")


if __name__ == "__main__":
    main()
