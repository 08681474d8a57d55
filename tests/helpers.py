"""Shared test utilities: the relative error every tolerance in the tests is stated in."""
import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| computed in float64; fails on NaN/inf in `a`."""
    a = a.detach().double()
    b = b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the tested tensor"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_outside_interpreter(code: str) -> str:
    """stdout of `python -c code` from the repository root without TRITON_INTERPRET (under it
    Triton kernels are not compilable objects): the sm_90 compile checks. Fails on a non-zero
    exit with the end of its stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
