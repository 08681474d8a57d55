"""The one backend choice (xlstm_kit.ops.backend): what each kernel module says it supports."""
import pytest
import torch

from xlstm_kit.ops import backend
from xlstm_kit.ops._config import KernelConfig
from xlstm_kit.ops._checks import compute_dtype

import dataclasses

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_choice_asks_the_kernel_module():
    assert backend.choose_backend("mlstm_chunkwise", None, CPU, dtype=torch.float32) == "torch"
    assert backend.choose_backend("mlstm_chunkwise", None, CUDA, dtype=torch.float32) == "triton"
    # float64 is reference work: the kernels decline it, auto falls back, forcing explains why
    assert backend.choose_backend("mlstm_chunkwise", None, CUDA, dtype=torch.float64) == "torch"
    with pytest.raises(backend.BackendUnavailableError, match="float64"):
        backend.choose_backend("mlstm_chunkwise", "triton", CUDA, dtype=torch.float64)
    # a step that needs a gradient must not reach a kernel without a backward
    assert backend.choose_backend("mlstm_step", None, CUDA, dtype=torch.float32, requires_grad=True) == "torch"
    assert backend.choose_backend("dplr_step", None, CUDA, K=64, V=64, dtype=torch.float32,
                                  requires_grad=True) == "torch"
    assert backend.choose_backend("dplr_chunkwise", None, CUDA, K=24, V=64, chunk_size=64,
                                  dtype=torch.float32) == "torch"
    with pytest.raises(backend.BackendUnavailableError, match="power of two"):
        backend.choose_backend("dplr_chunkwise", "triton", CUDA, K=24, V=64, chunk_size=64, dtype=torch.float32)


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    # triton.jit reads TRITON_INTERPRET when a kernel module is imported: import it under the
    # suite's own setting, or every later sLSTM kernel test in this process runs uninterpreted
    backend.kernel_module("slstm_recurrent")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(backend.BackendUnavailableError, match="TRITON_INTERPRET"):
        backend.choose_backend("slstm_recurrent", "triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.choose_backend("slstm_recurrent", "triton", CPU) == "triton"


def test_ops_without_kernel_and_without_triton(monkeypatch):
    with pytest.raises(backend.BackendUnavailableError, match="mlstm_recurrent"):
        backend.choose_backend("mlstm_recurrent", "triton", CUDA)
    assert backend.choose_backend("mlstm_recurrent", None, CUDA) == "torch"
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    assert backend.choose_backend("mlstm_chunkwise", None, CUDA, dtype=torch.float32) == "torch"
    with pytest.raises(backend.BackendUnavailableError, match="'triton' package"):
        backend.choose_backend("mlstm_chunkwise", "triton", CUDA, dtype=torch.float32)
    with pytest.raises(ValueError, match="backend must be"):
        backend.choose_backend("mlstm_chunkwise", "cuda", CUDA)


def test_every_kernel_module_answers():
    for op in backend.KERNEL_MODULES:
        assert callable(backend.kernel_module(op).supports), op


def test_compute_dtype_is_one_rule():
    x16, x64 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)
    assert compute_dtype(x16, None, torch.float16) == torch.float32
    assert compute_dtype(x16, x64) == torch.float64
    assert compute_dtype(torch.float64) == torch.float64


def test_kernel_config_rejects_unknown_fields_and_round_trips():
    @dataclasses.dataclass(frozen=True)
    class Cfg(KernelConfig):
        tile: int = 64
        mode: str = "a"

    c = Cfg()
    assert c.replace(tile=32).tile == 32 and c.tile == 64
    with pytest.raises(ValueError, match="no field tiel"):
        c.replace(tiel=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tile = 1
    assert Cfg.from_key(c.replace(mode="b").key()) == Cfg(mode="b")
