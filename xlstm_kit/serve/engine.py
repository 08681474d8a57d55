"""The scheduler: continuous batching of generation requests over fixed-size state slots.

A recurrent model's state does not grow with the text, so a batch of running requests is a
fixed block of memory: `model.init_state(max_batch)` holds one row (slot) per request. The
decoding requests occupy rows 0..n-1; one `model.step` over those rows advances them all by a
token, updating the slots in place (`inplace=True`, so the mLSTM's large C is read and written
once). A request that ends (end token, stop string, length) or is cancelled leaves at once: the
last row is copied into its slot, so the running rows stay contiguous and the step never
gathers or scatters states.

One thread runs the loop; each pass is a token boundary:
1. cancelled requests leave; waiting requests take free slots (first come, first served);
2. prompts are read, at most `prefill_chunk` tokens of each per pass, so that a long prompt is
   read in pieces between decode steps and the running streams keep flowing. Each request
   being read owns a row of the prompt reader's state rows (`prefill.py`), and all the prompt
   tokens of a pass are read together in pieces of power-of-two lengths, CUDA graphs on a
   GPU; a request's first token is sampled from its prompt's logits and sent at once, and it
   joins the decoding rows;
3. one decode step over the decoding rows and one token sampled for each, on the device; the
   tokens of the step before are then taken on the host (one step in flight, its tokens copied
   to the host behind it, so that the host's work overlaps the device's).

On CUDA the step over rows 0..b-1 is recorded once per batch-size bucket b (powers of two up
to max_batch) as a CUDA graph that reads and writes the slots themselves; rows n..b-1 of a
bucket are free slots computing nothing anyone reads. On the CPU the step runs eagerly on
exactly n rows. Prompt reads are recorded too, one graph per (bucket, piece length); the
reader holds two more blocks of min(max_batch, READ_ROWS) states (its rows and the graphs'
input rows), and a request waits for one of its rows to be read.

Greedy requests get the tokens `generate` gives each prompt alone: each row of the step
depends on its own state only, and a prompt read in pieces reaches the state of one read (up
to the rounding of kernels picked per shape). A request with a seed samples with its own
generator, as `generate(seed=...)` does for one prompt.

Prompts are looked up in the prefix-state cache (`prefix_cache.py`) first, and states worth
keeping are stored there as prompts are read.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
import warnings
from collections import deque
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import XLSTMKitError
from ..generation.sampling import sample_next
from ..generation.textstream import TextRow
from .prefill import PromptReader
from .prefix_cache import PrefixCache, state_bytes
from .request import CANCELLED, ERROR, LENGTH, SHUTDOWN, STOP, Request, SamplingParams, Stats, Update
from .slots import SlotStep, _copy_into

# Requests whose prompts are read at once at most: each holds a state row of the prompt reader
# (two rows with the graphs' inputs; an xlstm-7b state is ~134 MB); this also bounds a pass's
# read to READ_ROWS * prefill_chunk tokens
READ_ROWS = 16
# reads of at most this many tokens (all of one length) run as fused decode steps: on an H100,
# 1 or 2 steps beat a prompt piece at every batch up to 8, 4 steps lose at batch 8
# (benchmarks/prompt_pieces.py)
READ_STEPS_BELOW = 2


class EngineBusy(XLSTMKitError):
    """The queue of waiting requests is full."""


class EngineClosed(XLSTMKitError):
    """The engine is shutting down and takes no new requests."""


def _to_host(ids: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Start copying a step's tokens to the host: (the copy, an event recorded after it, None off
    CUDA). A plain `.tolist()` of CUDA tensors waits for everything queued before it, so taking
    a step's tokens after launching the next step would wait for that one too and leave the
    device idle while the host handles the tokens."""
    if ids.device.type != "cuda":
        return ids, None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(ids.device))
    return host, copied


