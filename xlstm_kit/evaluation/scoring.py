"""Log-likelihoods of continuations, packed: what an evaluation harness asks a language model for.

`score_continuations(model, requests)` takes (context ids, continuation ids) pairs and returns,
for each, the summed log-probability of the continuation given the context and whether greedy
decoding would have produced it. It reads every text once and pads nothing:

1. Requests with the same context (the choices of a multiple-choice question) form a group. The
   contexts of a batch of groups run as one packed forward (`cu_seqlens`: each read as if alone)
   that returns each context's recurrent state and the logits of its last position only, which
   score every continuation's first token.
2. The continuations of the batch (all but their last token) run as a second packed forward that
   starts each one from its context's state (one state row per continuation), so a context shared
   by four choices is read once, not four times.

A recurrent state has a fixed size, so continuing from it is exact: the numbers are those of one
forward over context + continuation, up to the rounding of a different chunking.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import XLSTMKitError

__all__ = ["score_continuations", "Score"]

# Rows of logits turned into log-probabilities at a time: the float32 copy of 4096 rows of a
# 50k vocabulary is 0.8 GB, and a whole batch's continuation logits may be many times that.
_SOFTMAX_ROWS = 4096


@dataclass(frozen=True)
class Score:
    """The log-probability of a continuation and whether greedy decoding produces it."""

    logprob: float
    greedy: bool


@dataclass
class _Group:
    context: list[int]
    members: list[int]  # indices into the requests


def _groups(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[_Group]:
    by_context: dict[tuple[int, ...], _Group] = {}
    for i, (ctx, cont) in enumerate(requests):
        if len(ctx) < 1:
            raise XLSTMKitError(f"request {i} has an empty context; it needs at least one token (e.g. BOS)")
        if len(cont) < 1:
            raise XLSTMKitError(f"request {i} has an empty continuation; there is nothing to score")
        key = tuple(int(t) for t in ctx)
        group = by_context.get(key)
        if group is None:
            group = by_context[key] = _Group(list(key), [])
        group.members.append(i)
    # longest first: a batch that does not fit in memory fails at once, not after an hour
    return sorted(by_context.values(), key=lambda g: -(len(g.context) + sum(len(requests[i][1]) for i in g.members)))


def _batches(groups: list[_Group], requests, batch_size: int | None, max_tokens: int | None,
             max_rows: int | None) -> list[list[_Group]]:
    """Consecutive groups, whole, up to `batch_size` requests, `max_tokens` tokens and `max_rows`
    state rows (one per context and one per continuation) per batch; a group larger than a limit
    runs alone."""
    out: list[list[_Group]] = []
    n_req = n_tok = 0
    for g in groups:
        tokens = len(g.context) + sum(len(requests[i][1]) - 1 for i in g.members)
        full = out and ((batch_size is not None and n_req + len(g.members) > batch_size)
                        or (max_tokens is not None and n_tok + tokens > max_tokens)
                        or (max_rows is not None and n_req + len(out[-1]) + 1 + len(g.members) > max_rows))
        if not out or full:
            out.append([])
            n_req = n_tok = 0
        out[-1].append(g)
        n_req += len(g.members)
        n_tok += tokens
    return out


def _token_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits)[target] (float32) and argmax == target per row of logits [N, V]."""
    logprob, greedy = [], []
    for s in range(0, logits.shape[0], _SOFTMAX_ROWS):
        rows = logits[s:s + _SOFTMAX_ROWS].float()
        t = targets[s:s + _SOFTMAX_ROWS]
        picked = rows.gather(1, t[:, None])[:, 0]
        logprob.append(picked - torch.logsumexp(rows, dim=-1))
        greedy.append(rows.argmax(dim=-1) == t)
    return torch.cat(logprob), torch.cat(greedy)


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, device=device).cumsum(0)


