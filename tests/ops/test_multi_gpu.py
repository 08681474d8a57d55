"""Triton kernels on a GPU other than the current one (a model on cuda:1 while cuda:0 is current):
Triton launches on the current device, so the entry points must switch to the tensors' device.
Needs two GPUs (`-m gpu` on the 2-GPU machine); the 1-GPU and CPU runs deselect or skip it."""
import pytest
import torch

from tests.helpers import rel_err
from xlstm_kit.ops.dplr import dplr_chunkwise, dplr_step
from xlstm_kit.ops.mlstm import mlstm_chunkwise, mlstm_step
from xlstm_kit.ops.slstm import slstm_recurrent

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


def _grads(fn, xs, seed=0):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    out = out[0] if isinstance(out, tuple) else out
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out)  # same for both runs
    out.backward(g)
    return out.detach(), [x.grad for x in xs]


@pytest.mark.parametrize("op", ["mlstm", "slstm", "dplr"])
def test_kernels_run_on_the_tensors_gpu(op):
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    B, T, H, D = 2, 70, 2, 64
    if op == "mlstm":
        xs = [torch.randn(B, T, H, D, device=dev) for _ in range(3)] + [torch.randn(B, T, H, device=dev) for _ in range(2)]
        run = lambda be: (lambda *x: mlstm_chunkwise(*x, backend=be))  # noqa: E731
    elif op == "slstm":
        xs = [torch.randn(B, T, 4, H, D, device=dev), torch.randn(4, H, D, D, device=dev) / D ** 0.5,
              torch.randn(4, H, D, device=dev)]
        run = lambda be: (lambda *x: slstm_recurrent(*x, backend=be))  # noqa: E731
    else:
        q, k, v = (torch.randn(B, T, H, D, device=dev) for _ in range(3))
        a = torch.nn.functional.normalize(torch.randn(B, T, H, D, device=dev), dim=-1)
        xs = [q, k, v, -a, a * torch.rand(B, T, H, 1, device=dev), -torch.rand(B, T, H, D, device=dev)]
        run = lambda be: (lambda *x: dplr_chunkwise(*x, backend=be))  # noqa: E731
    out, grads = _grads(run("triton"), xs)
    ref, ref_grads = _grads(run("torch"), xs)
    assert torch.cuda.current_device() == 0 and out.device == dev
    assert rel_err(out, ref) < 1e-4
    for g, r in zip(grads, ref_grads):
        assert g.device == dev and rel_err(g, r) < 1e-3


def test_decode_steps_run_on_the_tensors_gpu():
    torch.cuda.set_device(0)
    dev = torch.device("cuda:1")
    B, H, K = 3, 2, 64
    q, k, v = (torch.randn(B, H, K, device=dev) for _ in range(3))
    i, f = torch.randn(B, H, device=dev), torch.randn(B, H, device=dev)
    h, _ = mlstm_step(q, k, v, i, f, None)
    assert h.device == dev and torch.isfinite(h).all()
    a = torch.nn.functional.normalize(torch.randn(B, H, K, device=dev), dim=-1)
    o, s = dplr_step(q, k, v, -a, a * 0.5, -torch.rand(B, H, K, device=dev), None)
    assert o.device == dev and s.device == dev and torch.isfinite(o).all()
