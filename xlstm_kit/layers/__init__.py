"""Layers and residual blocks of xLSTM.

Every layer and block has forward(x [B, T, d], state=None, return_state=False), step(x [B, d],
state) for one token and init_state(batch). None of them picks a backend: the ops do, unless a
backend is passed down from the model config.
"""
from .common import CausalConv1d, GatedFeedForward, HeadwiseLinear, MultiHeadNorm
from .dplr import DPLRBlock, DPLRLayer, DPLRState
from .large import LargeBlock, LargeMLSTMLayer, MultiHeadLayerNorm, RMSNorm, SwiGLU
from .mlstm import MLSTMBlock, MLSTMLayer, MLSTMState
from .slstm import SLSTMBlock, SLSTMLayer, SLSTMState

__all__ = [
    "CausalConv1d",
    "DPLRBlock",
    "DPLRLayer",
    "DPLRState",
    "GatedFeedForward",
    "HeadwiseLinear",
    "LargeBlock",
    "LargeMLSTMLayer",
    "MultiHeadLayerNorm",
    "MultiHeadNorm",
    "RMSNorm",
    "MLSTMBlock",
    "MLSTMLayer",
    "MLSTMState",
    "SLSTMBlock",
    "SLSTMLayer",
    "SLSTMState",
    "SwiGLU",
]