def _score_batch(model, batch: list[_Group], requests, device) -> dict[int, Score]:
    # 1. the contexts, packed: their states and the logits of their last positions
    ctx_len = [len(g.context) for g in batch]
    cu = _cu(ctx_len, device)
    tokens = torch.tensor([t for g in batch for t in g.context], device=device)
    last, state = model(tokens[None], return_state=True, cu_seqlens=cu, logits_to_keep=cu[1:] - 1)
    members = [(gi, i) for gi, g in enumerate(batch) for i in g.members]
    rows = torch.tensor([gi for gi, _ in members], device=device)
    first = torch.tensor([requests[i][1][0] for _, i in members], device=device)
    first_lp, first_greedy = _token_scores(last[0].index_select(0, rows), first)
    total = first_lp.double()
    greedy = first_greedy.clone()

    # 2. the continuations' further tokens, each from its context's state, packed
    longer = [(k, i) for k, (_, i) in enumerate(members) if len(requests[i][1]) > 1]
    if longer:
        lengths = [len(requests[i][1]) - 1 for _, i in longer]
        cu = _cu(lengths, device)
        tokens = torch.tensor([t for _, i in longer for t in requests[i][1][:-1]], device=device)
        targets = torch.tensor([t for _, i in longer for t in requests[i][1][1:]], device=device)
        which = rows.index_select(0, torch.tensor([k for k, _ in longer], device=device))
        start = [type(s)(*(x.index_select(0, which) for x in s)) for s in state]
        del state  # the contexts' states: each continuation now has its own copy
        logits = model(tokens[None], state=start, cu_seqlens=cu)[0]
        lp, ok = _token_scores(logits, targets)
        del logits
        seg = torch.repeat_interleave(torch.arange(len(longer), device=device),
                                      torch.tensor(lengths, device=device))
        seg_lp = torch.zeros(len(longer), dtype=torch.float64, device=device).index_add_(0, seg, lp.double())
        seg_wrong = torch.zeros(len(longer), dtype=torch.long, device=device).index_add_(0, seg, (~ok).long())
        at = torch.tensor([k for k, _ in longer], device=device)
        total.index_add_(0, at, seg_lp)
        greedy[at] &= seg_wrong == 0
    return {i: Score(float(lp), bool(ok)) for (_, i), lp, ok in zip(members, total.tolist(), greedy.tolist())}


@torch.no_grad()
def score_continuations(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                        batch_size: int | None = None, max_batch_tokens: int | None = None,
                        max_batch_rows: int | None = None,
                        progress: Callable[[int], None] | None = None) -> list[Score]:
    """The log-probability of each continuation given its context, and whether greedy decoding
    gives it (every continuation token is the most likely one), for (context ids, continuation ids)
    pairs; context and continuation hold at least one token each.

    batch_size: requests per pair of packed forwards (None: no limit); max_batch_tokens: tokens
    per batch; max_batch_rows: recurrent states held at once (a row per context and per
    continuation; the xLSTM-7B's is 0.13 GB). Requests that share a context are never split
    across batches, so a group larger than a limit runs alone. `model` is an xlstm_kit language model (packed
    input with `cu_seqlens` and an initial state per document); it runs in eval mode and is put
    back in its mode afterwards. `progress(n)` is called with the number of requests each batch
    finished.
    """
    for name, v in (("batch_size", batch_size), ("max_batch_tokens", max_batch_tokens),
                    ("max_batch_rows", max_batch_rows)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise XLSTMKitError(f"{name} must be None or an integer >= 1, got {v!r}")
    if not requests:
        return []
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else torch.device("cpu")
    groups = _groups(requests)
    was_training = model.training
    model.eval()
    out: dict[int, Score] = {}
    try:
        for batch in _batches(groups, requests, batch_size, max_batch_tokens, max_batch_rows):
            done = _score_batch(model, batch, requests, device)
            out.update(done)
            if progress is not None:
                progress(len(done))
    finally:
        model.train(was_training)
    return [out[i] for i in range(len(requests))]
