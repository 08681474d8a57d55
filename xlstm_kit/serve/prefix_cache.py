"""The prefix-state cache: the recurrent state after a prompt prefix, keyed by its tokens.

A recurrent model's whole past is its fixed-size state, so the state after a prefix (a system
prompt, a few-shot header, an earlier turn of a chat) can be stored and a later prompt that
starts with the same tokens prefills only the rest. There are no blocks: an entry may end at
any token.

Which prefixes are worth storing is not known in advance. Two kinds are stored:
- the state after each whole prompt (with the logits of its last position, so that the same
  prompt again needs no forward pass at all, and the next turn of a chat extends it);
- the state at the point where a new prompt parts from a recent one (their longest common
  prefix): the second request with a shared system prompt marks the boundary, every later one
  starts from it. The recent prompts are kept as token arrays only (a few bytes per token).

Entries are bounded in bytes (the states' and logits' tensors) and evicted least recently used
first. Everything here runs on the scheduler's thread only.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

RECENT_PROMPTS = 256  # prompts remembered (as tokens) to find shared prefixes
RECENT_TOKENS = 1 << 21  # at most this many tokens in them together (8 MiB of int32)


def state_bytes(state) -> int:
    return sum(x.numel() * x.element_size() for s in state for x in s)


def clone_state(state):
    return [type(s)(*(x.clone() for x in s)) for s in state]


@dataclass
class Entry:
    tokens: np.ndarray  # int32 [L]
    state: list  # the model's state (batch 1) after tokens
    logits: torch.Tensor  # [vocab]: the next-token logits after tokens
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    same = a[:n] == b[:n]
    return n if bool(same.all()) else int(same.argmin())


class PrefixCache:
    """LRU of prefix states, at most `max_bytes` of tensors (0: off); prefixes shorter than
    `min_tokens` are not stored (their prefill costs little, their state as much as any)."""

    def __init__(self, max_bytes: int, min_tokens: int = 32):
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self.entries: OrderedDict[bytes, Entry] = OrderedDict()
        self.recent: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._recent_tokens = 0
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, tokens: np.ndarray) -> Entry | None:
        """The longest stored prefix of `tokens` (the whole of it included), marked as used."""
        if not self.enabled:
            return None
        best = None
        for key, e in self.entries.items():
            n = len(e.tokens)
            if n <= len(tokens) and (best is None or n > len(best[1].tokens)) and np.array_equal(tokens[:n], e.tokens):
                best = (key, e)
        if best is None:
            return None
        self.entries.move_to_end(best[0])
        return best[1]

    def boundary(self, tokens: np.ndarray, after: int) -> int | None:
        """Where `tokens` parts from the recent prompt it shares most with, when that is worth a
        stored state: at least min_tokens long, beyond `after` (a prefix already cached) and
        short of the whole prompt (whose state is stored anyway). Remembers `tokens`."""
        if not self.enabled:
            return None
        best = max((common_prefix(tokens, r) for r in self.recent.values()), default=0)
        key = tokens.tobytes()
        if key in self.recent:
            self.recent.move_to_end(key)
        else:
            self.recent[key] = tokens
            self._recent_tokens += len(tokens)
            while len(self.recent) > RECENT_PROMPTS or self._recent_tokens > RECENT_TOKENS:
                self._recent_tokens -= len(self.recent.popitem(last=False)[1])
        return best if self.min_tokens <= best < len(tokens) and best > after else None

    def put(self, tokens: np.ndarray, state, logits: torch.Tensor) -> None:
        """Store a copy of `state` (batch 1) and `logits` [vocab] as the state after `tokens`."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        key = tokens.tobytes()
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        nbytes = state_bytes(state) + logits.numel() * logits.element_size()
        if nbytes > self.max_bytes:
            return
        while self.bytes + nbytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1].nbytes
        self.entries[key] = Entry(tokens.copy(), clone_state(state), logits.detach().clone(), nbytes)
        self.bytes += nbytes
