"""The decode step over the engine's state slots: rows 0..n-1 of `model.init_state(max_batch)`,
updated in place, recorded on CUDA as one graph per batch-size bucket (see engine.py)."""
from __future__ import annotations

import warnings

import torch

from ..errors import XLSTMKitError


def _buckets(max_batch: int) -> list[int]:
    out = [1]
    while out[-1] * 2 < max_batch:
        out.append(out[-1] * 2)
    return sorted(set(out + [max_batch]))


def _copy_into(dst_state, src_state) -> None:
    # a tensor the step updated in place is already there; the rest goes in one multi-tensor copy
    pairs = [(d, s) for ds, ss in zip(dst_state, src_state) for d, s in zip(ds, ss)
             if d is not s and d.numel() and d.data_ptr() != s.data_ptr()]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


class SlotStep:
    """The decode step over slot rows 0..n-1: `step(n)` -> logits [n, vocab] for the tokens in
    `tokens[:n]`, the slots updated in place. CUDA graphs (one per bucket) where `cuda_graph`
    (None: on CUDA); otherwise the eager step on exactly n rows."""

    def __init__(self, model, slots, tokens: torch.Tensor, cuda_graph: bool | None = None):
        self.model, self.slots, self.tokens = model, slots, tokens
        self.graphs: dict[int, tuple] = {}
        use = tokens.is_cuda if cuda_graph is None else cuda_graph
        if use and not tokens.is_cuda:
            raise XLSTMKitError(f"CUDA graphs need a model on a CUDA device, this one is on {tokens.device}")
        self.buckets = _buckets(tokens.shape[0]) if use else []
        if use:
            try:
                self._capture()
            except Exception as e:  # a step that cannot be recorded still decodes, eagerly
                if cuda_graph:
                    raise
                warnings.warn(f"decoding without CUDA graphs ({type(e).__name__}: {e})", RuntimeWarning,
                              stacklevel=2)
                self.graphs, self.buckets = {}, []

    def eager(self, b: int) -> torch.Tensor:
        view = [type(s)(*(x[:b] for x in s)) for s in self.slots]
        logits, new = self.model.step(self.tokens[:b], view, inplace=True, check=False)
        _copy_into(view, new)
        return logits

    def _capture(self) -> None:
        device = self.tokens.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (kernel compilation, lazy allocations) off the capture
            for b in self.buckets:
                for _ in range(2):
                    self.eager(b)
        torch.cuda.current_stream(device).wait_stream(side)
        for b in self.buckets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self.eager(b)
            self.graphs[b] = (graph, logits)

    def __call__(self, n: int) -> torch.Tensor:
        if not self.graphs:
            return self.eager(n)
        b = next(b for b in self.buckets if b >= n)
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]
