"""The formal-language tasks in the xLSTM paper's setting (Figure 4, appendix D.1).

Differences from ``formal.TASKS`` (the small-vocabulary variants used so far):

- vocabularies: majority and majority count 64 symbols, reverse string, bucket sort and
  missing duplicate 10 symbols (the others as before);
- the four further Figure 4 tasks: majority count, missing duplicate, modular arithmetic with
  brackets, solve equation;
- the outputs are answered without teacher forcing (``FormalTask.encode(..., teacher_forcing=False)``):
  after the input comes the action marker (SEP) and then PAD tokens, one position per output
  symbol, so the model sees neither the correct nor its own previous outputs.

Task definitions of the new tasks (n_in input symbols -> n_out output symbols):
  majority_count      64 symbols -> how often the most frequent symbol occurs, mod 64 (a count
                      up to 256 on the test lengths; the modulus keeps the output alphabet at 64)
  missing_duplicate   w w' with w of 10 symbols and w' = w with one symbol replaced by MISSING
                      -> the replaced symbol (the input has the largest even length <= n)
  modular_arithmetic_brackets  digits 0-4, + - *, ( ) -> the value mod 5 (usual precedence;
                      a random expression tree of the largest odd length <= n)
  solve_equation      an expression as above with one digit replaced by the unknown X, then "="
                      and a digit c -> the value of X in 0-4 solving it (mod 5); the sampler keeps
                      only equations with exactly one solution
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import XLSTMKitError
from .formal import MOD, TASKS, FormalTask, _one, _uniform, bucket_sort_label, reverse_string_label

PAPER_SYMBOLS = {"majority": 64, "majority_count": 64, "reverse_string": 10, "bucket_sort": 10,
                 "missing_duplicate": 10}
"""Input alphabet sizes of the paper where they differ from the small variants."""


def majority_label_k(x: Sequence[int], k: int) -> list[int]:
    counts = np.bincount(np.asarray(x, dtype=np.int64), minlength=k)
    return [int(np.argmax(counts))]  # ties: the smallest symbol


def majority_count_label(x: Sequence[int], k: int = 64) -> list[int]:
    counts = np.bincount(np.asarray(x, dtype=np.int64), minlength=k)
    return [int(counts.max()) % k]


DUP_SYMBOLS = 10
MISSING = DUP_SYMBOLS  # input symbol that marks the replaced position


def missing_duplicate_label(x: Sequence[int]) -> list[int]:
    """x = w + w' (w' = w with one symbol replaced by MISSING) -> the replaced symbol."""
    half = len(x) // 2
    if len(x) % 2 or list(x).count(MISSING) != 1 or MISSING not in x[half:]:
        raise XLSTMKitError(f"not w w' with exactly one MISSING in the second half: {list(x)}")
    i = list(x[half:]).index(MISSING)
    return [int(x[i])]


def _sample_missing_duplicate(rng: np.random.Generator, n: int):
    half = max(1, n // 2)
    w = rng.integers(0, DUP_SYMBOLS, size=half).tolist()
    second = list(w)
    second[int(rng.integers(0, half))] = MISSING
    x = w + second
    return x, missing_duplicate_label(x)


# ------------------------------------------------------------------ arithmetic with brackets
PLUS, MINUS, TIMES, OPEN, CLOSE = MOD, MOD + 1, MOD + 2, MOD + 3, MOD + 4  # digits are 0..4
UNKNOWN, EQUALS = MOD + 5, MOD + 6


_ROOTS = tuple(range(MOD))


def _values(x: Sequence[int]) -> tuple[int, ...]:
    """Value mod 5 of a bracketed expression for each X = 0..4 (recursive descent; * binds
    tighter than + -): one parse where solving an equation evaluated it six times. Without X
    the parse runs on plain ints."""
    pos = 0
    if UNKNOWN in x:
        def digit(d):
            return (d,) * MOD

        def mul(a, b):
            return tuple(p * q % MOD for p, q in zip(a, b))

        def add(a, b, sign):
            return tuple((p + sign * q) % MOD for p, q in zip(a, b))
    else:
        def digit(d):
            return d

        def mul(a, b):
            return a * b % MOD

        def add(a, b, sign):
            return (a + sign * b) % MOD

    def atom():
        nonlocal pos
        if pos >= len(x):
            raise XLSTMKitError(f"expression ends early: {list(x)}")
        s = x[pos]
        pos += 1
        if s < MOD:
            return digit(int(s))
        if s == UNKNOWN:
            return _ROOTS
        if s == OPEN:
            v = expr()
            if pos >= len(x) or x[pos] != CLOSE:
                raise XLSTMKitError(f"unbalanced brackets: {list(x)}")
            pos += 1
            return v
        raise XLSTMKitError(f"symbol {s} where a digit or '(' belongs: {list(x)}")

    def term():
        nonlocal pos
        v = atom()
        while pos < len(x) and x[pos] == TIMES:
            pos += 1
            v = mul(v, atom())
        return v

    def expr():
        nonlocal pos
        v = term()
        while pos < len(x) and x[pos] in (PLUS, MINUS):
            sign = 1 if x[pos] == PLUS else -1
            pos += 1
            v = add(v, term(), sign)
        return v

    value = expr()
    if pos != len(x):
        raise XLSTMKitError(f"not a well-formed expression: {list(x)}")
    return value if isinstance(value, tuple) else (value,) * MOD


def _evaluate(x: Sequence[int], unknown: int | None = None) -> int:
    """Value mod 5 of a bracketed expression, its X (if any) set to `unknown`."""
    if unknown is None and UNKNOWN in x:
        raise XLSTMKitError(f"symbol {UNKNOWN} where a digit or '(' belongs: {list(x)}")
    return _values(x)[unknown or 0]


def modular_arithmetic_brackets_label(x: Sequence[int]) -> list[int]:
    return [_evaluate(x)]


def _random_expression(rng: np.random.Generator, n: int) -> list[int]:
    """A random expression of exactly n symbols, n odd (digits and binary operators alternate,
    brackets add two: every expression has an odd length)."""
    if n % 2 == 0 or n < 1:
        raise XLSTMKitError(f"expressions have odd lengths, got {n}")
    # every choice from one draw of uniforms (at most 2n - 1 are used): a generator call per
    # choice was most of a batch's sampling time
    u = iter(rng.random(3 * n).tolist())

    def build(n: int) -> list[int]:
        if n == 1:
            return [int(next(u) * MOD)]
        if next(u) < 0.25:
            return [OPEN] + build(n - 2) + [CLOSE]
        a = 2 * int(next(u) * ((n - 1) // 2)) + 1  # left part: odd length 1 .. n - 2
        op = PLUS + int(next(u) * 3)
        return build(a) + [op] + build(n - 1 - a)

    return build(n)


def _odd_at_most(n: int) -> int:
    return max(1, n if n % 2 else n - 1)


def _sample_brackets(rng: np.random.Generator, n: int):
    x = _random_expression(rng, _odd_at_most(n))
    return x, modular_arithmetic_brackets_label(x)


def solve_equation_label(x: Sequence[int]) -> list[int]:
    """x = expression with one UNKNOWN, EQUALS, digit c -> the X in 0..4 with value == c
    (XLSTMKitError unless exactly one solves it)."""
    if len(x) < 3 or x[-2] != EQUALS or not 0 <= x[-1] < MOD or list(x).count(UNKNOWN) != 1:
        raise XLSTMKitError(f"not 'expression with one X = digit': {list(x)}")
    lhs, c = x[:-2], x[-1]
    roots = [v for v, value in enumerate(_values(lhs)) if value == c]
    if len(roots) != 1:
        raise XLSTMKitError(f"{len(roots)} solutions, need exactly one: {list(x)}")
    return roots


def _sample_equation(rng: np.random.Generator, n: int):
    m = _odd_at_most(max(3, n - 2))  # the expression, then "= c"
    while True:  # most draws have one solution; X under * 0 or similar gives several
        lhs = _random_expression(rng, m)
        digits = [i for i, s in enumerate(lhs) if s < MOD]
        i = int(rng.choice(digits))
        answer = lhs[i]
        lhs[i] = UNKNOWN
        values = _values(lhs)
        if values.count(values[answer]) == 1:
            return lhs + [EQUALS, values[answer]], [answer]


def _uniform_majority(k: int):
    return _uniform(k, lambda x: majority_label_k(x, k))


PAPER_TASKS: dict[str, FormalTask] = {
    # the first tasks as defined already; the others with the paper's vocabularies, or new
    **{name: TASKS[name] for name in ("parity", "even_pairs", "cycle_navigation", "modular_arithmetic")},
    **{t.name: t for t in (
        FormalTask("reverse_string", 10, 10, _uniform(10, reverse_string_label), lambda n: n),
        TASKS["stack_manipulation"],
        FormalTask("bucket_sort", 10, 10, _uniform(10, bucket_sort_label), lambda n: n),
        FormalTask("majority", 64, 64, _uniform_majority(64), _one),
        FormalTask("majority_count", 64, 64, _uniform(64, majority_count_label), _one),
        FormalTask("missing_duplicate", DUP_SYMBOLS + 1, DUP_SYMBOLS, _sample_missing_duplicate, _one),
        FormalTask("modular_arithmetic_brackets", MOD + 5, MOD, _sample_brackets, _one),
        FormalTask("solve_equation", MOD + 7, MOD, _sample_equation, _one),
    )},
}
"""The twelve Figure 4 tasks with the paper's vocabularies."""
