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
        for x, y in val_batches(tokens, seq_len, batch_size, max_batches, rank=dist.rank, world_size=dist.world_size):
            x, y = x.to(device), y.to(device)
            with autocast(device, precision):
                logits = model(x)
            yield lm_loss(logits, y, reduction="sum"), y

    lockstep = _Lockstep(model, device) if dist.enabled and _sharded(model) else None
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
        if lockstep is not None:
            idle = torch.zeros(1, max(1, min(len(tokens), seq_len)), dtype=torch.long, device=device)

            def idle_forward():
                with autocast(device, precision):
                    model(idle)
            lockstep.drain(idle_forward)
    finally:
        if lockstep is not None:
            lockstep.close()
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


class _Lockstep:
    """FSDP gathers each block's weights in every forward, collectively, so all ranks must run
    the same number of forwards; validation shares its windows out unevenly (and reads some
    packed windows in two pieces). Before each forward a rank tells the others (an all-reduce
    of 1); a rank that has run out of work joins the others' forwards with forwards that count
    for nothing (:meth:`drain`, an all-reduce of 0 per round) until no rank has any left."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device, self.idle = device, False
        # before FSDP's own pre-forward hook, whose all-gather must not meet another rank's all-reduce
        self.handle = model.register_forward_pre_hook(self._before, prepend=True)

    def _before(self, *_) -> None:
        if not self.idle:
            torch_dist.all_reduce(torch.ones(1, device=self.device))

    def drain(self, forward) -> None:
        while True:
            busy = torch.zeros(1, device=self.device)
            torch_dist.all_reduce(busy)
            if not busy.item():
                return
            self.idle = True
            try:
                forward()
            finally:
                self.idle = False

    def close(self) -> None:
        self.handle.remove()


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def val_batch_count(n_tokens: int, seq_len: int, batch_size: int) -> int:
    """How many batches ``data.val_batches`` makes of a whole split of ``n_tokens`` tokens."""
    seq = min(seq_len, n_tokens - 1)
    return -(-((n_tokens - 1) // seq) // batch_size) if seq >= 1 else 0
