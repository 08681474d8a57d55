"""`xlstm-kit export`: a run or checkpoint (whole or sharded) read whole and written as a
HuggingFace xLSTM folder or an xlstm_kit model folder."""
from __future__ import annotations

import argparse
import sys

from ..io.hf import save_pretrained
from ..io.loading import load_pretrained
from .args import DTYPES


def cmd_export(args: argparse.Namespace) -> int:
    # load_pretrained reads a run's newest checkpoint (an FSDP run's shards assembled in this one
    # process) and folds LoRA adapters in: a HuggingFace folder holds plain weights
    model = load_pretrained(args.checkpoint, dtype=DTYPES.get(args.dtype))
    path = save_pretrained(model, args.out, format=args.format, max_shard_size=args.max_shard_size)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {path} ({args.format}, {n / 1e6:.2f}M parameters, {next(model.parameters()).dtype})",
          file=sys.stderr)
    return 0
