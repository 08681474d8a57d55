"""Turning next-token logits into token ids: temperature, top-k, top-p (nucleus) and the
repetition penalty, with the checks of their arguments."""
from __future__ import annotations

import math

import torch

from ..errors import XLSTMKitError


# A penalty scales logits by up to this factor either way: a float32 logit multiplied or divided
# by more overflows to inf (1e-40 did: inf - inf = NaN probabilities), and a factor of a million
# already makes a token certain or impossible.
MAX_REPETITION_PENALTY = 1e6


def _is_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def check_sampling(temperature, top_k=None, top_p=None, repetition_penalty=1.0) -> None:
    """XLSTMKitError unless temperature >= 0, top_k >= 1, top_p in (0, 1] and repetition_penalty in
    [1e-6, 1e6]."""
    if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise XLSTMKitError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise XLSTMKitError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (not _is_number(top_p) or not 0 < top_p <= 1):
        raise XLSTMKitError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if not _is_number(repetition_penalty) or not 1 / MAX_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
        raise XLSTMKitError(f"repetition_penalty must be a number in [{1 / MAX_REPETITION_PENALTY:g}, "
                            f"{MAX_REPETITION_PENALTY:g}] (1 = none), got {repetition_penalty!r}")


def apply_repetition_penalty(logits: torch.Tensor, present: torch.Tensor, penalty: float) -> torch.Tensor:
    """The CTRL rule (Keskar et al. 2019, as in transformers): the logit of every token already in
    the sequence is divided by `penalty` when positive and multiplied by it when negative, so a
    penalty > 1 always makes repeating less likely.

    logits [B, V]; present [B, V] bool (the tokens of each row's prompt and continuation so far).
    Returns float32 logits [B, V].
    """
    logits = logits.float()
    if penalty == 1:
        return logits
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(present, penalised, logits)


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of `logits` [B, V] -> [B] (int64).

    temperature 0: argmax. Otherwise softmax(logits / temperature) restricted to the `top_k`
    most likely tokens and then to the smallest set whose probability reaches `top_p` (nucleus).
    """
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted so that the best logit is 0, and divided in float64: a tiny temperature (1e-45)
    # then sends the others to -inf (greedy in effect) instead of overflowing to inf - inf = NaN.
    logits = (logits - logits.amax(dim=-1, keepdim=True)).double() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
