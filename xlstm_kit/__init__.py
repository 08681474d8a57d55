"""xlstm_kit: xLSTM (sLSTM, mLSTM) and DPLR/KDA recurrences for PyTorch."""
from ._version import __version__  # noqa: F401
__all__ = ["XLSTMConfig", "XLSTMLanguageModel"]


def __getattr__(name: str):
    # Lazy, so that `import xlstm_kit.cli` does not import torch: `xlstm-kit --help` answers at
    # once, and a Ctrl-C during torch's import reaches the CLI's handler instead of a traceback.
    if name in __all__:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
