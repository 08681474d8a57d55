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
import triton.language as tl


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


@triton.jit
def _chunk_table(cu_ptr, tab_ptr, sinfo_ptr, N, NCB, L: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr):
    """Program n < N: sequence n's row of sinfo and its chunks' rows of tab, its first global
    chunk being Σ_{j<n} ⌈len_j / L⌉ (summed here from cu, so the programs are independent);
    program N: the spare chunks, from the real count up to NCB, marked −1."""
    n = tl.program_id(0)
    coff = n * 0
    for j0 in range(0, n, BN):
        j = j0 + tl.arange(0, BN)
        m = j < n
        a = tl.load(cu_ptr + j, mask=m, other=0).to(tl.int32)
        b = tl.load(cu_ptr + j + 1, mask=m, other=0).to(tl.int32)
        coff += tl.sum(tl.where(m, (b - a + L - 1) // L, 0), axis=0)
    jc = tl.arange(0, BC)
    if n < N:
        bos = tl.load(cu_ptr + n).to(tl.int32)
        eos = tl.load(cu_ptr + n + 1).to(tl.int32)
        nch = (eos - bos + L - 1) // L
        i4 = tl.arange(0, 4)
        tl.store(sinfo_ptr + n * 4 + i4, tl.where(i4 == 0, bos, tl.where(i4 == 1, eos, tl.where(i4 == 2, coff, coff + nch))))
        for j0 in range(0, nch, BC):
            j = j0 + jc
            m = j < nch
            g = (coff + j).to(tl.int64) * 4
            tl.store(tab_ptr + g, n + j * 0, mask=m)
            tl.store(tab_ptr + g + 1, bos + j * L, mask=m)
            tl.store(tab_ptr + g + 2, eos + j * 0, mask=m)
            tl.store(tab_ptr + g + 3, j * 0, mask=m)
    else:
        for g0 in range(coff, NCB, BC):
            gi = g0 + jc
            m = gi < NCB
            g = gi.to(tl.int64) * 4
            tl.store(tab_ptr + g, jc * 0 - 1, mask=m)
            tl.store(tab_ptr + g + 1, jc * 0, mask=m)
            tl.store(tab_ptr + g + 2, jc * 0, mask=m)
            tl.store(tab_ptr + g + 3, jc * 0, mask=m)


def chunk_table(cu_seqlens: torch.Tensor, T: int, L: int) -> ChunkTable:
    """The table of cu_seqlens [N+1] (int32 or int64, 0 first, strictly increasing, T last: the
    caller checks) for chunk length L: one launch on cu_seqlens's device, no host
    synchronisation."""
    n = cu_seqlens.numel() - 1
    nc = num_chunks(T, n, L)
    tab = torch.empty(nc, 4, device=cu_seqlens.device, dtype=torch.int32)
    sinfo = torch.empty(n, 4, device=cu_seqlens.device, dtype=torch.int32)
    _chunk_table[(n + 1,)](cu_seqlens, tab, sinfo, n, nc, L=L, BN=min(1024, max(16, triton.next_power_of_2(n))),
                           BC=64, num_warps=1)
    return ChunkTable(tab, sinfo, n, nc, L)


def first_stabilizers(ms: torch.Tensor, vl: ChunkTable) -> torch.Tensor:
    """Each sequence's initial m [N, H] from the chunk-start stabilizers ms [1, H, nc + N]
    (sequence n's first chunk c0 stores its m at c0 + n)."""
    idx = vl.sinfo[:, 2].long() + torch.arange(vl.n, device=ms.device)
    return ms[0][:, idx].t().contiguous()
