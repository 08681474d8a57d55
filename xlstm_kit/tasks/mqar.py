"""Multi-query associative recall (MQAR, after Arora et al., 2023 "Zoology").

A sequence of length T starts with N key-value pairs ``k_1 v_1 k_2 v_2 ... k_N v_N``; the rest
holds every key once more as a query, in random order at random positions, with filler
token 0 between them. At each query position the model must output the value paired with that
key earlier (the target); nothing else is scored. Keys come from the lower half of the
vocabulary (1 .. V/2 - 1), values from the upper half (V/2 .. V - 1), all keys of a sequence are
distinct. The paper's settings: vocabulary 8192, T from 64 to 512, N from 4 to 64.
"""
from __future__ import annotations

import numpy as np
import torch

from .formal import TaskBatch
from ..errors import XLSTMKitError

FILLER = 0
VOCAB_SIZE = 8192


def check_mqar_shape(seq_len: int, num_pairs: int, vocab_size: int = VOCAB_SIZE) -> None:
    """ValueError unless N pairs and N queries fit in seq_len and the key/value halves of the
    vocabulary have room for N distinct keys."""
    for name, v in (("seq_len", seq_len), ("num_pairs", num_pairs), ("vocab_size", vocab_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise XLSTMKitError(f"{name} must be a positive integer, got {v!r}")
    if 3 * num_pairs > seq_len:
        raise XLSTMKitError(f"seq_len={seq_len} is too short for {num_pairs} pairs: the pairs and one query "
                         f"per key need 3 * num_pairs = {3 * num_pairs} tokens")
    if vocab_size // 2 - 1 < num_pairs or vocab_size < 4:
        raise XLSTMKitError(f"vocab_size={vocab_size} has too few keys (1 .. {vocab_size // 2 - 1}) for "
                         f"{num_pairs} distinct keys")


def mqar_batch(rng: np.random.Generator, batch_size: int, seq_len: int, num_pairs: int,
               vocab_size: int = VOCAB_SIZE) -> TaskBatch:
    """A batch of MQAR sequences: inputs, targets [B, seq_len] long, mask [B, seq_len] bool
    (the query positions), lengths [B] (= seq_len)."""
    check_mqar_shape(seq_len, num_pairs, vocab_size)
    if batch_size < 1:
        raise XLSTMKitError(f"batch_size must be positive, got {batch_size}")
    B, T, N, half = batch_size, seq_len, num_pairs, vocab_size // 2
    # distinct keys per row: the first N of a random permutation of 1 .. half-1
    keys = np.argsort(rng.random((B, half - 1)), axis=1)[:, :N] + 1
    values = rng.integers(half, vocab_size, size=(B, N))
    inputs = np.full((B, T), FILLER, dtype=np.int64)
    targets = np.full((B, T), FILLER, dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    inputs[:, 0 : 2 * N : 2] = keys
    inputs[:, 1 : 2 * N : 2] = values
    rows = np.arange(B)[:, None]
    # N distinct query slots among the T - 2N positions after the pairs, sorted; keys shuffled
    slots = np.sort(np.argsort(rng.random((B, T - 2 * N)), axis=1)[:, :N], axis=1) + 2 * N
    order = np.argsort(rng.random((B, N)), axis=1)
    inputs[rows, slots] = keys[rows, order]
    targets[rows, slots] = values[rows, order]
    mask[rows, slots] = True
    return TaskBatch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(mask),
                     torch.full((B,), T, dtype=torch.long))
