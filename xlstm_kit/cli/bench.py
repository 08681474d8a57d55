"""``xlstm-kit bench``: the benchmark registry and runner of xlstm_kit.bench (its arguments are
xlstm_kit.bench.options')."""
from __future__ import annotations

import argparse

from ..bench.runner import run


def cmd_bench(args: argparse.Namespace) -> int:
    run(args)
    return 0