class Engine:
    """Continuous batching for one model (see the module's docstring).

    max_batch: state slots (requests decoding or reading their prompt at once); max_queue:
    requests that may wait for a slot (submit raises EngineBusy beyond); prefill_chunk: prompt
    tokens of each request read per pass; prefix_cache_bytes: the prefix-state cache's bound (0: off);
    cuda_graph: None = on CUDA; deliver(updates), called from the engine's thread after each
    pass, receives the Updates of that pass.
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 8, max_queue: int = 64, prefill_chunk: int = 512,
                 prefix_cache_bytes: int = 1 << 30, prefix_min_tokens: int = 32, cuda_graph: bool | None = None,
                 deliver: Callable[[list[Update]], None] | None = None):
        for name, v, lo in (("max_batch", max_batch, 1), ("max_queue", max_queue, 0),
                            ("prefill_chunk", prefill_chunk, 1), ("prefix_cache_bytes", prefix_cache_bytes, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise XLSTMKitError(f"{name} must be an integer >= {lo}, got {v!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab = model.config.vocab_size
        self.device = next(model.parameters()).device
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = frozenset() if eos is None else frozenset([eos])
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.cuda_graph = cuda_graph
        self.deliver = deliver
        self.cache = PrefixCache(prefix_cache_bytes, prefix_min_tokens)
        self.stats = Stats()
        self.slots = model.init_state(max_batch, device=self.device)
        self.slot_bytes = state_bytes(self.slots) // max_batch
        # whether a state at a prefix boundary can be stored (with float32 logits at most)
        self._boundary_fits = self.cache.enabled and self.slot_bytes + 4 * self.vocab <= prefix_cache_bytes
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.seed()
        self.decoding: list[Request] = []  # decoding[i] is in slot i
        self.prefilling: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._queued = 0  # submitted, not yet in a slot
        self._cancel_asked = False
        self._closing = False
        self._deadline = float("inf")
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.step: SlotStep | None = None
        self.reader: PromptReader | None = None
        self._free_rows = list(range(min(max_batch, READ_ROWS)))  # the reader's rows no request holds
        self._inflight: tuple | None = None  # a step's tokens not yet taken: (ids, copied, rows)

    # ------------------------------------------------------------------ outside the engine's thread
    def start(self) -> "Engine":
        """Start the loop (on CUDA: record the decode and prompt-read graphs first; with
        model.compile_prefill: compile the prompt reads); returns once it runs."""
        self._thread = threading.Thread(target=self._main, name="xlstm-kit-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure
        return self

    def submit(self, requests: Sequence[Request]) -> None:
        """Queue requests (all or none): EngineBusy when the queue cannot take them all,
        EngineClosed while shutting down."""
        for r in requests:
            r.params.check()
            if r.prompt.ndim != 1 or not len(r.prompt) or r.prompt.min() < 0 or r.prompt.max() >= self.vocab:
                raise XLSTMKitError(f"a prompt must be a non-empty list of token ids in [0, {self.vocab}), "
                                    f"got {r.prompt.tolist()[:8]}{'...' if r.prompt.size > 8 else ''}")
        with self._cv:
            if self._closing or self._failure is not None:
                raise EngineClosed("the server is shutting down")
            if self._queued + len(requests) > self.max_queue + max(0, self.max_batch - self.running):
                raise EngineBusy(f"{self._queued} requests are waiting for one of {self.max_batch} slots")
            self._queued += len(requests)
            now = time.perf_counter()
            for r in requests:
                r._submitted = now
            self._incoming.extend(requests)
            self._cv.notify()

    def cancel(self, request: Request) -> None:
        """End a request at the next token boundary (its slot is free for the next pass)."""
        if request.done.is_set():
            return
        with self._cv:
            request.cancelled = True
            self._cancel_asked = True
            self._cv.notify()

    def close(self, grace: float = 0.0) -> None:
        """Take no new requests; those accepted may run for `grace` seconds more, then end with
        finish_reason "shutdown". The thread ends once none is left."""
        with self._cv:
            self._closing = True
            self._deadline = min(self._deadline, time.monotonic() + grace)
            self._cv.notify()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Request]:
        """Submit one request per prompt and wait for them (for scripts and tests)."""
        requests = [Request(p, params) for p in prompts]
        self.submit(requests)
        for r in requests:
            r.done.wait()
        return requests

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return len(self.decoding) + len(self.prefilling)

    @property
    def closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ the engine's thread
    def _main(self) -> None:
        try:
            with torch.no_grad():
                self.step = SlotStep(self.model, self.slots, self.tokens, self.cuda_graph)
                self.reader = self._reader()
                self._ready.set()
                while self._pass():
                    pass
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on; every request learns why
            self._failure = e
            if self._ready.is_set():
                traceback.print_exc(file=sys.stderr)
                self._fail_everything(f"the engine stopped: {type(e).__name__}: {e}")
            self._ready.set()

    def _reader(self) -> PromptReader:
        """The prompt reader, its graphs recorded (on CUDA; each shape's first read compiles
        kernels, 2.4-10 s at `125M` on an H100, so none is left for a request to wait on), or,
        on CUDA without graphs or with model.compile_prefill, its eager reads run once."""
        reader = PromptReader(self.model, min(self.max_batch, READ_ROWS), self.prefill_chunk, self.device,
                              self.cuda_graph, step_below=READ_STEPS_BELOW)
        try:
            reader.capture()
        except Exception as e:  # prompts are still read, eagerly
            if self.cuda_graph:
                raise
            warnings.warn(f"reading prompts without CUDA graphs ({type(e).__name__}: {e})", RuntimeWarning,
                          stacklevel=2)
            reader.without_graphs()
        if not reader.graphs and (self.device.type == "cuda" or getattr(self.model, "prefill_compiled", False)):
            reader.warm_up()
        return reader

    def _pass(self) -> bool:
        with self._cv:
            while not (self._incoming or self._cancel_asked or self.decoding or self.prefilling or self.waiting
                       or self._inflight is not None or self._closing):
                self._cv.wait()
            self.waiting.extend(self._incoming)
            self._incoming = []
            self._cancel_asked = False
            closing, deadline = self._closing, self._deadline
        updates: list[Update] = []
        if closing and time.monotonic() >= deadline:
            for r in [*self.waiting, *self.prefilling, *self.decoding]:
                r.cancelled = True
        self._drop_cancelled(updates, SHUTDOWN if closing and time.monotonic() >= deadline else CANCELLED)
        self._admit(updates)
        if self.prefilling:
            self._prefill(updates)
        # first tokens go out before the decode step: on the CPU the step computes before it
        # returns, and on a GPU taking the step before's tokens waits for the device
        self._send(updates)
        updates = []
        if self.decoding or self._inflight is not None:
            self._decode(updates)
        self._send(updates)
        return not (closing and not (self.waiting or self.prefilling or self.decoding or self._inflight))

    def _send(self, updates: list[Update]) -> None:
        if updates and self.deliver is not None:
            try:
                self.deliver(updates)
            except Exception:  # noqa: BLE001 - a receiver's bug must not stop the other requests
                traceback.print_exc(file=sys.stderr)

    def _drop_cancelled(self, updates: list[Update], reason: str) -> None:
        for queue in (self.waiting, self.prefilling):
            gone = [r for r in queue if r.cancelled]
            for r in gone:
                queue.remove(r)
                if queue is self.waiting:
                    with self._cv:
                        self._queued -= 1
                self._finish(r, reason, updates)
        rows = [i for i, r in enumerate(self.decoding) if r.cancelled]
        for i in rows:
            self._finish(self.decoding[i], reason, updates)
        self._free(rows)

    def _admit(self, updates: list[Update]) -> None:
        while self.waiting and self.running < self.max_batch and self._free_rows:
            r = self.waiting.popleft()
            with self._cv:
                self._queued -= 1
            r._admitted = time.perf_counter()
            self.stats.prompt_tokens += len(r.prompt)
            p = r.params
            r._row = TextRow(self.tokenizer, p.stop, r._pieces.append)
            if p.seed is not None and p.temperature > 0:
                r._generator = torch.Generator(device=self.device).manual_seed(p.seed)
            if p.max_tokens == 0:
                self._finish(r, LENGTH, updates)
                continue
            r._read_row = self._free_rows.pop()
            self.reader.load(r._read_row, None)
            entry = self.cache.lookup(r.prompt)
            if entry is not None:
                self._start_from(r, entry)
            r._boundary = self.cache.boundary(r.prompt, r._pos)
            if r._boundary is not None and self._boundary_fits:
                # an earlier request still short of the shared part stores its state there
                # (it had no prompt to share with when it came), and r waits for that state
                for o in self.prefilling:
                    if (o._boundary is None and o._pos < r._boundary <= len(o.prompt)
                            and np.array_equal(o.prompt[:r._boundary], r.prompt[:r._boundary])):
                        o._boundary = r._boundary
                        break
            self.prefilling.append(r)

    def _start_from(self, r: Request, entry) -> None:
        r._pos = r.cached_tokens = len(entry.tokens)
        self.reader.load(r._read_row, entry.state)  # a copy: the cached state outlives this request
        r._logits = entry.logits

    def _prefill(self, updates: list[Update]) -> None:
        """Advance every request being read by up to `prefill_chunk` of its prompt tokens, all of
        them in one read of the prompt reader per round: a request stops at its cache boundary
        (the state there is stored) and goes on in the next round within its chunk. Requests that
        arrive together are read together and get their first tokens in the same pass; with one
        budget for the whole pass the last of them would wait a pass per request before it."""
        quota = {id(r): self.prefill_chunk for r in self.prefilling}
        while True:
            items: list[tuple[Request, int]] = []
            for k, r in enumerate(self.prefilling):
                if quota[id(r)] <= 0 or r._pos == len(r.prompt):
                    continue
                if self.cache.enabled:  # a request read just before may have stored a longer prefix
                    entry = self.cache.lookup(r.prompt)
                    if entry is not None and len(entry.tokens) > r._pos:
                        self._start_from(r, entry)
                        if r._pos == len(r.prompt):
                            continue
                if self._waits_for_shared_prefix(r, self.prefilling[:k]):
                    continue
                end = min(len(r.prompt), r._pos + quota[id(r)])
                if r._boundary is not None and r._pos < r._boundary:
                    end = min(end, r._boundary)
                items.append((r, end))
                quota[id(r)] -= end - r._pos
            if not items:
                break
            try:
                logits = self.reader.read([r._read_row for r, _ in items], [r.prompt[r._pos:end] for r, end in items])
            except Exception as e:  # noqa: BLE001 - these requests fail, the others go on
                self._fail([r for r, _ in items], e, updates)
                continue
            for (r, end), lg in zip(items, logits):
                self.stats.prefill_tokens += end - r._pos
                r._pos, r._logits = end, lg
                if end == r._boundary:
                    self.cache.put(r.prompt[:end], self.reader.row_state(r._read_row), lg)
        for r in [r for r in self.prefilling if r._pos == len(r.prompt)]:
            self.prefilling.remove(r)
            self._start_decoding(r, updates)

    def _waits_for_shared_prefix(self, r: Request, earlier: list[Request]) -> bool:
        """Whether an earlier request is still reading toward a cache boundary that r's prompt
        shares (a system prompt of requests that arrived together): r waits and then starts from
        the state stored there, so the shared tokens are read once, not once per request."""
        if r._boundary is None or not self._boundary_fits:
            return False
        return any(o._boundary is not None and r._pos < o._boundary <= len(r.prompt) and o._pos < o._boundary
                   and np.array_equal(o.prompt[:o._boundary], r.prompt[:o._boundary]) for o in earlier)

    def _start_decoding(self, r: Request, updates: list[Update]) -> None:
        if r.cached_tokens:
            self.stats.cache_hits += 1
            self.stats.cache_tokens += r.cached_tokens
        elif self.cache.enabled:
            self.stats.cache_misses += 1
        state = self.reader.row_state(r._read_row)
        if r.cached_tokens < len(r.prompt):
            self.cache.put(r.prompt, state, r._logits)
        if not bool(torch.isfinite(r._logits).all()):
            self._fail([r], XLSTMKitError("the model's logits for the prompt are not finite (NaN or inf)"), updates)
            return
        first = int(self._sample(r._logits[None], [r])[0])
        now, s = time.perf_counter(), self.stats
        s.first_tokens += 1
        s.queue_seconds += r._admitted - r._submitted
        s.prefill_seconds += now - r._admitted
        s.first_token_seconds += now - r._submitted
        row = len(self.decoding)
        _copy_into([type(s)(*(x[row:row + 1] for x in s)) for s in self.slots], state)
        self._release_row(r)
        r._logits = None
        self.tokens[row] = first
        self.decoding.append(r)
        if self._accept(r, first, updates):
            self._free([row])

    def _decode(self, updates: list[Update]) -> None:
        """Launch a step over the decoding rows, then take the tokens of the step launched in the
        pass before: on a GPU the host's work on those (text, stop strings, the HTTP side) runs
        while the new step computes. A request that ended at the earlier step is still in the
        new one (a row computed for nothing) and leaves afterwards."""
        launched = None
        if self.decoding:
            n = len(self.decoding)
            try:
                ids = self._sample(self.step(n), self.decoding)
                self.tokens[:n].copy_(ids)
                launched = (*_to_host(ids), list(self.decoding))
            except Exception as e:  # noqa: BLE001 - the rows' states are unknown now: all of them end
                self._fail(list(self.decoding), e, updates)
                self._free(list(range(n)))
                self._inflight = None
                return
            self.stats.decode_steps += 1
        pending, self._inflight = self._inflight, launched
        if pending is None:
            return
        ids, copied, rows = pending
        try:
            if copied is not None:
                copied.synchronize()
            host = ids.tolist()
        except Exception as e:  # noqa: BLE001 - an error of the device surfaces at the sync
            self._fail([r for r in self.decoding if r.finish_reason is None], e, updates)
            self._free(list(range(len(self.decoding))))
            self._inflight = None
            return
        ended = [r for r, t in zip(rows, host) if r.finish_reason is None and self._accept(r, t, updates)]
        position = {id(r): i for i, r in enumerate(self.decoding)}
        self._free([position[id(r)] for r in ended])

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """One token per row: argmax for greedy rows; sampled in groups of equal settings from the
        engine's generator, or row by row from a request's own (seeded) generator."""
        out = logits.float().argmax(dim=-1)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            p = r.params
            if p.temperature == 0:
                continue
            if r._generator is not None:
                out[i] = sample_next(logits[i:i + 1], p.temperature, p.top_k, p.top_p, r._generator)[0]
            else:
                groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
        for (t, k, p), rows in groups.items():
            idx = torch.tensor(rows, device=logits.device)
            out[idx] = sample_next(logits.index_select(0, idx), t, k, p, self.generator)
        return out

    def _accept(self, r: Request, token: int, updates: list[Update]) -> bool:
        """Take a request's new token; True when it ended the request."""
        r.output.append(token)
        r._new.append(token)
        self.stats.generated_tokens += 1
        if token in self.eos and not r.params.ignore_eos:
            r._row.finish()
            reason = STOP
        elif r._row.push(token):
            reason = STOP
        elif len(r.output) >= r.params.max_tokens:
            r._row.finish()
            reason = LENGTH
        else:
            if r.stream:
                updates.append(Update(r, r._new, "".join(r._pieces)))
                r._new, r._pieces[:] = [], []
            return False
        self._finish(r, reason, updates)
        return True

    def _finish(self, r: Request, reason: str, updates: list[Update], error: str | None = None) -> None:
        if r._row is not None:
            r.text = r._row.text
        r.finish_reason, r.error = reason, error
        self._release_row(r)
        r._logits = None
        updates.append(Update(r, r._new, "".join(r._pieces), reason, error))
        r._new, r._pieces[:] = [], []
        self.stats.finished[reason] += 1
        r.done.set()

    def _release_row(self, r: Request) -> None:
        if r._read_row is not None:
            self._free_rows.append(r._read_row)
            r._read_row = None

    def _fail(self, requests: list[Request], e: Exception, updates: list[Update]) -> None:
        if not isinstance(e, XLSTMKitError):
            traceback.print_exception(e, file=sys.stderr)
        for r in requests:
            if r in self.prefilling:
                self.prefilling.remove(r)
            self._finish(r, ERROR, updates, f"{type(e).__name__}: {e}" if not isinstance(e, XLSTMKitError) else str(e))

    def _free(self, rows: list[int]) -> None:
        """Remove decoding rows: the last running row moves into each freed slot."""
        for i in sorted(rows, reverse=True):
            last = len(self.decoding) - 1
            if i != last:
                src = [type(s)(*(x[last:last + 1] for x in s)) for s in self.slots]
                _copy_into([type(s)(*(x[i:i + 1] for x in s)) for s in self.slots], src)
                self.tokens[i] = self.tokens[last]
                self.decoding[i] = self.decoding[last]
            self.decoding.pop()

    def _fail_everything(self, message: str) -> None:
        updates: list[Update] = []
        with self._cv:
            self.waiting.extend(self._incoming)
            self._incoming = []
        for r in [*self.waiting, *self.prefilling, *self.decoding]:
            if not r.done.is_set():
                self._finish(r, ERROR, updates, message)
        self.waiting.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self._send(updates)
