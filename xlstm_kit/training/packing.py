"""Document packing for training and validation: windows cut from a stream of documents, the
recurrent state reset at every document boundary (the model's `cu_seqlens`).

A corpus has documents when it is several files (each file one document) or when its tokenizer
has an EOS token that occurs in the text (each EOS ends a document). `data.load_data(...,
documents=True)` then records the document starts of each split (`TokenData.train_docs`,
`val_docs`: sorted token offsets, the first 0).

Training (`PackedSampler`): the windows of `data.BatchSampler` (same order, same resumability)
over the document stream. A window of L tokens holds the tails and heads of the documents it
meets: documents longer than L are split across windows, short ones share a window, and each
piece starts from the zero state. The b windows of a micro-batch are laid end to end in one
row [1, b·L] with cu_seqlens at every document start and every window start; the target of a
document's last token (the next document's first) is ignored (-100).

Validation (`evaluate_packed`): consecutive windows, and a document that continues into the
next window continues with its state, so the loss is exactly that of evaluating every document
alone (the mean over all of its next-token predictions).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from .data import BatchSampler, DataError

IGNORE = -100  # F.cross_entropy's default ignore_index


class PackedTokens(NamedTuple):
    """Model inputs of a packed micro-batch: tokens [1, T] and cu_seqlens int64 [N+1]."""

    tokens: torch.Tensor
    cu_seqlens: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "PackedTokens":
        return PackedTokens(self.tokens.to(device, non_blocking=non_blocking),
                            self.cu_seqlens.to(device, non_blocking=non_blocking))


def model_forward(model, inputs, **kw):
    """model(tokens) for a plain batch [B, T], model(tokens, cu_seqlens=...) for PackedTokens."""
    if isinstance(inputs, PackedTokens):
        return model(inputs.tokens, cu_seqlens=inputs.cu_seqlens, **kw)
    return model(inputs, **kw)


def window_segments(doc_starts: np.ndarray, start: int, length: int) -> tuple[list[int], np.ndarray]:
    """For the window tokens[start : start+length]: the window-relative starts of its pieces
    (0 and every document start inside) and the mask [length] of positions whose target (the
    next token) is another document's first token."""
    lo = np.searchsorted(doc_starts, start, side="right")
    hi = np.searchsorted(doc_starts, start + length, side="right")
    inside = doc_starts[lo:hi] - start            # document starts in (start, start+length]
    last = np.zeros(length, dtype=bool)
    last[inside - 1] = True                       # a document ends just before the next one starts
    return [0] + [int(c) for c in inside if c < length], last


def packed_windows(tokens: np.ndarray, doc_starts: np.ndarray, starts, seq_len: int
                   ) -> tuple[PackedTokens, torch.Tensor]:
    """The windows tokens[s : s+n] (s in `starts`, n = seq_len or what the stream has left
    before its last token) end to end in one row: (PackedTokens [1, Σn] with cu_seqlens at
    every window and document start, targets [1, Σn] with IGNORE where the next token is
    another document's)."""
    xs, ys, cu, offset = [], [], [], 0
    for s in starts:
        s = int(s)
        n = min(seq_len, len(tokens) - s - 1)
        row = np.asarray(tokens[s:s + n + 1], dtype=np.int64)
        cuts, last = window_segments(doc_starts, s, n)
        y = row[1:].copy()
        y[last] = IGNORE
        cu.extend(offset + c for c in cuts)
        offset += n
        xs.append(row[:n])
        ys.append(y)
    cu.append(offset)
    return (PackedTokens(torch.from_numpy(np.concatenate(xs))[None], torch.tensor(cu, dtype=torch.int64)),
            torch.from_numpy(np.concatenate(ys))[None])


class PackedSampler(BatchSampler):
    """`BatchSampler`'s windows (same order: a pure function of seed and step) as packed
    micro-batches: ((PackedTokens [1, b·seq_len], cu_seqlens), targets [1, b·seq_len])."""

    def __init__(self, tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, global_batch: int,
                 seed: int = 0) -> None:
        super().__init__(tokens, seq_len, global_batch, seed)
        self.doc_starts = np.asarray(doc_starts, dtype=np.int64)

    def batch(self, step: int, *, rank: int = 0, world_size: int = 1, micro: int = 0, n_micro: int = 1):
        per = self.global_batch // (world_size * n_micro)
        if per * world_size * n_micro != self.global_batch:
            raise DataError(f"global batch {self.global_batch} is not divisible by "
                            f"world_size*grad_accum = {world_size * n_micro}")
        first = step * self.global_batch + (micro * world_size + rank) * per
        return packed_windows(self.tokens, self.doc_starts, self.window_starts(first, per), self.seq_len)


def val_windows(tokens: np.ndarray, doc_starts: np.ndarray, seq_len: int, max_windows: int | None,
                rank: int = 0, world_size: int = 1) -> Iterator[tuple[PackedTokens, torch.Tensor, bool]]:
    """Consecutive validation windows of this rank, each as (inputs, targets, continues): whether
    the window's first piece continues the previous window's last document. Windows are dealt
    to ranks in contiguous runs so that a continued document stays on one rank."""
    total = len(tokens)
    if total < 2:
        raise DataError(f"validation split has {total} tokens, too few to evaluate")
    starts = list(range(0, total - 1, seq_len))
    if max_windows is not None:
        starts = starts[:max_windows]
    per = -(-len(starts) // world_size)
    doc_set = set(int(d) for d in doc_starts)
    for s in starts[rank * per:(rank + 1) * per]:
        inputs, targets = packed_windows(tokens, doc_starts, [s], seq_len)
        yield inputs, targets, s > rank * per * seq_len and s not in doc_set


@torch.no_grad()
def evaluate_packed(model, tokens: np.ndarray, doc_starts: np.ndarray, *, seq_len: int, max_windows: int | None,
                    rank: int = 0, world_size: int = 1, autocast=contextlib.nullcontext):
    """Per validation window of this rank: (summed loss in nats, targets [1, n] with IGNORE),
    every document read as if alone, also where it spans windows (its state is carried; on one
    rank exactly, under DDP up to the documents cut where the ranks' runs of windows meet).
    `autocast`: a factory of the context the forward runs in."""
    module = getattr(model, "module", model)  # DistributedDataParallel's model
    device = next(module.parameters()).device
    state = None
    for inputs, targets, continues in val_windows(tokens, doc_starts, seq_len, max_windows, rank, world_size):
        first = int(inputs.cu_seqlens[1])       # the end of the window's first piece (host copy)
        inputs, targets = inputs.to(device), targets.to(device)
        x, cu = inputs.tokens, inputs.cu_seqlens
        with autocast():
            if continues and state is not None:
                # the first piece continues the last document with its state; the rest start
                # from zeros (a separate call keeps that one on the packed path)
                carried = [type(s)(*(t[-1:] for t in s)) for s in state]
                parts = [module(x[:, :first], state=carried, return_state=True)]
                if first < x.shape[1]:
                    parts.append(module(x[:, first:], return_state=True, cu_seqlens=cu[1:] - first))
                logits, state = torch.cat([p[0] for p in parts], dim=1), parts[-1][1]
            else:
                logits, state = module(x, return_state=True, cu_seqlens=cu)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum")
        yield loss, targets
