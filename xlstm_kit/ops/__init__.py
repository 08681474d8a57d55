"""Functional ops. Layout [B, T, H, dim] for every sequence tensor; every sequence op returns
(out, state), state being None unless output_final_state=True."""
from .dplr import dplr_chunkwise, dplr_recurrent, dplr_step, kda_chunkwise
from .mlstm import mlstm_chunkwise, mlstm_parallel, mlstm_recurrent, mlstm_step
from .slstm import slstm_recurrent, slstm_step

__all__ = [
    "mlstm_recurrent", "mlstm_parallel", "mlstm_chunkwise", "mlstm_step",
    "slstm_recurrent", "slstm_step",
    "dplr_recurrent", "dplr_chunkwise", "dplr_step", "kda_chunkwise",
]
