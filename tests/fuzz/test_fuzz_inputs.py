"""Inputs that raised raw tracebacks where an XLSTMKitError (one line; exit status 2 on the
command line) is promised: odd output paths, damaged or hostile JSON in every file the library
reads, absurd generation and training arguments, impossible devices and dtypes, configs too large
to allocate. Each case must end in an XLSTMKitError whose message is one line."""
import os

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError


def _one_line_error(call):
    with pytest.raises(XLSTMKitError) as info:
        call()
    assert "\n" not in str(info.value) and str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=64, d_model=32, n_blocks=1, n_heads=2))


# ------------------------------------------------------------------------------ output paths
ODD_OUTPUTS = {
    "below a file": lambda t: t / "afile" / "model",
    "a file": lambda t: t / "afile",
    "a name of 300 bytes": lambda t: t / ("x" * 300),
    "a name that leaves no room for the staging copy": lambda t: t / ("w" * 250),
    "a long name above": lambda t: t / ("y" * 256) / "model",
    "a link to nothing": lambda t: t / "dangling",
    "below a link to nothing": lambda t: t / "dangling" / "model",
}


@pytest.mark.parametrize("how", ["save", "save_pretrained", "save_pretrained_ours"])
@pytest.mark.parametrize("where", list(ODD_OUTPUTS))
def test_odd_output_paths(small, tmp_path, how, where):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "deeper")
    path = ODD_OUTPUTS[where](tmp_path)
    if how == "save":
        call = lambda: small.save(path)  # noqa: E731
    else:
        call = lambda: small.save_pretrained(path, format="xlstm_kit" if how.endswith("ours") else "hf")  # noqa: E731
    _one_line_error(call)
    assert (tmp_path / "afile").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["afile", "dangling"]  # no staging folder left behind


# ------------------------------------------------------------------------------ configs too large together
def test_a_config_too_large_to_allocate_is_refused_before_allocating(monkeypatch):
    # each field within its bounds, together ~160 billion parameters
    huge = XLSTMConfig(vocab_size=262144, d_model=16384, n_blocks=48, n_heads=8)
    message = _one_line_error(lambda: XLSTMLanguageModel(huge))
    assert "parameters" in message and "GiB" in message and "free on cpu" in message
    with torch.device("meta"):  # its shapes can still be inspected
        XLSTMLanguageModel(huge)
    from xlstm_kit.models import meta

    monkeypatch.setattr(meta, "available_memory", lambda: 2**20)
    message = _one_line_error(lambda: XLSTMLanguageModel(XLSTMConfig.from_name("tiny")))
    assert "502,040 parameters: 1.9 MiB in float32, more than the 1.0 MiB" in message
    monkeypatch.setattr(meta, "available_memory", lambda: None)  # unknown: no refusal
    XLSTMLanguageModel(XLSTMConfig.from_name("tiny"))
