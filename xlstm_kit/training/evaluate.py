"""Validation: loss, bits per byte and perplexity over a token stream (or packed documents)."""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn

from .data import val_batches
from .distributed import DistInfo
from .events import EvalMetrics
from .packing import IGNORE, evaluate_packed
from .step import autocast, lm_loss


@torch.no_grad()
def evaluate(
    model: nn.Module,
    tokens: np.ndarray,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int | None,
    token_bytes: np.ndarray,
    device: torch.device | str = "cpu",
    precision: str = "auto",
    dist: DistInfo | None = None,
    doc_starts: np.ndarray | None = None,
) -> EvalMetrics:
    """Mean next-token loss over fixed validation windows (see ``data.val_batches``); with
    ``doc_starts`` (document starts in ``tokens``) over packed documents, each read as if alone
    (``packing.evaluate_packed``).

    Bits per byte = summed loss (nats) / (ln 2 · UTF-8 bytes of the target tokens), using the
    tokenizer's byte length of each token (``token_bytes`` [vocab]), so byte-level and BPE
    models are comparable. Under DDP the windows are shared out and the sums all-reduced.
    """
    dist = dist or DistInfo()
    device = torch.device(device)
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # loss nats, tokens, bytes, batches
    def plain():
        done = 0
        for x, y in val_batches(tokens, seq_len, batch_size, max_batches, rank=dist.rank, world_size=dist.world_size):
            x, y = x.to(device), y.to(device)
            with autocast(device, precision):
                logits = model(x)
            done += 1
            yield lm_loss(logits, y, reduction="sum"), y
        if dist.enabled and _sharded(model):
            # FSDP gathers each block's weights in every forward, collectively: a rank with fewer
            # batches than another runs forwards that count for nothing until all ran as many
            total = -(-_windows(len(tokens), seq_len, batch_size, max_batches) // batch_size)
            x, _ = next(val_batches(tokens, seq_len, 1, 1))
            for _ in range(-(-total // dist.world_size) - done):
                with autocast(device, precision):
                    model(x.to(device))

    try:
        losses = plain() if doc_starts is None else evaluate_packed(
            model, tokens, doc_starts, seq_len=seq_len, max_windows=None if max_batches is None else
            max_batches * batch_size, rank=dist.rank, world_size=dist.world_size,
            autocast=lambda: autocast(device, precision))
        for loss, y in losses:
            y = y[y != IGNORE].cpu().numpy()
            sums[0] += loss.double().item()
            sums[1] += y.size
            sums[2] += float(token_bytes[y].sum())
            sums[3] += 1
        if doc_starts is not None:  # windows one by one (their state carried): count batches of them
            sums[3] = math.ceil(sums[3] / batch_size)
    finally:
        model.train(was_training)
    if dist.enabled:
        sums = sums.to(device)
        torch_dist.all_reduce(sums)
        sums = sums.cpu()
    loss_sum, n_tok, n_bytes, n_batches = sums.tolist()
    loss = loss_sum / max(n_tok, 1.0)
    return EvalMetrics(
        loss=loss,
        bits_per_byte=loss_sum / (math.log(2) * max(n_bytes, 1.0)),
        perplexity=math.exp(min(loss, 700.0)),
        tokens=int(n_tok),
        batches=int(n_batches),
        split_batches=val_batch_count(len(tokens), seq_len, batch_size),
    )


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _windows(n_tokens: int, seq_len: int, batch_size: int, max_batches: int | None) -> int:
    """How many windows ``data.val_batches`` reads of a split of ``n_tokens`` tokens."""
    seq = min(seq_len, n_tokens - 1)
    n = (n_tokens - 1) // seq if seq >= 1 else 0
    return n if max_batches is None else min(n, max_batches * batch_size)


def val_batch_count(n_tokens: int, seq_len: int, batch_size: int) -> int:
    """How many batches ``data.val_batches`` makes of a whole split of ``n_tokens`` tokens."""
    seq = min(seq_len, n_tokens - 1)
    return -(-((n_tokens - 1) // seq) // batch_size) if seq >= 1 else 0
