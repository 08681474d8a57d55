"""Prompt reads for the engine: pieces of a few fixed lengths, recorded as CUDA graphs.

Eagerly, one read of the `125M` model is bound by the host: about a thousand kernel launches
through Python, ~40 ms on an H100 whatever the prompt's length (34 ms under `compile_prefill`),
for ~4 ms of GPU work. Replayed as a CUDA graph a piece still costs about the same up to 64
tokens (2.7-3.0 ms at `125M` compiled, 13 ms at `xlstm-7b` on an H100;
`benchmarks/prompt_pieces.py`), so a read should be as few pieces as it can.

A recurrent model reads a prompt in pieces, each continuing from the state the one before left.
Every (batch bucket b, length L) is one CUDA graph. Models whose blocks take padded rows
(`model.supports_lengths`: the mLSTM, sLSTM and large blocks) read each request's next tokens,
up to `max_piece` of them, in one piece of the shortest length L >= the longest of them (powers
of two from 16): shorter rows are padded, and the padding leaves their states as they were
(`lengths=` of the model's forward). Other models (DPLR blocks) read in pieces of exact
power-of-two lengths, a read of 777 tokens being four replays (512, 256, 8, 1). Either way,
reads of at most `step_below` tokens, all of one length, are that many fused decode steps in one
graph (a decode step is ~6x cheaper than a piece at `125M`).

Each request being read owns a row of `work`, the model's state packed flat ([max_batch, W]
floats): a request's read starts where its row stands. The rows of a piece's requests are
gathered into the graph's input rows (one `index_select`), the graph runs and the rows are put
back (one `index_copy_`). Rows of a bucket past the requests' are stale states computing
nothing anyone reads.

Without CUDA graphs (the CPU, or a model whose forward cannot be recorded) a read is one
eager call: the requests' rows gathered, their tokens packed into one row (`cu_seqlens`, each
request read as if alone from its own state), or one batch when all have the same length.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from .slots import _buckets


def _pow2_below(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


class PromptReader:
    """Reads prompt tokens into rows of `work` (see the module's docstring).

    model: an xlstm_kit language model in eval mode; max_batch: rows (requests read at once at
    most); max_piece: the longest piece (rounded down to a power of two); cuda_graph: record
    the pieces as CUDA graphs (None: on CUDA); pieces: read in pieces even without graphs
    (None: with graphs only; the tests' way to run the pieces on the CPU); step_below: reads of
    at most this many tokens (all of the same length) are that many one-token decode steps
    (`model.step`, the fused step: far fewer kernels than a forward over the sequence), in one
    graph.
    """

    def __init__(self, model, max_batch: int, max_piece: int, device, cuda_graph: bool | None = None,
                 pieces: bool | None = None, step_below: int = 0):
        self.model, self.device = model, torch.device(device)
        template = model.init_state(1, device="meta")
        self.kinds = [(type(s), [tuple(x.shape[1:]) for x in s]) for s in template]
        dtypes = {x.dtype for s in template for x in s}
        if len(dtypes) != 1:
            raise TypeError(f"PromptReader needs one state dtype, the model's state has {sorted(map(str, dtypes))}")
        self.width = sum(x[0].numel() for s in template for x in s)
        dtype = dtypes.pop()
        self.work = torch.zeros(max_batch, self.width, dtype=dtype, device=self.device)
        self.inputs = torch.zeros(max_batch, self.width, dtype=dtype, device=self.device)
        self.padded = bool(getattr(model, "supports_lengths", False))
        top = _pow2_below(max(1, max_piece))
        # padded pieces start at 16 tokens: a shorter one costs what 16 cost (one chunk of the
        # kernels either way); exact pieces need every power of two
        shortest = min(16, top) if self.padded else 1
        self.lengths = [top >> k for k in range(top.bit_length()) if top >> k >= shortest]
        self.step_lengths = list(range(1, min(step_below, top) + 1)) if self.padded else []
        self.use_graphs = self.device.type == "cuda" if cuda_graph is None else cuda_graph
        self.buckets = _buckets(max_batch) if self.use_graphs else []
        self.pieces = self.use_graphs if pieces is None else pieces
        self.step_below = step_below
        # (bucket, L, padded) -> (graph, ids, lengths or None, logits); padded=False: exact pieces or steps
        self.graphs: dict[tuple[int, int, bool], tuple] = {}
        self.replays = 0  # graph replays or eager pieces, for tests and metrics

    # ------------------------------------------------------------------ the state, packed flat
    def unpack(self, flat: torch.Tensor) -> list:
        """The model's state [n rows] as strided views of flat [n, W]."""
        out, off = [], 0
        n = flat.shape[0]
        for cls, shapes in self.kinds:
            parts = []
            for shape in shapes:
                size = int(np.prod(shape)) if shape else 1
                parts.append(flat[:, off:off + size].view(n, *shape))
                off += size
            out.append(cls(*parts))
        return out

    def _inputs(self, n: int) -> list:
        """Input rows 0..n-1 as a state the model reads (contiguous copies of the views)."""
        return [type(s)(*(x.contiguous() for x in s)) for s in self.unpack(self.inputs[:n])]

    @staticmethod
    def _pack(state, out: torch.Tensor) -> None:
        """Write a state of out.shape[0] rows into out [n, W], packed flat."""
        torch.cat([x.reshape(out.shape[0], -1) for s in state for x in s], 1, out=out)

    def row_state(self, row: int) -> list:
        """Row `row` of `work` as a batch-1 state (views: copy before the row is reused)."""
        return self.unpack(self.work[row:row + 1])

    def load(self, row: int, state) -> None:
        """Put a batch-1 state into row `row` (None: zeros, the state before any token)."""
        if state is None:
            self.work[row].zero_()
        else:
            self._pack(state, self.work[row:row + 1])

    # ------------------------------------------------------------------ one piece
    def _piece(self, n: int, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Read ids [n, L] from input rows 0..n-1, in place; logits of the last position [n, V].
        lengths [n] (padded rows): row j reads only its first lengths[j] tokens."""
        if lengths is None and ids.shape[1] <= self.step_below:
            # copies (a view that is contiguous already would not be one): the steps update them
            state = [type(s)(*(x.clone() for x in s)) for s in self.unpack(self.inputs[:n])]
            for t in range(ids.shape[1]):
                last, state = self.model.step(ids[:, t], state, inplace=True, check=False)
            self._pack(state, self.inputs[:n])
            return last
        if lengths is None:
            out, new = self.model(ids, state=self._inputs(n), return_state=True, logits_to_keep=1)
        else:
            out, new = self.model(ids, state=self._inputs(n), return_state=True, lengths=lengths,
                                  logits_to_keep=(lengths - 1)[:, None])
        self._pack(new, self.inputs[:n])
        return out[:, -1]

    def _shapes(self) -> list[tuple[int, int, bool]]:
        """(L, padded?) of every graph: the pieces, then the steps of the padded reads."""
        return [(L, self.padded) for L in self.lengths] + [(L, False) for L in self.step_lengths]

    def capture(self) -> None:
        """Record one graph per (bucket, length); each shape runs twice first, on a side stream
        (kernels compiled, lazy allocations made), as torch.cuda.graphs asks. The graphs share
        one memory pool: they replay one at a time and their outputs are read before the next."""
        if not self.use_graphs:
            return
        bufs = {}
        for b in self.buckets:
            for L, padded in self._shapes():
                ids = torch.zeros(b, L, dtype=torch.long, device=self.device)
                lengths = torch.full((b,), L, dtype=torch.long, device=self.device) if padded else None
                bufs[b, L, padded] = (ids, lengths)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for (b, L, padded), (ids, lengths) in bufs.items():
                for _ in range(2):
                    self._piece(b, ids, lengths)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for (b, L, padded), (ids, lengths) in bufs.items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._piece(b, ids, lengths)
            self.graphs[b, L, padded] = (graph, ids, lengths, logits)
        self._check_graphs()

    def _check_graphs(self) -> None:
        """A probe prompt read through the graphs and eagerly must give the same logits (up to
        the rounding of other pieces): a forward that reads a value on the host while it is
        recorded would replay that value for every prompt. Raises RuntimeError otherwise."""
        vocab = self.model.config.vocab_size
        probe = (np.arange(37, dtype=np.int64) * 7919 + 11) % vocab
        got = []
        for pieces in (True, False):
            self.pieces = pieces
            self.work[0].zero_()
            got.append(self.read([0], [probe])[0].float())
        self.pieces = True
        self.work[0].zero_()
        err = float((got[0] - got[1]).norm() / got[1].norm().clamp_min(1e-30))
        if not err <= 0.05:
            raise RuntimeError(f"prompt reads recorded as CUDA graphs differ from eager ones "
                               f"(relative error {err:.3g} on a probe prompt)")

    def without_graphs(self) -> None:
        """Read eagerly from now on (the graphs could not be recorded)."""
        self.graphs, self.buckets, self.use_graphs, self.pieces = {}, [], False, False

    def warm_up(self) -> None:
        """Without graphs: compile_prefill's graphs for the reads to come (one batch of 1 and of
        2 for lengths 1, 2, 16, 17, 80, 81: below and above a chunk of 64, multiples of 16 and
        not, which Triton specialises on), and the packed reads once."""
        for n in (1, 2):
            for L in (1, 2, 16, 17, 80, 81):
                self._piece(n, torch.zeros(n, L, dtype=torch.long, device=self.device))
        self.read([0, 1], [np.zeros(3, dtype=np.int64), np.zeros(17, dtype=np.int64)])
        self.work[:2].zero_()

    # ------------------------------------------------------------------ a read
    def read(self, rows: Sequence[int], tokens: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """Read tokens[j] (non-empty) into work row rows[j]; the next-token logits [V] after
        each. Rows must be distinct."""
        if not tokens:
            return []
        if not self.pieces:
            return self._read_at_once(rows, tokens)
        limit = self.buckets[-1] if self.buckets else max(1, len(tokens))
        plan = self._plan_padded(tokens) if self.padded else self._plan_pow2(tokens)
        # every row index, token and length of the read in one copy to the device, which the
        # pieces then slice: a copy per piece from pageable memory would wait for the device
        host, pieces, size = [], [], 0
        for L, padded, part in plan:
            for k in range(0, len(part), limit):
                group = part[k:k + limit]  # (request, start, count)
                n = len(group)
                host.append(np.asarray([rows[j] for j, _, _ in group], dtype=np.int64))
                ids = np.zeros((n, L), dtype=np.int64)
                for r, (j, start, count) in enumerate(group):
                    ids[r, :count] = tokens[j][start:start + count]
                host.append(ids.reshape(-1))
                if padded:
                    host.append(np.asarray([count for _, _, count in group], dtype=np.int64))
                pieces.append((L, padded, [j for j, _, _ in group], size))
                size += n * (L + 1 + padded)
        flat = torch.from_numpy(np.concatenate(host))
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        else:
            flat = flat.to(self.device)
        logits: list = [None] * len(tokens)
        for L, padded, group, off in pieces:
            n = len(group)
            ids = flat[off + n:off + n * (L + 1)].view(n, L)
            lengths = flat[off + n * (L + 1):off + n * (L + 2)] if padded else None
            last = self._run(L, flat[off:off + n], ids, lengths)
            for i, j in enumerate(group):
                logits[j] = last[i]  # the last piece of a request is the last to write here
        return logits

    def _plan_padded(self, tokens) -> list:
        """Pieces (L, padded, [(request, start, count)]): every request with tokens left reads
        its next min(left, longest length) of them, in one piece of the shortest length that
        holds the longest of those (or as decode steps where all are the same few)."""
        plan, pos = [], [0] * len(tokens)
        while True:
            part = [(j, pos[j], min(len(t) - pos[j], self.lengths[0])) for j, t in enumerate(tokens) if pos[j] < len(t)]
            if not part:
                return plan
            counts = {c for _, _, c in part}
            if len(counts) == 1 and next(iter(counts)) <= self.step_below:
                plan.append((counts.pop(), False, part))
            else:
                longest = max(counts)
                plan.append((min(L for L in self.lengths if L >= longest), True, part))
            for j, _, c in part:
                pos[j] += c

    def _plan_pow2(self, tokens) -> list:
        """Pieces (L, padded=False, [(request, start, L)]): at each power-of-two length L, from
        the longest down, every request with at least L tokens left reads its next L, so each
        request's pieces come in order."""
        plan, pos = [], [0] * len(tokens)
        for L in self.lengths:
            while True:
                part = [(j, pos[j], L) for j, t in enumerate(tokens) if len(t) - pos[j] >= L]
                if not part:
                    break
                plan.append((L, False, part))
                for j, _, _ in part:
                    pos[j] += L
        return plan

    def _read_at_once(self, rows: Sequence[int], tokens: Sequence[np.ndarray]) -> list[torch.Tensor]:
        n = len(rows)
        idx = torch.tensor(list(rows), device=self.device)
        torch.index_select(self.work, 0, idx, out=self.inputs[:n])
        self.replays += 1
        lengths = [len(t) for t in tokens]
        if len(set(lengths)) == 1:
            last = self._piece(n, torch.as_tensor(np.stack(tokens), device=self.device))
        else:
            cu = torch.tensor([0] + lengths, device=self.device).cumsum(0)
            ids = torch.as_tensor(np.concatenate(tokens), device=self.device)[None]
            out, new = self.model(ids, state=self._inputs(n), return_state=True, cu_seqlens=cu,
                                  logits_to_keep=cu[1:] - 1)
            self._pack(new, self.inputs[:n])
            last = out[0]
        self.work.index_copy_(0, idx, self.inputs[:n])
        return list(last)

    def _run(self, L: int, idx: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """One piece: ids [n, L] read from the work rows idx [n] (padded rows: their first
        lengths[j] tokens); their last logits [n, V]."""
        n = idx.shape[0]
        torch.index_select(self.work, 0, idx, out=self.inputs[:n])
        self.replays += 1
        if self.graphs:
            b = next(b for b in self.buckets if b >= n)
            graph, x, lens, out = self.graphs[b, L, lengths is not None]
            x[:n].copy_(ids)
            if lengths is not None:
                lens[:n].copy_(lengths)
            graph.replay()
            last = out[:n].clone()
        else:
            last = self._piece(n, ids, lengths)
        self.work.index_copy_(0, idx, self.inputs[:n])
        return last
