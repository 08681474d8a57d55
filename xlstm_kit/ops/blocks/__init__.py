"""Kernels of the layers' elementwise parts (the sequence ops live in mlstm/, slstm/, dplr/).

`triton`: the mLSTM output tail (head-wise norm + skip + SiLU gate), the head-wise norm alone and
the causal conv + SiLU, forward and backward, as torch.library custom ops; the layers reach them
through xlstm_kit.layers.fused (conv_silu, head_norm, mlstm_output), which hold their PyTorch twins.
`swiglu`: the large block's SwiGLU activation SiLU(g) * u, forward and backward, reached through
xlstm_kit.layers.fused.swiglu.
"""
