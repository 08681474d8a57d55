"""Multi-query associative recall (MQAR, after Arora et al., 2023 "Zoology").

A sequence of length T starts with N key-value pairs ``k_1 v_1 k_2 v_2 ... k_N v_N``; the rest
holds every key once more as a query, in random order at random positions, with filler
token 0 between them. At each query position the model must output the value paired with that
key earlier (the target); nothing else is scored. Keys come from the lower half of the
vocabulary (1 .. V/2 - 1), values from the upper half (V/2 .. V - 1), all keys of a sequence are
distinct. The paper's settings: vocabulary 8192, T from 64 to 512, N from 4 to 64 (MQAR_SETTINGS).

Query placement (`spacing`): "uniform" (any free positions) or "powerlaw", Zoology's: the
query region after the pairs is cut into slots of two tokens, and slot g = 0, 1, ... holds a
query with probability proportional to (g + 1) ** (POWER_A - 1) (drawn without replacement), so
most queries follow the pairs closely and a few come much later.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import XLSTMKitError
from .formal import TaskBatch

FILLER = 0
VOCAB_SIZE = 8192
POWER_A = 0.01
"""Zoology's power-law exponent of the query spacing."""
SPACINGS = ("uniform", "powerlaw")

MQAR_SETTINGS: dict[str, dict] = {
    "zoology": dict(shapes=((64, 4), (128, 8), (256, 16)), widths=(32, 64, 128, 256, 512)),
    "fig5": dict(shapes=((2048, 48), (2048, 96), (2048, 256)), widths=(32, 64, 128, 256, 512)),
}
"""The paper's MQAR settings, (seq_len, pairs) per panel and the model widths swept: "zoology"
(the short settings, as in Zoology) and "fig5" (T = 2048 with 48, 96 and 256 pairs, Figure 5).
Vocabulary 8192 in both."""


def powerlaw_slots(rng: np.random.Generator, batch: int, n_slots: int, k: int, a: float = POWER_A) -> np.ndarray:
    """[batch, k] distinct slot indices in 0 .. n_slots-1, slot g drawn with weight (g+1)**(a-1)
    without replacement (Gumbel top-k: the same law as successive weighted draws)."""
    if k > n_slots:
        raise XLSTMKitError(f"cannot draw {k} distinct slots out of {n_slots}")
    logp = (a - 1.0) * np.log(np.arange(1, n_slots + 1))
    score = logp[None, :] + rng.gumbel(size=(batch, n_slots))
    return np.argsort(-score, axis=1)[:, :k]


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
               vocab_size: int = VOCAB_SIZE, spacing: str = "uniform") -> TaskBatch:
    """A batch of MQAR sequences: inputs, targets [B, seq_len] long, mask [B, seq_len] bool
    (the query positions), lengths [B] (= seq_len), positions [B, num_pairs] (the query
    positions, ascending). `spacing`: see the module doc."""
    check_mqar_shape(seq_len, num_pairs, vocab_size)
    if spacing not in SPACINGS:
        raise XLSTMKitError(f"spacing must be one of {', '.join(SPACINGS)}, got {spacing!r}")
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
    if spacing == "powerlaw":  # two-token slots after the pairs (needs T >= 4N)
        slots = np.sort(powerlaw_slots(rng, B, (T - 2 * N) // 2, N), axis=1) * 2 + 2 * N
    else:  # N distinct query slots among the T - 2N positions after the pairs, sorted; keys shuffled
        slots = np.sort(np.argsort(rng.random((B, T - 2 * N)), axis=1)[:, :N], axis=1) + 2 * N
    order = np.argsort(rng.random((B, N)), axis=1)
    inputs[rows, slots] = keys[rows, order]
    targets[rows, slots] = values[rows, order]
    mask[rows, slots] = True
    return TaskBatch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(mask),
                     torch.full((B,), T, dtype=torch.long), torch.from_numpy(slots.astype(np.int64)))
