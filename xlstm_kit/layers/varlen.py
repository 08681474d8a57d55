"""Packed sequences (cu_seqlens) through one block: the state resets at every boundary.

`block_varlen(block, x [1, T, d], state, return_state, bounds, cu_seqlens, call)` returns what
`block(x, state, return_state)` returns, with the sequences cu_seqlens[n]:cu[n+1] kept apart:
the output [1, T, d] and, with return_state, one state row per sequence (N rows). `state` is
None (every sequence from zeros) or a block state with N rows.

Blocks whose class sets `supports_cu_seqlens` take cu_seqlens themselves: their ops get it and
their causal convolutions mask the taps that would reach into an earlier document. Those that
also set `cu_seqlens_needs_zero_state` (a convolution, whose per-document input state they do
not read in) do so only from the zero state; continuing N documents from a given state (and any
other block) runs once per sequence here: exact, autograd gives the gradients, at the cost of a
Python loop over sequences.
"""
from __future__ import annotations

import torch


def _rows(state, n: int):
    return None if state is None else type(state)(*(s[n:n + 1] for s in state))


def block_varlen(block, x: torch.Tensor, state, return_state: bool, bounds: list[int], cu_seqlens: torch.Tensor,
                 call):
    """`call(block, x, state, return_state, **kw)` runs the block (plainly, or under activation
    checkpointing); see the module docstring for the rest."""
    if getattr(block, "supports_cu_seqlens", False) and (
            state is None or not getattr(block, "cu_seqlens_needs_zero_state", False)):
        return call(block, x, state, return_state, cu_seqlens=cu_seqlens)
    ys, states = [], []
    for n in range(len(bounds) - 1):
        out = call(block, x[:, bounds[n]:bounds[n + 1]], _rows(state, n), return_state)
        y, s = out if return_state else (out, None)
        ys.append(y)
        states.append(s)
    y = torch.cat(ys, dim=1)
    if not return_state:
        return y
    return y, type(states[0])(*(torch.cat(parts, dim=0) for parts in zip(*states)))
