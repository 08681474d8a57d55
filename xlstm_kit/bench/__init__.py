"""Benchmarks: a registry of cases (`registry`), their timing (`timing`), the peers' timing code
(`peers`) and one runner (`runner`) behind `xlstm-kit bench`.

    from xlstm_kit.bench import cases
    [c.name for c in cases("ops")]
"""
from .options import SUITES

__all__ = ["CASES", "SUITES", "Case", "cases", "run"]


def __getattr__(name):
    # imported on first use: the CLI's parser reads .options without importing torch
    if name in ("CASES", "Case", "cases"):
        from . import registry
        return getattr(registry, name)
    if name == "run":
        from .runner import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
