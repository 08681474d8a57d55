"""Argument types, the parser classes and the constants every ``xlstm-kit`` command shares."""
from __future__ import annotations

import argparse
import os
import re
from typing import Any

from ..errors import XLSTMKitError


PROG = "xlstm-kit"
DEFAULT_DATA = "builtin:shakespeare"
DEFAULT_PRESET = "tiny"
EXIT_USAGE = 2
EVAL_WHOLE_SPLIT_UP_TO = 100  # eval's default: the whole validation split when it has at most this many batches
EXIT_INTERRUPTED = 130

# Per-preset training defaults. The CPU preset trains small batches of short sequences so that a
# run of a few minutes on 2 cores shows the loss fall; the paper sizes use the paper's context.
TRAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny": dict(batch_size=16, seq_len=128, lr=3e-3, min_lr=3e-4, warmup_steps=30),
}
LARGE_DEFAULTS = dict(batch_size=32, seq_len=2048, lr=1e-3, min_lr=1e-4, warmup_steps=500)
# Fine-tuning (--init-from) moves trained weights: a tenth of pretraining's learning rate.
FINETUNE_DEFAULTS = dict(batch_size=16, seq_len=1024, lr=1e-4, min_lr=1e-5, warmup_steps=100)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype of generate / eval
THREADS_HELP = ("CPU threads (default: torch's choice, fewer when other processes already keep cores "
                 "busy; OMP_NUM_THREADS, when set, is kept)")


# The names --preset, --tokenizer and --device accept, known here without importing torch so that
# a mistyped one is answered at once instead of after seconds of imports (tests/test_cli_startup.py
# holds them equal to the library's: models.PRESETS, io.tokenizers.TOKENIZERS).
PRESET_KEYS = ("tiny", "125m", "350m", "760m", "1.3b", "7b", "large-125m", "large-350m", "large-1.3b")
TOKENIZER_NAMES = ("byte", "gpt2")
DEVICE_SYNTAX = re.compile(r"(cpu|cuda|mps)(:\d+)?")


def preset_key(name: str) -> str:
    """The key of models.PRESETS a --preset names (as XLSTMConfig.from_name reads it)."""
    key = name.strip().lower()
    for prefix in ("xlstm-", "xlstm_"):
        key = key[len(prefix):] if key.startswith(prefix) else key
    return key


def preset_name(text: str) -> str:
    if text and preset_key(text) not in PRESET_KEYS:
        names = ", ".join("xlstm-7b" if k == "7b" else k for k in PRESET_KEYS)
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose one of {names}")
    return text


def tokenizer_name(text: str) -> str:
    if text and text not in TOKENIZER_NAMES:
        raise argparse.ArgumentTypeError(f"unknown tokenizer {text!r}; choose one of {', '.join(TOKENIZER_NAMES)}")
    return text


def device_name(text: str) -> str:
    """cpu, cuda, cuda:N or mps by their spelling (whether the device exists is checked once
    torch is imported)."""
    if not DEVICE_SYNTAX.fullmatch(text):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cpu, cuda or cuda:N")
    return text


class UsageError(XLSTMKitError):
    """A problem with what the user asked for: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (argparse's default prints the usage block first)."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)}\n")


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" only for options whose default is a real value; description and
    epilog lines that start with a space (examples) are kept as written, the others wrapped."""

    def _fill_text(self, text, width, indent):
        return "\n".join(line if line.startswith(" ") else super(Formatter, self)._fill_text(line, width, indent)
                         for line in text.splitlines())

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def one_line(message: Any) -> str:
    return " ".join(str(message).split())


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


# More threads than this many per core only thrash, and torch crashes long before 100,000
THREADS_PER_CORE = 4


def thread_count(text: str) -> int:
    """--threads: a positive integer up to THREADS_PER_CORE x the machine's cores."""
    v = positive_int(text)
    most = THREADS_PER_CORE * (os.cpu_count() or 1)
    if v > most:
        raise argparse.ArgumentTypeError(f"must be at most {most} ({THREADS_PER_CORE} per core of this machine's "
                                         f"{os.cpu_count() or 1}), got {v}")
    return v


def nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def seed_int(text: str) -> int:
    """--seed: an integer in [0, 2**64), what torch's generators take."""
    v = nonneg_int(text)
    if v >= 2**64:
        raise argparse.ArgumentTypeError(f"must be below 2**64 = {2**64}, got {v}")
    return v


def nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def positive_float(text: str) -> float:
    v = nonneg_float(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v
