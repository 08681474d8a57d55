"""Kernels of the layers' elementwise parts (the sequence ops live in mlstm/, slstm/, dplr/).

`triton`: the mLSTM output tail (head-wise norm + skip + SiLU gate, forward and backward) as
torch.library custom ops; the layers reach it through xlstm_kit.nn.fused.mlstm_output.
"""
