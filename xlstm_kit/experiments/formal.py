"""Formal-language tasks of the xLSTM paper's Figure 4 (after Delétang et al., 2023).

Each task maps an input string x (length n) to an output string y (one symbol for the
classification tasks, several for the transduction tasks). A causal model sees

    inputs   x_1 ... x_n  SEP  y_1 ... y_{m-1}
    targets   .  ...  .   y_1  y_2 ... y_m          (only these m positions count: `mask`)

so it answers after reading the whole input and, for several output symbols, gets the correct
previous symbol (teacher forcing). The paper's format (``teacher_forcing=False``) feeds
``x_1 ... x_n  SEP  PAD ... PAD`` instead: SEP is the action marker and every output symbol is
predicted at its own padded position, without seeing any previous output. Token ids: 0 = PAD, 1 = SEP, then the
task's input symbols, then its output symbols (a task's vocabulary is ``2 + n_in + n_out``).

Training uses lengths 3–40 and testing 41–256 (the paper's split). Accuracy is the fraction of
correct output symbols of a sequence, averaged over sequences and lengths, and reported scaled:
``(acc - chance) / (1 - chance)`` with chance = 1 / n_out (uniform guessing among the outputs),
so 0 is chance and 1 is perfect.

Tasks (n_in input symbols -> n_out output symbols):
  parity              bits -> their sum mod 2
  even_pairs          a/b string -> whether #"ab" + #"ba" is even (equivalently x_1 == x_n)
  cycle_navigation    moves stay/+1/-1 on a cycle of 5 from position 0 -> final position
  modular_arithmetic  digits 0-4 and + - * without brackets (usual precedence) -> value mod 5;
                      the expression has the largest odd length <= n (digit op digit ... digit)
  reverse_string      bits -> the same bits reversed
  stack_manipulation  a/b stack (bottom to top) then POP / PUSH a / PUSH b -> the final stack
                      read top to bottom, then END (POP on an empty stack does nothing)
  bucket_sort         symbols 0-4 -> the same symbols sorted
  majority            symbols 0-3 -> the most frequent one (ties: the smallest symbol)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from ..errors import XLSTMKitError

PAD, SEP = 0, 1
TRAIN_LENGTHS = (3, 40)
"""Inclusive range of training input lengths (the paper's)."""
TEST_LENGTHS = (41, 256)
"""Inclusive range of test input lengths (the paper's)."""

Generator = Callable[[np.random.Generator, int], tuple[list[int], list[int]]]


# ---------------------------------------------------------------------------------- labels
# The label functions are separate from the samplers so that tests can check them on
# hand-made strings.
def parity_label(x: Sequence[int]) -> list[int]:
    return [int(sum(x)) % 2]


def even_pairs_label(x: Sequence[int]) -> list[int]:
    pairs = sum(1 for a, b in zip(x[:-1], x[1:]) if a != b)
    return [1 if pairs % 2 == 0 else 0]


CYCLE = 5
_MOVES = (0, 1, -1)  # symbol 0: stay, 1: one step forward, 2: one step back


def cycle_navigation_label(x: Sequence[int]) -> list[int]:
    return [sum(_MOVES[s] for s in x) % CYCLE]


MOD = 5
PLUS, MINUS, TIMES = MOD, MOD + 1, MOD + 2  # symbols 0..4 are digits


def modular_arithmetic_label(x: Sequence[int]) -> list[int]:
    """Value mod 5 of digit op digit ... digit with * before + and - (left to right)."""
    if len(x) % 2 == 0 or any((s >= MOD) != (i % 2 == 1) for i, s in enumerate(x)):
        raise XLSTMKitError(f"not an expression digit op digit ... digit: {list(x)}")
    total, term, sign = 0, x[0], 1
    for op, d in zip(x[1::2], x[2::2]):
        if op == TIMES:
            term = term * d % MOD
        else:
            total += sign * term
            term, sign = d, (1 if op == PLUS else -1)
    return [(total + sign * term) % MOD]


def reverse_string_label(x: Sequence[int]) -> list[int]:
    return list(reversed(x))


STACK_A, STACK_B, POP, PUSH_A, PUSH_B = range(5)
STACK_END = 2  # output symbol after the last stack element


def stack_manipulation_label(x: Sequence[int]) -> list[int]:
    """x: initial stack (symbols a=0 / b=1, bottom to top) then actions (POP, PUSH_A, PUSH_B)."""
    i = 0
    stack: list[int] = []
    while i < len(x) and x[i] in (STACK_A, STACK_B):
        stack.append(x[i])
        i += 1
    for s in x[i:]:
        if s == POP:
            if stack:
                stack.pop()
        elif s == PUSH_A:
            stack.append(STACK_A)
        elif s == PUSH_B:
            stack.append(STACK_B)
        else:
            raise XLSTMKitError(f"stack symbol {s} after the first action: actions only are allowed there")
    return stack[::-1] + [STACK_END]


def bucket_sort_label(x: Sequence[int]) -> list[int]:
    return sorted(x)


MAJORITY_SYMBOLS = 4


def majority_label(x: Sequence[int]) -> list[int]:
    counts = np.bincount(np.asarray(x, dtype=np.int64), minlength=MAJORITY_SYMBOLS)
    return [int(np.argmax(counts))]  # argmax returns the first maximum: ties -> smallest symbol


# ---------------------------------------------------------------------------------- samplers
def _uniform(n_symbols: int, label: Callable[[Sequence[int]], list[int]]) -> Generator:
    def sample(rng: np.random.Generator, n: int):
        x = rng.integers(0, n_symbols, size=n).tolist()
        return x, label(x)

    return sample


def _sample_modular(rng: np.random.Generator, n: int):
    k = (n + 1) // 2 if n % 2 else n // 2  # digits; length 2k - 1 <= n
    x = np.empty(2 * k - 1, dtype=np.int64)
    x[0::2] = rng.integers(0, MOD, size=k)
    x[1::2] = rng.integers(MOD, MOD + 3, size=k - 1)
    x = x.tolist()
    return x, modular_arithmetic_label(x)


def _sample_stack(rng: np.random.Generator, n: int):
    depth = int(rng.integers(1, n))  # at least one symbol on the stack and one action
    x = rng.integers(0, 2, size=depth).tolist() + rng.integers(2, 5, size=n - depth).tolist()
    return x, stack_manipulation_label(x)


@dataclass(frozen=True)
class FormalTask:
    """One task: its alphabet sizes, how to sample, and the longest output for an input length."""

    name: str
    n_in: int
    """Input symbols (token ids 2 .. 2 + n_in - 1)."""
    n_out: int
    """Output symbols (token ids 2 + n_in .. 2 + n_in + n_out - 1); chance is 1 / n_out."""
    sample: Generator
    """(rng, n) -> (x, y): input and output symbol lists."""
    max_output: Callable[[int], int]
    """Longest output for input length n."""

    @property
    def vocab_size(self) -> int:
        return 2 + self.n_in + self.n_out

    @property
    def chance(self) -> float:
        return 1.0 / self.n_out

    def max_seq_len(self, n: int) -> int:
        """Longest model sequence (input + SEP + outputs - 1) for input length n."""
        return n + self.max_output(n)

    def encode(self, x: Sequence[int], y: Sequence[int], teacher_forcing: bool = True
               ) -> tuple[list[int], list[int], list[bool]]:
        """(inputs, targets, mask) token lists of length len(x) + len(y) (see the module doc);
        without teacher forcing the inputs after SEP are PAD."""
        out = [2 + self.n_in + s for s in y]
        inputs = [2 + s for s in x] + [SEP] + (out[:-1] if teacher_forcing else [PAD] * (len(y) - 1))
        targets = [PAD] * len(x) + out
        mask = [False] * len(x) + [True] * len(y)
        return inputs, targets, mask


def _one(n: int) -> int:
    return 1


TASKS: dict[str, FormalTask] = {
    t.name: t
    for t in (
        FormalTask("parity", 2, 2, _uniform(2, parity_label), _one),
        FormalTask("even_pairs", 2, 2, _uniform(2, even_pairs_label), _one),
        FormalTask("cycle_navigation", 3, CYCLE, _uniform(3, cycle_navigation_label), _one),
        FormalTask("modular_arithmetic", MOD + 3, MOD, _sample_modular, _one),
        FormalTask("reverse_string", 2, 2, _uniform(2, reverse_string_label), lambda n: n),
        FormalTask("stack_manipulation", 5, 3, _sample_stack, lambda n: n + 1),
        FormalTask("bucket_sort", 5, 5, _uniform(5, bucket_sort_label), lambda n: n),
        FormalTask("majority", MAJORITY_SYMBOLS, MAJORITY_SYMBOLS, _uniform(MAJORITY_SYMBOLS, majority_label), _one),
    )
}


# ---------------------------------------------------------------------------------- batches
@dataclass
class TaskBatch:
    """A padded batch: inputs, targets [B, T] long; mask [B, T] bool (the positions scored);
    lengths [B] long (input length n of each sequence). Padding sits at the end, so a causal
    model's outputs at scored positions do not depend on it."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    positions: torch.Tensor | None = None
    """[B, n] long: the scored positions of each row in order, where every row has n of them
    (MQAR), else None. The training step then runs the output head there only."""

    def _map(self, fn) -> "TaskBatch":
        return TaskBatch(*(None if t is None else fn(t)
                           for t in (self.inputs, self.targets, self.mask, self.lengths, self.positions)))

    def to(self, device) -> "TaskBatch":
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> "TaskBatch":
        """In page-locked host memory: only from there does `to(cuda)` return before the copy
        is done (from pageable memory it waits for the device's queue), so a training loop
        without other host reads can prepare the next batch while the device works."""
        return self._map(torch.Tensor.pin_memory)


def make_batch(task: FormalTask, rng: np.random.Generator, lengths: Sequence[int], pad_to: int | None = None,
               teacher_forcing: bool = True) -> TaskBatch:
    """One sequence per entry of `lengths` (input lengths), right-padded to `pad_to` (default:
    the longest sequence). A fixed `pad_to` keeps tensor shapes, hence compiled kernels, fixed.
    teacher_forcing=False: the paper's format (PAD inputs at the output positions)."""
    rows = [task.encode(*task.sample(rng, int(n)), teacher_forcing=teacher_forcing) for n in lengths]
    if not rows:
        raise XLSTMKitError("lengths must not be empty")
    T = max(len(r[0]) for r in rows)
    if pad_to is not None:
        if pad_to < T:
            raise XLSTMKitError(f"pad_to={pad_to} is shorter than the longest sequence ({T} tokens)")
        T = pad_to
    B = len(rows)
    # numpy rows then one tensor each: per-row torch.tensor calls cost more than a GPU step
    inputs = np.full((B, T), PAD, dtype=np.int64)
    targets = np.full((B, T), PAD, dtype=np.int64)
    mask = np.zeros((B, T), dtype=bool)
    for b, (i, t, m) in enumerate(rows):
        inputs[b, : len(i)] = i
        targets[b, : len(t)] = t
        mask[b, : len(m)] = m
    return TaskBatch(torch.from_numpy(inputs), torch.from_numpy(targets), torch.from_numpy(mask),
                     torch.as_tensor(np.asarray(lengths, dtype=np.int64)))


def sample_train_batch(task: FormalTask, rng: np.random.Generator, batch_size: int,
                       length_range: tuple[int, int] = TRAIN_LENGTHS, teacher_forcing: bool = True) -> TaskBatch:
    """`batch_size` sequences with input lengths uniform in `length_range` (inclusive), padded
    to the longest possible sequence of the range (one shape for the whole training run)."""
    lo, hi = length_range
    if not 1 <= lo <= hi:
        raise XLSTMKitError(f"length_range must be (lo, hi) with 1 <= lo <= hi, got {length_range}")
    if task.name in ("stack_manipulation", "modular_arithmetic", "missing_duplicate") and lo < 2:
        raise XLSTMKitError(f"{task.name} needs input lengths >= 2, got {length_range}")
    if task.name == "solve_equation" and hi < 5:  # the shortest equation: X op d = c
        raise XLSTMKitError(f"solve_equation needs input lengths up to >= 5, got {length_range}")
    lengths = rng.integers(lo, hi + 1, size=batch_size)
    return make_batch(task, rng, lengths, pad_to=task.max_seq_len(hi), teacher_forcing=teacher_forcing)


# ---------------------------------------------------------------------------------- metrics
def sequence_accuracy(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of correctly predicted scored tokens per sequence.

    logits [B, T, V], targets [B, T], mask [B, T] bool -> [B] float (argmax over the vocabulary).
    A sequence without scored tokens raises (its accuracy would be undefined).
    """
    if logits.ndim != 3 or logits.shape[:2] != targets.shape or mask.shape != targets.shape:
        raise XLSTMKitError(f"logits must be [B, T, V] and targets, mask [B, T]; got {tuple(logits.shape)}, "
                         f"{tuple(targets.shape)}, {tuple(mask.shape)}")
    counts = mask.sum(1)
    if bool((counts == 0).any()):
        raise XLSTMKitError("every sequence needs at least one scored (mask=True) position")
    correct = (logits.argmax(-1) == targets) & mask
    return correct.sum(1).double() / counts.double()


def scaled_accuracy(accuracy: float, chance: float) -> float:
    """(accuracy - chance) / (1 - chance): 0 at chance level, 1 when perfect (negative below chance)."""
    if not 0 <= chance < 1:
        raise XLSTMKitError(f"chance must be in [0, 1), got {chance}")
    return (accuracy - chance) / (1.0 - chance)
