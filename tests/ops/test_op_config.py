"""Every public op with Triton kernels takes its family's kernel config as `config=` and hands it
to the kernels unchanged (the PyTorch path ignores it)."""
import pytest
import torch

from tests.helpers import rel_err
from xlstm_kit.ops import mlstm_chunkwise, slstm_recurrent, slstm_step
from xlstm_kit.ops.mlstm.triton import MLSTMKernelConfig
from xlstm_kit.ops.mlstm.triton import op as mlstm_op
from xlstm_kit.ops.slstm.triton import op as slstm_op, step as slstm_step_mod
from xlstm_kit.ops.slstm.triton.config import default_config


def _mlstm_inputs(T=40, H=2, K=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, K, generator=g) for _ in range(3))
    return q, k, v, torch.randn(1, T, H, generator=g), 3 + torch.randn(1, T, H, generator=g)


def _slstm_inputs(B=2, T=5, H=2, D=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, T, 4, H, D, generator=g), 0.1 * torch.randn(4, H, D, D, generator=g),
            torch.randn(4, H, D, generator=g))


def test_mlstm_chunkwise_runs_the_given_config():
    xs = _mlstm_inputs()
    ref, _ = mlstm_chunkwise(*xs, backend="torch", config=MLSTMKernelConfig.tuned(16, 16, torch.float32, 16))
    for chunk in (16, 32):
        cfg = MLSTMKernelConfig.tuned(16, 16, torch.float32, chunk)
        h, _ = mlstm_chunkwise(*xs, backend="triton", config=cfg)
        assert rel_err(h, ref) < 1e-4


@pytest.mark.parametrize("op", ["mlstm_chunkwise", "slstm_recurrent", "slstm_step"])
def test_the_config_reaches_the_launcher(monkeypatch, op):
    seen = []
    if op == "mlstm_chunkwise":
        cfg, call = MLSTMKernelConfig(), lambda c: mlstm_chunkwise(*_mlstm_inputs(), backend="triton", config=c)
        module, name = mlstm_op, "mlstm_chunkwise_triton"
    else:
        x, r, b = _slstm_inputs()
        cfg = default_config(8)
        if op == "slstm_recurrent":
            call, module, name = (lambda c: slstm_recurrent(x, r, b, backend="triton", config=c),
                                  slstm_op, "slstm_recurrent_triton")
        else:
            call, module, name = lambda c: slstm_step(x[:, 0], r, b, config=c), slstm_step_mod, "slstm_step_triton"
            monkeypatch.setattr("xlstm_kit.ops.slstm.choose_backend", lambda *a, **k: "triton")
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: seen.append(k.get("config")) or real(*a, **k))
    call(cfg)
    assert seen == [cfg]
