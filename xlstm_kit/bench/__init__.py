"""Benchmarks: a registry of cases (`registry`), their timing (`timing`), the peers' timing code
(`peers`) and one runner (`runner`) behind `xlstm-kit bench`.

    from xlstm_kit.bench import cases
    [c.name for c in cases("ops")]
"""
from .registry import CASES, SUITES, Case, cases
from .runner import run

__all__ = ["CASES", "SUITES", "Case", "cases", "run"]
