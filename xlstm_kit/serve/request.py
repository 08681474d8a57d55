"""What a generation request is: its sampling parameters, its state while the engine runs it,
the updates it produces, and the engine's counters for /metrics."""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..errors import XLSTMKitError
from ..generation.sampling import check_sampling
from ..generation.textstream import TextRow

STOP, LENGTH, CANCELLED, SHUTDOWN, ERROR = "stop", "length", "cancelled", "shutdown", "error"
FINISH_REASONS = (STOP, LENGTH, CANCELLED, SHUTDOWN, ERROR)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for (checked by `check`): up to max_tokens new tokens, sampled at
    `temperature` (0: greedy) within top_k / top_p; `seed`: its own generator; `stop`: strings
    that end it (cut from its text); ignore_eos: do not end at the tokenizer's end token."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def check(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise XLSTMKitError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise XLSTMKitError(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise XLSTMKitError(f"stop must hold non-empty strings, got {self.stop!r}")


@dataclass
class Update:
    """What a request produced since its last update: new token ids, the text they completed
    (whole characters, never a stop string), and on its last update why it ended."""

    request: "Request"
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None


_ids = itertools.count()


class Request:
    """One prompt to continue. `stream`: the engine's `deliver` gets an Update per token (else
    only the last one). After `done` is set: `output` (the new ids), `text` (cut at a stop
    string), `finish_reason` (stop, length, cancelled, shutdown, error) and `error`."""

    def __init__(self, prompt: Sequence[int], params: SamplingParams, *, stream: bool = False, sink=None,
                 tag=None):
        self.id = next(_ids)
        self.prompt = np.asarray(prompt, dtype=np.int64)
        self.params = params
        self.stream = stream
        self.sink = sink  # for the caller: where its updates go
        self.tag = tag  # for the caller: e.g. the index of a choice
        self.output: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0  # prompt tokens whose state came from the prefix cache
        self.done = threading.Event()
        self.cancelled = False
        # the scheduler's
        self._pos = 0  # prompt tokens read so far
        self._read_row: int | None = None  # the prompt reader's row while the prompt is read
        self._logits: torch.Tensor | None = None  # [vocab] after prompt[:_pos]
        self._boundary: int | None = None  # a prefix length whose state the cache should keep
        self._row: TextRow | None = None
        self._pieces: list[str] = []
        self._new: list[int] = []
        self._generator: torch.Generator | None = None
        self._submitted = self._admitted = 0.0  # time.perf_counter() at submit and at admission

    def __repr__(self) -> str:
        return f"Request({self.id}, prompt {len(self.prompt)} tokens, {self.finish_reason or 'running'})"


@dataclass
class Stats:
    """Counters for /metrics (read from other threads: plain ints, updated by the engine only)."""

    finished: dict = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens actually run through the model (the cache saves the rest)
    generated_tokens: int = 0
    decode_steps: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_tokens: int = 0
    # seconds summed over the requests that got a first token (the count is `first_tokens`):
    # waiting for a slot (submitted -> admitted), reading the prompt (admitted -> first token
    # sampled), and both together, so that a client's time to first token can be split into
    # the server's share and the HTTP side's
    first_tokens: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0
