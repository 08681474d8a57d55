"""The options of `xlstm-kit bench`, apart from the runner so that building the CLI's parser
(every `--help`) does not import torch."""
from __future__ import annotations

import argparse

SUITES = ("ops", "model", "generate")
SUITE_CHOICES = SUITES + ("all",)
PEER_TIMEOUT_S = 300.0  # fla compiles for minutes on its first call (231 s for chunk_dplr on an H200)

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `xlstm-kit bench` (also used by `python -m xlstm_kit.bench`)."""
    p.add_argument("--suite", default="all", choices=SUITE_CHOICES,
                   help="ops: the sequence ops and decode steps; model: a training step; generate: "
                        "generation; all: the three")
    p.add_argument("--peers", action="store_true",
                   help="also time the installed peers (SDPA, mlstm_kernels, fla, flashrnn, official xlstm), "
                        "each in a child process, and print our time ÷ theirs")
    p.add_argument("--peer-timeout", type=float, default=PEER_TIMEOUT_S, metavar="S",
                   help="seconds each peer measurement may take, its compile included")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the dated table (default: benchmarks/results/ at the root of a clone, "
                        "else the current folder)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions: a smoke test")
    p.add_argument("--case", action="append", default=None, metavar="NAME",
                   help="only this case (repeatable); see --list")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--backend", default=None, choices=["torch", "triton"],
                   help="force a backend for the ops that take one (default: the library's choice)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--list", action="store_true", help="list the cases and their shapes, then exit")
