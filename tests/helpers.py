"""Shared test utilities (DESIGN.md §3 tolerance vocabulary)."""
import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| computed in float64; fails on NaN/inf in `a`."""
    a = a.detach().double()
    b = b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the tested tensor"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
