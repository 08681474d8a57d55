"""Fused Triton sLSTM, split by phase (imported only when Triton is installed):

    config.py    SLSTMKernelConfig (launch choices) and default_config
    common.py    activations, masked loads, the split-precision matmul, per-gate tuple helpers
    forward.py   the forward kernel (all T steps in one launch; packed sequences as a batch)
                 and forward_reference
    backward.py  the backward kernel (all T steps in reverse) and backward_reference
    op.py        xlstm_kit::slstm_recurrent_fwd/_bwd custom ops, slstm_recurrent_triton
    step.py      xlstm_kit::slstm_step custom op, slstm_step_triton

Precision: states and gate arithmetic in float32 (float64 for float64 inputs). The matmul keeps
float32 accuracy on the tensor cores by splitting the float32 operand into a bf16 head and a bf16
tail (two bf16 MMAs for bf16 weights, three when the weights are float32/float16 and are split
too). Under TRITON_INTERPRET=1 (no bf16 there) the dot runs directly in the state dtype.
"""
from .config import SLSTMKernelConfig, default_config
from .op import slstm_recurrent_triton
from .step import slstm_step_triton

__all__ = ["SLSTMKernelConfig", "default_config", "slstm_recurrent_triton", "slstm_step_triton"]
