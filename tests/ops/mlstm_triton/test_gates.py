"""Gate prologue (_gate_prep) against its float64 reference."""
import torch

from tests.ops.mlstm_triton import reference as ref
from tests.ops.mlstm_triton.phase_inputs import DEV
from xlstm_kit.ops.mlstm.triton import gates
from xlstm_kit.ops.mlstm.triton._common import NEG


def test_gate_prep_matches_float64():
    """β (hi + lo) = in-chunk cumsum of log σ(f) to float64 accuracy, ĩ, u = β + cummax(ĩ − β),
    and xm (ĩ − β at a chunk's new running max, else NEG), with a padded tail (log f = 0, ĩ =
    NEG there); f spans closed to open gates."""
    B, T, H, L = 2, 45, 3, 16
    i = torch.randn(B, T, H) * 8.0
    f = torch.randn(B, T, H) * 10.0
    hi, lo, ig, u, xm = gates.gates_padded(i.to(DEV), f.to(DEV), L)
    beta, ig64, u64, xm64 = (x.reshape(B, H, -1) for x in ref.gates(i, f, L))
    assert (hi.cpu().double() + lo.cpu().double() - beta).abs().max() < 1e-12 * beta.abs().max()
    assert torch.equal(ig.cpu(), ig64.float())
    assert torch.allclose(u.cpu().double(), u64, rtol=1e-6, atol=1e-5)
    new_max = xm64 != NEG
    assert 0 < new_max.sum() < new_max.numel()  # both kinds of steps occur
    xm = xm.cpu().reshape(B, H, -1)
    assert torch.equal(xm != NEG, new_max)
    assert torch.allclose(xm[new_max], xm64[new_max], rtol=1e-12, atol=1e-12)
