"""Packed sequences (`cu_seqlens`) in the chunkwise kernels: the chunk table.

Each sequence n (rows [cu_n, cu_{n+1}) of the batch-1 inputs) is cut into its own chunks of L
steps, the last one partial; the chunks of all sequences are numbered in order ("global
chunks"), so every chunk lies inside one sequence and a sequence boundary is never inside a
chunk. The per-chunk kernels read their chunk's sequence, first row and end row from the
table and mask the rows past the end (as the last chunk of an unpacked sequence); the per-row
and per-chunk buffers (β, ĩ, u, n̄, m, the chunk states) are indexed by global chunk; the
state-passing kernels run one program per (sequence, head) over that sequence's chunks, from
its initial state to its final state; the stabilizer chain of the gate epilogue likewise.

Why chunks per sequence rather than a reset inside a chunk (segment ids, a masked decay matrix,
per-segment cumulative gates): the per-chunk maths stays exactly that of an unpacked sequence
(the same kernels, the same stabilizers, the same float64 gate prologue), so packed results
equal separate runs up to the rounding of the products, and every padded step is one the
kernels already handle. The cost is at most one partial chunk per sequence.

No host synchronisation: the number of global chunks is bounded from the shapes alone,
Σ_n ⌈len_n / L⌉ ≤ ⌈T / L⌉ + N − 1, and the buffers and grids take that bound. The chunks past
the real count ("spare" chunks, seq = −1) are empty: the per-chunk kernels return at once, the
gate prologue writes neutral gates there, and nothing reads them. The table is a few small
torch operations on the device (no .cpu(), no .item()), so the op also traces under
torch.compile with shapes known from the inputs.

The parallel state scan (scan.py) is not used for packed sequences: the sequential state
passing runs one program per sequence and head, which for many sequences fills the GPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton


class ChunkTable(NamedTuple):
    """tab int32 [nc, 4]: per global chunk (sequence or −1 for a spare chunk, first row, end row
    (exclusive), 0); sinfo int32 [n, 4]: per sequence (first row, end row, first global chunk,
    end global chunk); n sequences; nc = the bound on the number of chunks (see the module
    docstring); chunk = the chunk length L."""
    tab: torch.Tensor
    sinfo: torch.Tensor
    n: int
    nc: int
    chunk: int


def num_chunks(T: int, n: int, L: int) -> int:
    """The chunk bound ⌈T / L⌉ + n − 1 of n packed sequences of T steps in all (≥ 1)."""
    return max(1, triton.cdiv(T, L) + n - 1)


def chunk_table(cu_seqlens: torch.Tensor, T: int, L: int) -> ChunkTable:
    """The table of cu_seqlens [N+1] (integer, 0 first, strictly increasing, T last: the caller
    checks) for chunk length L, built on cu_seqlens's device without a host synchronisation."""
    cu = cu_seqlens.to(torch.int64)
    n = cu.numel() - 1
    nc = num_chunks(T, n, L)
    lens = cu[1:] - cu[:-1]
    coff = torch.nn.functional.pad(torch.cumsum((lens + L - 1) // L, 0), (1, 0))     # [N+1]
    g = torch.arange(nc, device=cu.device)
    seq = torch.searchsorted(coff[1:].contiguous(), g, right=True)                # N past the last
    real = seq < n
    s = seq.clamp(max=n - 1)
    row0 = cu[s] + (g - coff[s]) * L
    zero = torch.zeros_like(g)
    tab = torch.stack([torch.where(real, s, -1), torch.where(real, row0, zero), torch.where(real, cu[s + 1], zero),
                       zero], 1)
    sinfo = torch.stack([cu[:-1], cu[1:], coff[:-1], coff[1:]], 1)
    return ChunkTable(tab.to(torch.int32).contiguous(), sinfo.to(torch.int32).contiguous(), n, nc, L)


def first_stabilizers(ms: torch.Tensor, vl: ChunkTable) -> torch.Tensor:
    """Each sequence's initial m [N, H] from the chunk-start stabilizers ms [1, H, nc + N]
    (sequence n's first chunk c0 stores its m at c0 + n)."""
    idx = vl.sinfo[:, 2].long() + torch.arange(vl.n, device=ms.device)
    return ms[0][:, idx].t().contiguous()
