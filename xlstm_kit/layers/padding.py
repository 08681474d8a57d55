"""Padded rows: one batch of fixed shape whose rows are only their first lengths[b] steps
(`XLSTMLanguageModel.forward(..., lengths=)`, a server's prompt reads recorded as CUDA graphs).
The padding is made a no-op of the exponentially gated cells through their gates, and the
convolutions' states are taken at each row's last real step."""
from __future__ import annotations

import torch


def conv_state_at(x: torch.Tensor, state: torch.Tensor | None, kernel_size: int, lengths: torch.Tensor) -> torch.Tensor:
    """The convolution's state after the first lengths[b] inputs of each row of x [B, T, C]
    (the rest padding): the K-1 inputs of cat(state, x) before position lengths[b], [B, K-1, C]."""
    B, T, C = x.shape
    K1 = kernel_size - 1
    if state is None:
        state = x.new_zeros(B, K1, C)
    full = torch.cat([state.to(x.dtype), x], dim=1)  # [B, K-1+T, C]
    idx = lengths.to(x.device, torch.long)[:, None] + torch.arange(K1, device=x.device)
    return full.gather(1, idx[..., None].expand(B, K1, C))


# A gate pre-activation this large makes a step a no-op of the exponential-gated cells:
# logsigmoid(+GATE_OFF) is exactly 0 (the forget gate keeps everything) and exp(-GATE_OFF - m)
# is exactly 0 (the input gate writes nothing), in float32 and float64, for any stabiliser m
# above -9,000; bfloat16 gates keep it within 0.4 %.
GATE_OFF = 1e4


def valid_steps(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """[B, T] bool: position t of row b is one of its first lengths[b] (not padding)."""
    return torch.arange(T, device=lengths.device) < lengths[:, None]


def gates_off_past(i: torch.Tensor, f: torch.Tensor, lengths: torch.Tensor):
    """Input and forget gate pre-activations i, f [B, T, ...] with every padded position
    (t >= lengths[b]) turned into a no-op step: the cell's state after the whole row is its
    state after lengths[b] steps."""
    valid = valid_steps(lengths.to(i.device), i.shape[1]).view(*i.shape[:2], *([1] * (i.dim() - 2)))
    return (torch.where(valid, i, torch.full((), -GATE_OFF, dtype=i.dtype, device=i.device)),
            torch.where(valid, f, torch.full((), GATE_OFF, dtype=f.dtype, device=f.device)))
