"""Models: the xLSTM language model of both block families ("neurips": the paper's mLSTM /
sLSTM blocks, xLSTM[a:b]; "large": the xLSTM-7B blocks), one config and one nn.Module."""
from .config import PRESETS, XLSTMConfig
from .xlstm import ModelState, XLSTMLanguageModel

__all__ = ["PRESETS", "XLSTMConfig", "XLSTMLanguageModel", "ModelState"]
