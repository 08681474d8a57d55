"""The FSDP settings' one-line refusals (the multi-process FSDP tests are not in the suite yet)."""
import pytest

from xlstm_kit import training as T
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.training.config import RESUME_FROZEN
from xlstm_kit.training.distributed import init_distributed


def test_parallel_is_checked_and_frozen_on_resume():
    assert T.TrainConfig().parallel == "ddp"
    assert T.TrainConfig(parallel="fsdp").parallel == "fsdp"
    with pytest.raises(XLSTMKitError, match="parallel must be one of"):
        T.TrainConfig(parallel="zero3")
    assert "parallel" in RESUME_FROZEN


def test_fsdp_without_torchrun_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(XLSTMKitError, match="needs torchrun") as e:
        init_distributed(parallel="fsdp")
    assert "\n" not in str(e.value)
    assert not init_distributed().enabled  # ddp without torchrun: one process, as before
