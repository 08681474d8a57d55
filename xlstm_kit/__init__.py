"""xlstm_kit: xLSTM (sLSTM, mLSTM) and DPLR/KDA recurrences for PyTorch."""
__version__ = "0.1.0"

from .model import XLSTMConfig, XLSTMLanguageModel  # noqa: E402
